"""Forensics of a transfer's block layout: which sent (row, head) each received (row, head) holds.

After a handoff the decode side's keys of the handed-off tokens should be the sender's keys, each at
its own row and head. When the receiver read the sender's block bytes in another order (the
contract's ``block_layout``, :mod:`ropekv.transfer.block_layout`), each received key vector is still
*some* sent key vector, exactly, only at another (row, head). So every received vector is compared
with the reference's keys (float64, rotated as the contract stores them) at every handed-off row and
head; the closest one within :data:`MATCH_TOL` (relative) is its source. When the sources agree with
what one layout read as the other predicts from the shapes alone (:func:`misread_source`), the bug
is ``block_layout_mismatch``. Rows the sender padded a short last block with hold zeros.

Pure: tensors in, a :class:`~ropekv.parity.diagnosis.Diagnosis` or None out.
"""

from __future__ import annotations

import torch

from ..cache.block_layout import HEADS_OUTER, TOKENS_OUTER, misread_source
from ..cache.layout import window_rows
from ..rope import RopeSpec
from .bug_class import BugClass
from .diagnosis import Diagnosis

MATCH_TOL = 1e-2  # relative distance within which a received key vector *is* a sent one (bf16 ~4e-3)
MOST = 0.9  # share of the handed-off (row, head) cells a layout hypothesis must explain
MAX_ROWS = 512  # handed-off rows compared (a [rows * KVH]^2 distance matrix)
_TINY = 1e-12


def distances(sent: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """Relative distances ``[M, R * KVH]`` of each received vector ``received [M, D]`` to each sent one
    ``sent [R, KVH, D]`` (column ``row * KVH + head``); at most :data:`MATCH_TOL` means "is that vector"."""
    r, kvh, d = sent.shape
    ref = sent.to(torch.float64).reshape(r * kvh, d)
    eff = received.to(torch.float64)
    scale = torch.maximum(ref.norm(dim=1)[None, :], eff.norm(dim=1)[:, None]) + _TINY
    return torch.cdist(eff, ref) / scale


def diagnose_block_layout(
    rope: RopeSpec | None,
    k_ref: torch.Tensor,
    k_eff: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    handoff_len: int,
    block_size: int,
    window: int | None = None,
    sinks: int = 0,
    shift: int = 0,
) -> Diagnosis | None:
    """``block_layout_mismatch`` when the handed-off keys of ``k_eff [N, KVH, D]`` (the kernel's, at
    ``key_positions [N]``) are the sender's keys at other rows and heads, as one block layout read as
    the other predicts; None otherwise (including when every handed-off key is where it belongs).

    ``k_ref [T, KVH, D]``: the reference's raw keys by token index (position - ``shift``);
    ``handoff_len`` tokens were handed off, of which the layer carried the rows its ring held
    (``window``, ``sinks``; all of them for a full layer), ``block_size`` rows to a block. ``rope``:
    the layer's spec (None: no position embedding). Both key forms are tried: stored rotated keys are
    compared as rotated; stored raw ones (or keys converted at the import, after the misread) as raw,
    the kernel's keys unrotated at the row they were read into first."""
    kvh = k_eff.shape[1]
    if handoff_len < 1 or kvh < 2 or block_size < 2 or handoff_len > k_ref.shape[0]:
        return None  # one KV head, or blocks of one row: both layouts are the same bytes
    sent_rows = window_rows(handoff_len, window, sinks) if window is not None else torch.arange(handoff_len)
    sent_rows = sent_rows[:MAX_ROWS]  # token indices of the rows the layer carried, in order
    row_of = {int(t): r for r, t in enumerate(sent_rows)}
    index = (key_positions - shift).tolist()
    seen = [(i, row_of[t]) for i, t in enumerate(index) if t in row_of]  # (view key, received row)
    if not seen:
        return None
    sent_pos = sent_rows + shift
    raw = k_ref[sent_rows].to(torch.float64)  # [R, KVH, D]
    views = [i for i, _ in seen]
    eff = k_eff[views].to(torch.float64)  # [M, KVH, D] as the kernel used them
    tries = [(raw, eff)]  # no position embedding, or a probe that records the keys as stored raw
    if rope is not None:
        tries.append((rope.rotate(raw, sent_pos), eff))
        tries.append((raw, rope.unrotate(eff, key_positions[views])))
    rel = max(
        (distances(sent, received.reshape(-1, received.shape[-1])) for sent, received in tries),
        key=lambda m: int((m.min(dim=1).values <= MATCH_TOL).sum()),
    )  # [cells, R * KVH], cells in the order of ``cells`` below
    rows = len(sent_rows)
    cells = [(r, h) for _, r in seen for h in range(kvh)]
    matched = rel.min(dim=1).values <= MATCH_TOL
    own = rel[torch.arange(len(cells)), torch.tensor([r * kvh + h for r, h in cells])] <= MATCH_TOL
    moved = [i for i in range(len(cells)) if bool(matched[i]) and not bool(own[i])]
    if not moved:
        return None
    for sent_layout, read_layout in ((HEADS_OUTER, TOKENS_OUTER), (TOKENS_OUTER, HEADS_OUTER)):
        agree, padding = 0, 0
        source = []
        for i, (r, h) in enumerate(cells):
            src = misread_source(r, h, sent_layout, read_layout, kvh, block_size)
            source.append(src)
            if src[0] >= rows:  # the sender's padding of a short last block: zeros, no sent key
                padding += 1
                agree += not bool(matched[i])
            else:
                agree += bool(rel[i, src[0] * kvh + src[1]] <= MATCH_TOL)
        if agree < MOST * len(cells):
            continue
        shown = [
            i for i in moved if source[i][0] < rows and bool(rel[i, source[i][0] * kvh + source[i][1]] <= MATCH_TOL)
        ][:3]
        examples = "; ".join(
            f"received (row {cells[i][0]}, head {cells[i][1]}) holds sent (row {source[i][0]}, head {source[i][1]})"
            for i in shown
        )
        how = "transposed within each block" if block_size == kvh else "each block's bytes read in the other order"
        ring = f", rows of the {rows} the ring carried" if window is not None else ""
        evidence = (
            f"received keys are the sender's keys {how}: {examples}; {len(moved)} of {len(cells)} handed-off "
            f"(row, head) cells hold another sent cell, {agree} of {len(cells)} as the layouts predict "
            f"(block size {block_size}, {kvh} KV heads{ring}"
            + (f", {padding} cells read the padding of a short last block" if padding else "")
            + f"); layout sent {sent_layout}, read as {read_layout}"
        )
        return Diagnosis(
            BugClass.BLOCK_LAYOUT_MISMATCH,
            evidence,
            {
                "sent_layout": sent_layout,
                "read_layout": read_layout,
                "block_size": block_size,
                "num_kv_heads": kvh,
                "handed_off_cells": len(cells),
                "moved_cells": len(moved),
                "predicted_cells": agree,
                "examples": [[*cells[i], *source[i]] for i in shown],
            },
        )
    return None
