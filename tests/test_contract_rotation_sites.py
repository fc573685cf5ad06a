"""Where each layer's keys are turned (``CacheContract.rotation_sites``): validation, JSON, and
the boundary, which refuses a difference only where the stored keys would be read wrong."""

import json

import pytest

from ropekv.contract import CacheContract
from ropekv.errors import ConfigError, ContractMismatch
from ropekv.rope import RopeSpec
from ropekv.transfer.importer import plan_import

ROPE = RopeSpec(head_dim=8, rotary_dim=8, theta=10000.0)
ORT = ("kernel_write",) * 3  # ONNX Runtime GenAI's GroupQueryAttention with do_rotary=1 on every layer


def make(**changes) -> CacheContract:
    base = dict(key_form="rotated", rope=ROPE, num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
    base.update(changes)
    return CacheContract(**base)


def test_default_sites_follow_the_key_form_and_are_left_out_of_the_document():
    rotated, raw = make(), make(key_form="raw")
    assert [rotated.layer_rotation(i) for i in range(3)] == ["op"] * 3
    assert [raw.layer_rotation(i) for i in range(3)] == ["kernel_read"] * 3
    for c in (rotated, raw):
        data = json.loads(c.to_json())
        assert c.rotation_sites is None and data["version"] == 5 and "rotation_sites" not in data
    # Sites spelled out but all default are the same contract (and the same fingerprint) as None.
    assert make(rotation_sites=("op",) * 3) == rotated
    assert make(rotation_sites=["op", "op", "op"]).fingerprint() == rotated.fingerprint()
    assert make(key_form="raw", rotation_sites=("kernel_read",) * 3).rotation_sites is None


def test_a_kernel_that_turns_keys_before_writing_them_is_its_own_site():
    ort = make(rotation_sites=ORT)
    assert ort.rotation_sites == ORT and ort.layer(1).rotation == "kernel_write"
    assert not ort.kernel_rotates  # the cache holds rotated keys; nothing turns them on read
    data = json.loads(ort.to_json())
    assert data["version"] == 5 and data["rotation_sites"] == list(ORT)
    assert "chunk_size" not in data and "chunk_layers" not in data  # no chunked layer
    back = CacheContract.from_json(ort.to_json())
    assert back == ort and back.fingerprint() == ort.fingerprint() != make().fingerprint()


def test_sites_are_per_layer():
    mixed = make(rotation_sites=("op", "kernel_write", "op"))
    assert [mixed.layer_rotation(i) for i in range(3)] == ["op", "kernel_write", "op"]
    assert CacheContract.from_json(mixed.to_json()) == mixed


def test_sites_keep_chunked_layers():
    chunked = make(chunk_size=4, chunk_layers=(2,), rotation_sites=ORT)
    data = json.loads(chunked.to_json())
    assert data["version"] == 5 and data["chunk_layers"] == [2]
    assert CacheContract.from_json(chunked.to_json()) == chunked


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(key_form="raw", rotation_sites=ORT),
            r"rotation_sites\[0\]='kernel_write' with key_form='raw'.*position 0",
        ),
        (dict(rotation_sites=("op", "kernel_read", "op")), r"rotation_sites\[1\]='kernel_read'.*twice their position"),
        (dict(rotation_sites=("kernel_write",) * 2), "one site per layer"),
        (dict(rotation_sites=("op", "fused", "op")), r"rotation_sites\[1\] must be one of"),
        (dict(rotation_sites="kernel_write"), "one site per layer"),
    ],
)
def test_invalid_sites_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        make(**changes)


DROP = object()


def _doc(**changes) -> str:
    """The document of an ONNX Runtime contract with ``changes`` (``DROP`` removes a field)."""
    data = json.loads(make(rotation_sites=ORT).to_json())
    data.update(changes)
    return json.dumps({k: v for k, v in data.items() if v is not DROP})


@pytest.mark.parametrize(
    "doc, message",
    [
        (_doc(rotation_sites=["op", "op", "op"]), "not the default of key form 'rotated'"),
        (_doc(rotation_sites="kernel_write"), "must be a list"),
        (_doc(rotation_sites=["kernel_write"] * 2), "one site per layer"),
        (_doc(version=4), "version 4 is not supported"),
        (_doc(key_form=["rotated"]), "must be a list|key_form must be one of|wrong type"),
    ],
)
def test_malformed_site_documents_are_refused(doc, message):
    with pytest.raises(ConfigError, match=message):
        CacheContract.from_json(doc)


def test_sites_that_store_the_same_keys_are_compatible_at_the_boundary():
    """ONNX Runtime's kernel and a separate RoPE op both leave R(j) k_j in the cache: keys move between
    them as they are, in either direction."""
    ort, op = make(rotation_sites=ORT), make()
    assert ort.diff(op) == [] and op.diff(ort) == []
    ort.require_compatible(op)
    op.require_compatible(ort)
    assert plan_import(op, ort) is None and plan_import(ort, op) is None


def test_a_site_that_stores_raw_keys_is_refused_as_a_key_form_difference():
    """A reader that turns keys on read (raw keys) fed ONNX Runtime's rotated keys would turn them again:
    refused, named key_form, and converted once where the caller asks."""
    ort, raw = make(rotation_sites=ORT), make(key_form="raw")
    with pytest.raises(ContractMismatch, match="twice their position") as info:
        raw.require_compatible(ort)
    assert info.value.fields == ("key_form",)
    assert plan_import(raw, ort, convert="explicit") == "unrotate"
    assert plan_import(ort, raw, convert="explicit") == "rotate"


def test_switching_the_key_form_resets_the_sites():
    ort = make(rotation_sites=ORT)
    assert ort.with_key_form("raw").rotation_sites is None
    assert ort.with_key_form("raw").layer_rotation(0) == "kernel_read"
    assert ort.with_key_form("rotated").rotation_sites == ORT
