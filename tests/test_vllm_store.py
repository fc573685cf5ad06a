"""vLLM's ExampleConnector store as ropekv reads and writes it, without vLLM: synthetic entries built
cell by cell from the layout as vLLM's source and a real producer's files show it (an independent
statement, not ropekv's packing), round trips, and refusals of every malformed store, bounded.

The real producer's files are decoded in engine_tests/vllm/test_store.py."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest
import torch
from bounded import bounded
from safetensors.torch import save_file

from ropekv.adapters.vllm import store
from ropekv.errors import PayloadError
from ropekv.parity.cases import token_stream

B, KVH, D = 32, 3, 16  # block size, KV heads, head_dim (the real model's are 32, 3, 64)
T = 64  # two blocks


def _stored_as_vllm_vec(keys: torch.Tensor, values: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """What ExampleConnector writes for a ``vec`` cache, element by element: vLLM's paged cache
    ``[blocks, KVH, B, 2D]``; the CPU kernel puts key (offset n, channel d) of a block and head at cell
    ``d * B + n`` of its memory and value (n, d) at ``B * D + n * D + d``; the connector then saves
    ``cache[block, :, offset]`` for the request's slots in order."""
    cache = torch.zeros(max(block_ids) + 1, KVH, B, 2 * D, dtype=keys.dtype)
    for t in range(keys.shape[0]):
        block, n = block_ids[t // B], t % B
        for h in range(KVH):
            memory = cache[block, h].view(-1)
            for d in range(D):
                memory[d * B + n] = keys[t, h, d]
                memory[B * D + n * D + d] = values[t, h, d]
    slots = [block_ids[t // B] * B + t % B for t in range(keys.shape[0])]
    return torch.stack([cache[s // B, :, s % B] for s in slots])  # [T, KVH, 2D]


def _kv(seed: int = 0, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, KVH, D, generator=g).to(dtype), torch.randn(T, KVH, D, generator=g).to(dtype)


def _write_raw(root: Path, ids: list[int], tensors: list[torch.Tensor]) -> Path:
    folder = root / hashlib.md5(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()
    folder.mkdir()
    for i, t in enumerate(tensors):
        save_file({"kv_cache": t.contiguous()}, str(folder / f"model.layers.{i}.self_attn.attn.safetensors"))
    return folder


IDS = list(range(100, 100 + T))


def test_entry_key_is_the_directory_name_a_real_producer_wrote():
    # vLLM 0.32.0's ExampleConnector wrote this directory for the first 64 tokens of the embedded model's
    # 70-token prompt (scripts/findings/vllm_store_layout.py; engine_tests/vllm/test_store.py checks it live)
    assert store.entry_key(token_stream(49152, 70)[:64]) == "e1db32aa5d65c2483cd3ad0a205bb539"


def test_entry_key_is_the_md5_of_little_endian_int64_ids():
    assert store.entry_key([1, 2]) == hashlib.md5(bytes([1] + [0] * 7 + [2] + [0] * 7)).hexdigest()
    assert store.entry_key(torch.tensor([1, 2])) == store.entry_key([1, 2])
    assert (
        store.entry_key([1, 2], hash_name="sha256") == hashlib.sha256(bytes([1] + [0] * 7 + [2] + [0] * 7)).hexdigest()
    )
    with pytest.raises(PayloadError):
        store.entry_key([1.5])
    with pytest.raises(PayloadError):
        store.entry_key([-1])


def test_the_token_counts_producer_and_consumer_hash():
    assert store.producer_tokens(70, 32) == 64 and store.consumer_tokens(70, 32) == 64
    assert store.producer_tokens(65, 32) == 64 and store.consumer_tokens(65, 32) == 32  # the n % B == 1 gap
    assert store.producer_tokens(32, 32) == 0 and store.producer_tokens(33, 32) == 32


@pytest.mark.parametrize("block_ids", [[0, 1], [3, 1]])
def test_read_entry_unpacks_what_vllm_vec_stores(tmp_path, block_ids):
    layers = [_kv(seed) for seed in range(3)]
    _write_raw(tmp_path, IDS, [_stored_as_vllm_vec(k, v, block_ids) for k, v in layers])
    entry = store.find_entry(tmp_path, IDS)
    assert entry is not None and entry.num_tokens == T and entry.num_layers == 3
    kv = store.read_entry(entry, num_kv_heads=KVH, head_dim=D, block_size=B, isa="vec")
    for i, (k, v) in enumerate(layers):
        assert torch.equal(kv.keys[i], k) and torch.equal(kv.values[i], v)
    assert kv.dtype == torch.float32 and kv.num_tokens == T
    # the raw rows are not token-ordered keys: row 1 is not token 1's key
    raw = _stored_as_vllm_vec(*layers[0], block_ids)
    assert not torch.equal(raw[1, :, :D], layers[0][0][1])


@pytest.mark.parametrize("isa,dtype", [("vec", torch.float32), ("vec16", torch.bfloat16), ("amx", torch.bfloat16)])
def test_write_entry_round_trips_and_writes_vllms_bytes(tmp_path, isa, dtype):
    layers = [_kv(seed, dtype) for seed in range(2)]
    entry = store.write_entry(tmp_path, IDS, [k for k, _ in layers], [v for _, v in layers], isa=isa, block_size=B)
    assert entry == store.find_entry(tmp_path, IDS)
    assert entry.key == hashlib.md5(struct.pack(f"<{T}q", *IDS)).hexdigest()
    kv = store.read_entry(entry, num_kv_heads=KVH, head_dim=D, block_size=B, isa=isa)
    for i, (k, v) in enumerate(layers):
        assert torch.equal(kv.keys[i], k) and torch.equal(kv.values[i], v)
    if isa == "vec":
        from safetensors.torch import load_file

        got = load_file(str(entry.path(0)))["kv_cache"]
        assert torch.equal(got, _stored_as_vllm_vec(*layers[0], [0, 1]))
    assert [p.name for p in tmp_path.iterdir()] == [entry.key]  # no temp dir left


def test_write_entry_is_all_or_nothing(tmp_path, monkeypatch):
    import safetensors.torch as st

    calls = []
    real = st.save_file

    def fail_second(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(tensors, path)

    monkeypatch.setattr(st, "save_file", fail_second)
    k, v = _kv()
    with pytest.raises(PayloadError, match="No space left"):
        store.write_entry(tmp_path, IDS, [k, k, k], [v, v, v], isa="vec", block_size=B)
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temp dir
    assert store.find_entry(tmp_path, IDS) is None


def test_write_entry_refuses_an_existing_entry_unless_overwrite(tmp_path):
    k, v = _kv()
    store.write_entry(tmp_path, IDS, [k], [v], isa="vec", block_size=B)
    with pytest.raises(PayloadError, match="already exists"):
        store.write_entry(tmp_path, IDS, [v], [k], isa="vec", block_size=B)
    entry = store.write_entry(tmp_path, IDS, [v], [k], isa="vec", block_size=B, overwrite=True)
    kv = store.read_entry(entry, num_kv_heads=KVH, head_dim=D, block_size=B, isa="vec")
    assert torch.equal(kv.keys[0], v)
    assert [p.name for p in tmp_path.iterdir()] == [entry.key]


def test_write_entry_refuses_partial_blocks_and_mixed_tensors(tmp_path):
    k, v = _kv()
    with pytest.raises(PayloadError, match="whole blocks"):
        store.write_entry(tmp_path, IDS[:40], [k[:40]], [v[:40]], isa="vec", block_size=B)
    with pytest.raises(PayloadError, match="shape and dtype"):
        store.write_entry(tmp_path, IDS, [k], [v.double()], isa="vec", block_size=B)
    with pytest.raises(PayloadError, match="ISA"):
        store.write_entry(tmp_path, IDS, [k], [v], isa="neon", block_size=B)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_entry_is_none_and_a_missing_store_is_refused(tmp_path):
    assert store.find_entry(tmp_path, IDS) is None
    with pytest.raises(PayloadError, match="not a directory"):
        store.find_entry(tmp_path / "nowhere", IDS)


def _entry_with(tmp_path: Path, tensors: list[torch.Tensor]) -> Path:
    return _write_raw(tmp_path, IDS, tensors)


def _good() -> torch.Tensor:
    return _stored_as_vllm_vec(*_kv(), [0, 1])


def test_an_entry_with_the_contract_connectors_sidecar_reads_as_its_layers(tmp_path):
    layers = [_kv(seed) for seed in range(3)]
    folder = _write_raw(tmp_path, IDS, [_stored_as_vllm_vec(k, v, [0, 1]) for k, v in layers])
    (folder / "ropekv-contract.json").write_text("{}")  # the sidecar is the connector's, not a layer
    entry = store.find_entry(tmp_path, IDS)
    assert entry is not None and entry.num_layers == 3
    kv = store.read_entry(entry, num_kv_heads=KVH, head_dim=D, block_size=B, isa="vec")
    assert all(torch.equal(kv.keys[i], k) for i, (k, _) in enumerate(layers))


@pytest.mark.parametrize(
    "damage,match",
    [
        ("no_files", "no layer files"),
        ("layer_missing", r"layer\(s\) \[1\] missing"),
        ("other_count", "different token counts"),
        ("int_dtype", "dtype 'I64'"),
        ("rank", "not \\[tokens"),
        ("truncated", "truncated or padded"),
        ("padded", "truncated or padded"),
        ("pickle", "header length|not JSON"),
        ("two_tensors", "exactly one tensor"),
        ("stray_file", "unexpected files"),
        ("fifo", "not a regular file"),
        ("wrong_count", "holds 32 tokens under the key of 64"),
    ],
)
def test_malformed_entries_are_refused_in_one_line(tmp_path, damage, match):
    folder = _entry_with(tmp_path, [_good()] * 3)
    path1 = folder / "model.layers.1.self_attn.attn.safetensors"
    if damage == "no_files":
        for p in folder.iterdir():
            p.unlink()
    elif damage == "layer_missing":
        path1.unlink()
    elif damage == "other_count":
        save_file({"kv_cache": _good()[:32].contiguous()}, str(path1))
    elif damage == "int_dtype":
        save_file({"kv_cache": torch.zeros(T, KVH, 2 * D, dtype=torch.int64)}, str(path1))
    elif damage == "rank":
        save_file({"kv_cache": torch.zeros(T, KVH * 2 * D)}, str(path1))
    elif damage == "truncated":
        path1.write_bytes(path1.read_bytes()[:-4])
    elif damage == "padded":
        path1.write_bytes(path1.read_bytes() + b"\0" * 4)
    elif damage == "pickle":
        import pickle

        path1.write_bytes(pickle.dumps({"kv_cache": [1, 2, 3]}))
    elif damage == "two_tensors":
        save_file({"kv_cache": _good(), "other": torch.zeros(1)}, str(path1))
    elif damage == "stray_file":
        (folder / "notes.txt").write_text("x")
    elif damage == "fifo":
        path1.unlink()
        os.mkfifo(path1)
    elif damage == "wrong_count":
        for p in folder.iterdir():
            save_file({"kv_cache": _good()[:32].contiguous()}, str(p))
    with bounded(5.0), pytest.raises(PayloadError, match=match) as info:
        entry = store.find_entry(tmp_path, IDS)
        assert entry is not None
        store.read_entry(entry, num_kv_heads=KVH, head_dim=D, block_size=B, isa="vec")
    assert "\n" not in str(info.value)


def test_a_header_declaring_more_than_the_file_is_refused_before_reading(tmp_path):
    folder = _entry_with(tmp_path, [_good()])
    path = folder / "model.layers.0.self_attn.attn.safetensors"
    header = b'{"kv_cache":{"dtype":"F32","shape":[1048576,64,256],"data_offsets":[0,68719476736]}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    with bounded(5.0), pytest.raises(PayloadError, match="beyond what ropekv reads|do not match"):
        store.find_entry(tmp_path, IDS)


def test_read_entry_refuses_another_models_shape(tmp_path):
    _entry_with(tmp_path, [_good()])
    entry = store.find_entry(tmp_path, IDS)
    assert entry is not None
    with pytest.raises(PayloadError, match=r"shape \[64, 3, 32\], expected \[64, 2, 32\]"):
        store.read_entry(entry, num_kv_heads=2, head_dim=D, block_size=B, isa="vec")
    with pytest.raises(PayloadError, match="whole blocks of 48"):
        store.read_entry(entry, num_kv_heads=KVH, head_dim=D, block_size=48, isa="vec")


def test_list_entries_skips_temp_dirs_and_sorts_layers_by_index(tmp_path):
    k, v = _kv()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(12)]
    store.write_entry(tmp_path, IDS, [k] * 12, [v] * 12, isa="vec", block_size=B, layer_names=names)
    (tmp_path / ".ropekv-tmp-abc").mkdir()
    (entry,) = store.list_entries(tmp_path)
    assert entry.layer_names == tuple(names)  # 2 before 10, not as strings sort
