"""The paged-cache unpacking against vLLM's own cache writer (``cpu_attn_reshape_and_cache``), for each
CPU kernel layout, without starting an engine."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from ropekv.adapters.vllm import kv_layout
from ropekv.errors import AdapterError

LAYOUTS = [("vec", torch.float32), ("vec", torch.bfloat16), ("vec16", torch.float32), ("amx", torch.bfloat16)]


def _written_by_vllm(isa, dtype, block_size, head_dim, slots, keys, num_blocks=6):
    kv = torch.zeros(num_blocks, keys.shape[1], block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv_layout.kernel_views(kv)
    ops.cpu_attn_reshape_and_cache(keys, torch.zeros_like(keys), key_cache, value_cache, slots, isa)
    return kv, key_cache


@pytest.mark.parametrize("isa,dtype", LAYOUTS)
@pytest.mark.parametrize("block_size,head_dim", [(32, 64), (64, 128)])
def test_read_keys_returns_what_vllms_writer_stored(isa, dtype, block_size, head_dim):
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(6 * block_size, generator=gen)[:50]  # scattered over blocks and offsets
    keys = torch.randn(50, 3, head_dim, generator=gen).to(dtype)
    _, key_cache = _written_by_vllm(isa, dtype, block_size, head_dim, slots, keys)
    assert torch.equal(kv_layout.read_keys(key_cache, slots, isa), keys)


@pytest.mark.parametrize("isa,dtype", LAYOUTS)
def test_write_keys_lays_keys_out_exactly_as_vllms_writer(isa, dtype):
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(6 * 32, generator=gen)[:40]
    keys = torch.randn(40, 3, 64, generator=gen).to(dtype)
    kv_vllm, _ = _written_by_vllm(isa, dtype, 32, 64, slots, keys)
    kv_ours = torch.zeros_like(kv_vllm)
    key_cache, _ = kv_layout.kernel_views(kv_ours)
    kv_layout.write_keys(key_cache, slots, keys, isa)
    assert torch.equal(kv_ours, kv_vllm)  # every byte, value half included (left zero by both)


def test_the_documented_cell_orders():
    """vec: cell d * B + n of a block and head holds (token n, channel d); amx: 16-token tiles with
    channel pairs interleaved. Integer-valued keys make every cell's content readable."""
    B, D = 32, 64
    n, d = torch.meshgrid(torch.arange(B), torch.arange(D), indexing="ij")
    keys = n.float()[:, None, :], d.float()[:, None, :]  # token index, then channel index, as values
    for isa, dtype in (("vec", torch.float32), ("amx", torch.bfloat16)):
        cells = []
        for k in keys:
            kv, _ = _written_by_vllm(isa, dtype, B, D, torch.arange(B, 2 * B), k.to(dtype), num_blocks=2)
            cells.append(kv[1, 0].reshape(-1)[: B * D].long())  # block 1, head 0: its key half is the first B*D cells
        token, channel = cells
        if isa == "vec":
            assert (token[5 * B + 7], channel[5 * B + 7]) == (7, 5)
        else:  # [B/16][D/2][16][2]: cell ((tile * D/2 + pair) * 16 + row) * 2 + lane
            cell = ((1 * (D // 2) + 10) * 16 + 3) * 2 + 1
            assert (token[cell], channel[cell]) == (16 + 3, 2 * 10 + 1)


def test_an_unknown_kernel_isa_is_refused():
    kv = torch.zeros(2, 1, 32, 128)
    key_cache, _ = kv_layout.kernel_views(kv)
    with pytest.raises(AdapterError, match="neon"):
        kv_layout.read_keys(key_cache, torch.tensor([0]), "neon")
