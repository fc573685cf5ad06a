"""A layer's keys or values as a transfer lays them out: the contract's ``block_layout``.

Within ropekv a layer's keys (or values) are rows ``[rows, KVH, D]``, one row per held token. A
transfer carries them in the block layout its contract names (:data:`~ropekv.contract.BLOCK_LAYOUTS`;
keys and values are the two halves of the ``2`` axis, carried as separate tensors):

- ``"blocks,2,block,heads,dim"``: ``[rows, KVH, D]`` as they are, which are the bytes of
  ``[blocks, block_size, KVH, D]`` (the last block cut at ``rows``);
- ``"blocks,2,heads,block,dim"``: ``[blocks, KVH, block_size, D]``, each block's heads outermost; the
  rows are zero-padded to ``blocks * block_size``.

:func:`misread_rows` is what a reader that reads one layout's bytes as the other's gets (the fault of
``ropekv.bugs.block_layout_mismatch``), and :func:`misread_source` where each row and head it reads came from,
derived from the shapes alone (what the forensics compare against).
"""

from __future__ import annotations

import torch

from ..contract import BLOCK_LAYOUTS
from ..errors import UsageError

HEADS_OUTER = "blocks,2,heads,block,dim"
TOKENS_OUTER = "blocks,2,block,heads,dim"


def _check(layout: str, block_size: int) -> None:
    if layout not in BLOCK_LAYOUTS:
        raise UsageError(f"block layout must be one of {BLOCK_LAYOUTS}, got {layout!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise UsageError(f"block layout: block_size must be a positive integer, got {block_size!r}")


def num_blocks(rows: int, block_size: int) -> int:
    return -(-rows // block_size)


def wire_shape(layout: str, rows: int, num_kv_heads: int, head_dim: int, block_size: int) -> list[int]:
    """The shape a layer's ``[rows, KVH, D]`` keys (or values) travel as under ``layout``."""
    _check(layout, block_size)
    if layout == TOKENS_OUTER:
        return [rows, num_kv_heads, head_dim]
    return [num_blocks(rows, block_size), num_kv_heads, block_size, head_dim]


def to_wire(rows: torch.Tensor, layout: str, block_size: int) -> torch.Tensor:
    """``rows [rows, KVH, D]`` laid out as ``layout`` (contiguous; a copy unless already so)."""
    _check(layout, block_size)
    if layout == TOKENS_OUTER:
        return rows.contiguous()
    n, kvh, d = rows.shape
    nb = num_blocks(n, block_size)
    padded = torch.zeros((nb * block_size, kvh, d), dtype=rows.dtype, device=rows.device)
    padded[:n] = rows
    return padded.view(nb, block_size, kvh, d).permute(0, 2, 1, 3).contiguous()  # [nb, KVH, B, D]


def from_wire(wire: torch.Tensor, layout: str, block_size: int, rows: int) -> torch.Tensor:
    """Inverse of :func:`to_wire`: the ``[rows, KVH, D]`` rows of a tensor laid out as ``layout``."""
    _check(layout, block_size)
    if layout == TOKENS_OUTER:
        return wire
    nb, kvh, b, d = wire.shape
    return wire.permute(0, 2, 1, 3).reshape(nb * b, kvh, d)[:rows].contiguous()


def misread_rows(rows: torch.Tensor, sent: str, read: str, block_size: int) -> torch.Tensor:
    """What a reader gets that reads the bytes of ``rows [rows, KVH, D]`` laid out as ``sent`` as if
    they were laid out as ``read``: the same bytes, another shape (``[rows, KVH, D]``)."""
    _check(read, block_size)
    wire = to_wire(rows, sent, block_size).reshape(-1)
    n, kvh, d = rows.shape
    if read == TOKENS_OUTER:
        nb = num_blocks(n, block_size)
        # a block-major reader reads whole blocks of [block_size, KVH, D]; a short payload ends early
        full = torch.zeros(nb * block_size * kvh * d, dtype=rows.dtype, device=rows.device)
        full[: wire.numel()] = wire
        return full.view(nb * block_size, kvh, d)[:n].clone()
    nb = num_blocks(n, block_size)
    full = torch.zeros(nb * kvh * block_size * d, dtype=rows.dtype, device=rows.device)
    m = min(wire.numel(), full.numel())
    full[:m] = wire[:m]
    return from_wire(full.view(nb, kvh, block_size, d), HEADS_OUTER, block_size, n)


def misread_source(row: int, head: int, sent: str, read: str, num_kv_heads: int, block_size: int) -> tuple[int, int]:
    """Which sent ``(row, head)`` a reader that reads ``sent`` bytes as ``read`` finds at ``(row, head)``
    (derived from the shapes: the byte offset of one ``D``-run under ``read``, decoded under ``sent``).
    A row past the sent rows is padding (zeros)."""
    _check(sent, block_size)
    _check(read, block_size)
    b, o = divmod(row, block_size)
    kvh, bs = num_kv_heads, block_size
    # index of the D-run within its block under the read layout, then decoded under the sent one
    run = o * kvh + head if read == TOKENS_OUTER else head * bs + o
    if sent == TOKENS_OUTER:
        src_o, src_h = divmod(run, kvh)
    else:
        src_h, src_o = divmod(run, bs)
    return b * bs + src_o, src_h
