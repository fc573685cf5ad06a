"""The contract sidecar of a vLLM KV store entry (ropekv/adapters/vllm/sidecar.py), without vLLM."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import pytest

from ropekv.adapters.vllm import sidecar as sc
from ropekv.contract import CacheContract, FieldDiff
from ropekv.errors import ConfigError, ContractMismatch
from ropekv.rope import RopeSpec

NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
TOKENS = list(range(100, 164))
rep = dataclasses.replace


def engine(**changes) -> sc.EngineContract:
    rope = RopeSpec(head_dim=64, rotary_dim=64, theta=100000.0, max_position_embeddings=8192)
    contract = CacheContract(key_form="rotated", rope=rope, num_layers=3, num_kv_heads=3, head_dim=64, block_size=32)
    base = sc.EngineContract(
        contract=contract,
        kv_cache_dtype="auto",
        kernel_isa="vec",
        attention_backend="CPUAttentionBackendImpl",
        kv_row_shape=(3, 128),
        layer_names=NAMES,
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture
def entry(tmp_path):
    """An entry folder with three layer files and their sidecar, as a producer leaves it."""
    folder = tmp_path / "store" / "abc123"
    folder.mkdir(parents=True)
    files = []
    for i, name in enumerate(NAMES):
        data = bytes([i]) * (1000 + i)
        (folder / f"{name}.safetensors").write_bytes(data)
        files.append(sc.LayerFile(f"{name}.safetensors", len(data), hashlib.sha256(data).hexdigest()))
    side = sc.Sidecar(
        engine=engine(),
        key=folder.name,
        num_tokens=len(TOKENS),
        position_start=0,
        tokens_sha256=sc.tokens_digest(TOKENS),
        layers=tuple(files),
    )
    sc.write_sidecar(folder, side)
    return folder, side


def test_round_trip_and_a_sound_entry_has_no_difference(entry):
    folder, side = entry
    read = sc.read_sidecar(folder)
    assert read == side
    assert sc.compare(engine(), read, TOKENS) == []
    diffs, data = sc.verify_files(folder, read)
    assert diffs == [] and data[NAMES[1]] == bytes([1]) * 1001


def test_atomic_write_leaves_no_temporary_and_replaces_whole(entry, monkeypatch):
    folder, side = entry
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".safetensors")) == [sc.SIDECAR]
    before = (folder / sc.SIDECAR).read_bytes()

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken)  # the write fails after the temporary file was written
    with pytest.raises(OSError, match="disk full"):
        sc.write_sidecar(folder, dataclasses.replace(side, position_start=5))
    assert (folder / sc.SIDECAR).read_bytes() == before  # the old sidecar, whole
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".safetensors")) == [sc.SIDECAR]


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda e: rep(e, contract=e.contract.replace(rope=e.contract.rope.replace(theta=20000.0))), "rope.theta"),
        (lambda e: rep(e, contract=e.contract.replace(dtype="bfloat16")), "dtype"),
        (lambda e: rep(e, contract=e.contract.replace(weights_fingerprint="ffff")), "weights_fingerprint"),
        (lambda e: rep(e, kernel_isa="amx"), "kernel_isa"),
        (lambda e: rep(e, kv_cache_dtype="fp8"), "kv_cache_dtype"),
        (lambda e: rep(e, kv_row_shape=(3, 64)), "kv_row_shape"),
    ],
)
def test_each_differing_field_is_named_with_both_values_and_its_consequence(entry, change, field):
    folder, side = entry
    theirs = dataclasses.replace(side, engine=change(side.engine))
    diffs = sc.compare(engine(), theirs, TOKENS)
    assert [d.field for d in diffs] == [field]
    error = sc.refusal(diffs)
    assert isinstance(error, ContractMismatch) and error.fields == (field,)
    assert str(error).startswith("consumer and producer cache contracts differ in 1 field(s): " + field)
    assert sc.entry_consequence(diffs[0]) in str(error)


def test_tokens_and_positions_are_compared(entry):
    _, side = entry
    assert [d.field for d in sc.compare(engine(), side, TOKENS[:-1] + [7])] == ["tokens"]
    assert [d.field for d in sc.compare(engine(), side, TOKENS[:32])] == ["tokens"]
    shifted = dataclasses.replace(side, position_start=32)
    (diff,) = sc.compare(engine(), shifted, TOKENS)
    assert (diff.field, diff.ours, diff.theirs) == ("positions", "0..63", "32..95")


def test_changed_truncated_grown_or_missing_layer_files_are_named(entry):
    folder, side = entry
    one = folder / f"{NAMES[1]}.safetensors"
    one.write_bytes(b"\x09" + one.read_bytes()[1:])  # same size, one byte changed
    (folder / f"{NAMES[2]}.safetensors").write_bytes(b"\x02" * 10)  # truncated
    diffs, data = sc.verify_files(folder, side)
    assert [d.field for d in diffs] == ["checksum.layers.1", "checksum.layers.2"]
    assert set(data) == {NAMES[0]}  # only checked bytes are handed back
    one.write_bytes(one.read_bytes() + b"x" * 10)  # grown past its recorded size
    (folder / f"{NAMES[0]}.safetensors").unlink()
    diffs, data = sc.verify_files(folder, side)
    assert [d.field for d in diffs] == ["checksum.layers.0", "checksum.layers.1", "checksum.layers.2"]
    assert data == {}


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(version=2), "version 1"),
        (lambda d: d.update(extra=1), "exactly the fields"),
        (lambda d: d.update(num_tokens=0), "num_tokens"),
        (lambda d: d.update(num_tokens=True), "num_tokens"),
        (lambda d: d.update(tokens_sha256="xyz"), "tokens_sha256"),
        (lambda d: d.update(key="../etc"), "plain folder name"),
        (lambda d: d["layers"][0].update(name="../../x.safetensors"), "file name"),
        (lambda d: d["layers"][0].update(size=-1), "size"),
        (lambda d: d["layers"].pop(), "one layer file per layer name"),
        (lambda d: d["engine"]["layer_names"].__setitem__(0, "../x"), "plain file name"),
        (lambda d: d["engine"]["contract"].update(key_form="twice"), "key_form"),
        (lambda d: d["engine"].pop("kernel_isa"), "exactly"),
    ],
)
def test_malformed_sidecars_are_refused_with_a_reason(entry, edit, match):
    folder, side = entry
    data = json.loads(side.to_json())
    edit(data)
    with pytest.raises(ConfigError, match=match):
        sc.Sidecar.from_json(json.dumps(data))


def test_sidecar_size_is_bounded_and_missing_is_none(entry):
    folder, _ = entry
    (folder / sc.SIDECAR).write_bytes(b" " * (sc.MAX_SIDECAR_BYTES + 1))
    with pytest.raises(ConfigError, match="more than"):
        sc.read_sidecar(folder)
    (folder / sc.SIDECAR).unlink()
    assert sc.read_sidecar(folder) is None
    (folder / sc.SIDECAR).write_text("{not json")
    with pytest.raises(ConfigError, match="does not parse"):
        sc.read_sidecar(folder)


def test_refusals_are_appended_one_json_line_each(tmp_path):
    error = sc.refusal([FieldDiff("sidecar", "a contract sidecar", "none")])
    sc.append_refusal(tmp_path, request_id="r1", key="k", error=error, policy="recompute")
    sc.append_refusal(tmp_path, request_id="r2", key="k", error=error, policy="fail", run="run-1")
    lines = (tmp_path / sc.REFUSALS).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [sorted(r) for r in records] == [["fields", "key", "message", "policy", "request_id", "run"]] * 2
    assert [r["run"] for r in records] == [None, "run-1"]
    assert [(r["request_id"], r["policy"], r["fields"]) for r in records] == [
        ("r1", "recompute", ["sidecar"]),
        ("r2", "fail", ["sidecar"]),
    ]
    assert "nothing says which model, RoPE, dtype or layout produced its keys" in records[0]["message"]


def test_a_layer_declared_larger_than_its_entry_can_be_is_refused_unread(entry, monkeypatch):
    """A sidecar declaring a 20 GiB layer file (sparse, 20 GiB on disk) for 64 tokens of [3, 128]: the
    size alone refuses it, before any byte is read or any buffer allocated."""
    folder, side = entry
    big = 20 << 30
    name = f"{NAMES[1]}.safetensors"
    with open(folder / name, "wb") as f:
        f.truncate(big)
    layers = list(side.layers)
    layers[1] = sc.LayerFile(name, big, "0" * 64)
    forged = dataclasses.replace(side, layers=tuple(layers))
    read = []
    real = sc.read_layer_file
    monkeypatch.setattr(sc, "read_layer_file", lambda path, limit: read.append(path.name) or real(path, limit))
    diffs, data = sc.verify_files(folder, forged)
    assert [d.field for d in diffs] == ["checksum.layers.1"]
    assert f"at most {sc.layer_bytes_bound(side)} bytes" in diffs[0].ours and str(big) in diffs[0].theirs
    assert name not in read and set(data) == {NAMES[0], NAMES[2]}
    assert sc.layer_bytes_bound(side) == 8 + sc.LAYER_HEADER_BYTES + 64 * 3 * 128 * 4


def test_an_entry_folder_linked_from_outside_the_store_is_refused(entry, tmp_path):
    folder, _ = entry
    store = folder.parent
    assert sc.entry_location(store, folder) == []
    copy = tmp_path / "elsewhere"
    os.rename(folder, copy)
    os.symlink(copy, folder)  # an identical copy, outside the store, under the entry's name
    (diff,) = sc.entry_location(store, folder)
    assert diff.field == "entry" and str(copy) in diff.theirs and "symbolic link" in diff.theirs


def test_a_layer_file_that_is_a_link_is_refused(entry, tmp_path):
    folder, side = entry
    name = f"{NAMES[0]}.safetensors"
    os.rename(folder / name, tmp_path / name)
    os.symlink(tmp_path / name, folder / name)
    diffs, data = sc.verify_files(folder, side)
    assert [(d.field, d.theirs) for d in diffs] == [("checksum.layers.0", "a symbolic link")]
    assert NAMES[0] not in data
