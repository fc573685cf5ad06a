"""The paged-cache unpacking against vLLM's own cache writer (``cpu_attn_reshape_and_cache``), for each
CPU kernel layout, without starting an engine.

Whether vLLM's CPU build can write the ``amx`` layout depends on the processor: on the Intel machines
of earlier runs it did (even without AMX tiles); on an AMD EPYC without AVX-512 its writer refuses it
("Unsupported CPU attention configuration"), and vLLM never selects it there. Where it is refused, the
``amx`` cases are judged against the layout as vLLM's kernel documents it, written out below cell by
cell (an independent statement of the order, not ropekv's), and a test records the refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm import _custom_ops as ops

from ropekv.adapters.vllm import kv_layout
from ropekv.errors import AdapterError

LAYOUTS = [("vec", torch.float32), ("vec", torch.bfloat16), ("vec16", torch.float32), ("amx", torch.bfloat16)]


def _vllm_writes(isa, dtype=torch.bfloat16):
    """Whether this vLLM build, on this processor, has the cache writer of ``isa``."""
    kv = torch.zeros(1, 1, 32, 128, dtype=dtype)
    key_cache, value_cache = kv_layout.kernel_views(kv)
    keys = torch.zeros(1, 1, 64, dtype=dtype)
    try:
        ops.cpu_attn_reshape_and_cache(keys, keys, key_cache, value_cache, torch.tensor([0]), isa)
    except RuntimeError as exc:
        assert "Unsupported CPU attention configuration" in str(exc), exc
        return False
    return True


AMX_WRITER = _vllm_writes("amx")


def _written_as_documented(dtype, block_size, head_dim, slots, keys, num_blocks):
    """The amx layout of vLLM's kernel: a block's keys of one head are ``[B/16][D/2][16][2]`` (16-token
    tiles, channel pairs interleaved): (token n, channel d) at cell
    ``((n // 16 * D/2 + d // 2) * 16 + n % 16) * 2 + d % 2`` of the head's key half."""
    kv = torch.zeros(num_blocks, keys.shape[1], block_size, 2 * head_dim, dtype=dtype)
    for t, slot in enumerate(slots.tolist()):
        block, n = divmod(slot, block_size)
        for h in range(keys.shape[1]):
            cells = kv[block, h].view(-1)  # the key half is the head's first B * D cells
            for d in range(head_dim):
                cells[((n // 16 * (head_dim // 2) + d // 2) * 16 + n % 16) * 2 + d % 2] = keys[t, h, d]
    return kv, kv_layout.kernel_views(kv)[0]


def _written_by_vllm(isa, dtype, block_size, head_dim, slots, keys, num_blocks=6):
    if isa == "amx" and not AMX_WRITER:
        return _written_as_documented(dtype, block_size, head_dim, slots, keys, num_blocks)
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
    layouts = (("vec", torch.float32), ("amx", torch.bfloat16)) if AMX_WRITER else (("vec", torch.float32),)
    for isa, dtype in layouts:
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


def test_vllm_writes_the_portable_layouts_and_refuses_amx_only_without_amx_tiles():
    """vec and vec16 are written on every processor; amx is refused only on a processor without AMX
    tiles, where vLLM never selects it (``_get_attn_isa``), so no cache there holds that layout."""
    assert _vllm_writes("vec", torch.float32) and _vllm_writes("vec16", torch.float32)
    if not AMX_WRITER:  # refused only where the processor has no AMX tiles
        assert "amx_tile" not in Path("/proc/cpuinfo").read_text().split()


def test_an_unknown_kernel_isa_is_refused():
    kv = torch.zeros(2, 1, 32, 128)
    key_cache, _ = kv_layout.kernel_views(kv)
    with pytest.raises(AdapterError, match="neon"):
        kv_layout.read_keys(key_cache, torch.tensor([0]), "neon")
