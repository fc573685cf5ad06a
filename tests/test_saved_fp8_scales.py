"""A saved 8-bit cache whose scales lie about their shape (checksum recomputed): per-head scales of
the wrong length, or a scalar where a vector belongs, in every block layout, are typed refusals
(PayloadError naming the tensor), never accepted and never a traceback."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from ropekv.adapters.native import NativeAdapter
from ropekv.contract import BLOCK_LAYOUTS
from ropekv.errors import PayloadError
from ropekv.models import load_checkpoint
from ropekv.parity.cases import Case, token_stream
from ropekv.transfer import payload
from ropekv.transfer.saved import load_sequence, save_sequence

CASE = Case(length=16, block_size=4)


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


def _forged(data: bytes, edit) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    tensors = load(data)
    edit(tensors)
    entries = [
        (k, payload._st_dtype(t), list(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        for k, t in sorted(tensors.items())
    ]
    meta["checksum"] = payload._checksum(meta, entries)
    return save(tensors, metadata=meta)


def _other_length(t: dict) -> None:
    s = t["layers.0.k_scale"]
    t["layers.0.k_scale"] = s[:1].clone() if s.numel() > 1 else torch.cat([s, s])


def _scalar(t: dict) -> None:
    t["layers.0.k_scale"] = t["layers.0.k_scale"][0].clone().reshape(())


@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
@pytest.mark.parametrize("granularity", ["per_head", "per_tensor"])
@pytest.mark.parametrize("edit, shape", [(_other_length, r"\[\d\]"), (_scalar, r"\[\]")])
def test_scales_of_another_shape_are_a_payload_error(tmp_path, tiny_llama, layout, granularity, edit, shape):
    adapter = NativeAdapter(
        tiny_llama, kv_dtype="fp8", kv_scale=granularity, contract_change=lambda c: c.replace(block_layout=layout)
    )
    engine = adapter.make_engine(CASE)
    tokens = token_stream(tiny_llama.config.vocab_size, CASE.length, 0)
    engine.prefill("s", tokens)
    path = tmp_path / "s.safetensors"
    save_sequence(engine, "s", path, tokens)
    path.write_bytes(_forged(path.read_bytes(), edit))
    reader = adapter.make_engine(CASE)
    before = reader.cache.state_digest()
    with pytest.raises(PayloadError, match=rf"'layers.0.k_scale' is F32 {shape}; its contract .* call for F32"):
        load_sequence(reader, path)
    assert reader.cache.seq_ids() == [] and reader.cache.state_digest() == before, "nothing was imported"
