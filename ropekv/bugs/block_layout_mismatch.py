"""block_layout_mismatch: a receiver read the sender's block bytes in another order.

After a transfer the decode side's keys of the handed-off rows should be the sender's, each at its
own row and head. A receiver that reads ``[blocks, 2, heads, block, dim]`` bytes as
``[blocks, 2, block, heads, dim]`` (or the reverse) finds at each (row, head) another sent (row, head):
still some sent key, exactly. The fit finds each cell's source row and head; the evidence says how many
match what one layout read as the other predicts from the shapes alone.
"""

from __future__ import annotations

import torch

from ..cache.block_layout import HEADS_OUTER, TOKENS_OUTER, misread_rows, misread_source
from ..cache.import_policy import ImportPolicy
from ..cache.layout import window_rows
from ..contract import CacheContract
from ..faults.handoff import HandoffFault
from ..parity.bug_class import BugClass
from ..parity.explain.cells import Cells, share
from ..parity.explain.evidence import CaseEvidence, Explanation, Match

KIND = BugClass.BLOCK_LAYOUT_MISMATCH
MOST = 0.9


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    if km is None or f.handoff_len < 1:
        return None
    k = km.keys
    kvh, b = k.heads, f.block_size
    if kvh < 2 or b < 2:
        return None  # one KV head, or blocks of one row: both layouts are the same bytes
    sent = window_rows(f.handoff_len, f.window, f.sinks) if f.window is not None else torch.arange(f.handoff_len)
    row_of = {int(t): r for r, t in enumerate(sent.tolist())}
    rows = len(sent)
    handed = torch.tensor([int(p) - f.shift in row_of for p in k.positions.tolist()])
    if not bool(handed.any()):
        return None
    moved = handed[:, None] & ~k.own_content
    if not bool(moved.any()):
        return None
    for sent_layout, read_layout in ((HEADS_OUTER, TOKENS_OUTER), (TOKENS_OUTER, HEADS_OUTER)):
        agree = torch.zeros_like(moved)
        padding = 0
        for i in torch.nonzero(handed).flatten().tolist():
            r = row_of[int(k.positions[i]) - f.shift]
            for h in range(kvh):
                src_row, src_head = misread_source(r, h, sent_layout, read_layout, kvh, b)
                if src_row >= rows:  # the sender's padding of a short last block: zeros, no sent key
                    padding += 1
                    agree[i, h] = not bool(k.ok[i, h])
                else:
                    agree[i, h] = int(k.source[i, h]) == int(sent[src_row]) and int(k.source_head[i, h]) == src_head
        n_cells = int(handed.sum()) * kvh
        if int(agree.sum()) < MOST * n_cells:
            continue
        how = "transposed within each block" if b == kvh else "each block's bytes read in the other order"
        shown = torch.nonzero(moved & agree)[:3].tolist()
        examples = "; ".join(
            f"received (row {row_of[int(k.positions[i]) - f.shift]}, head {h}) holds sent (row "
            f"{int(k.source[i, h])}, head {int(k.source_head[i, h])})"
            for i, h in shown
        )
        text = (
            f"received keys are the sender's keys {how}: {examples}; {int(moved.sum())} of {n_cells} handed-off "
            f"(row, head) cells hold another sent cell, {int(agree.sum())} of {n_cells} as the layouts predict "
            f"(block size {b}, {kvh} KV heads"
            + (f", {padding} cells read the padding of a short last block" if padding else "")
            + f"); layout sent {sent_layout}, read as {read_layout}"
        )
        cells = Cells(agree & handed[:, None], torch.zeros(km.query.heads, dtype=torch.bool))
        details = {"sent_layout": sent_layout, "read_layout": read_layout, "moved_cells": int(moved.sum())}
        return Match(KIND, share(km, cells), text, "all", details)
    return None


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class ReceiverReadsHeadsAsBlock(ImportPolicy):
    """Fault: the keys and values were sent heads-outer within each block and are read tokens-outer."""

    name = "receiver-reads-heads-as-block"

    def received_rows(self, sender: CacheContract, rows: torch.Tensor) -> torch.Tensor:
        return misread_rows(rows, HEADS_OUTER, TOKENS_OUTER, sender.block_size)


FAULTS = (
    HandoffFault(
        name="receiver-reads-heads-as-block",
        kind=KIND,
        description=(
            "the sender writes blocks as [blocks, 2, heads, block, dim] without naming it, the receiver "
            "reads them as [blocks, 2, block, heads, dim]"
        ),
        policy=ReceiverReadsHeadsAsBlock,
    ),
)
