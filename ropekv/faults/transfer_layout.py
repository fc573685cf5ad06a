"""Faults of the block layout across a transfer: the receiver reads the sender's block bytes in another order.

The sender lays each block out ``[blocks, 2, heads, block, dim]`` but does not say so (an older sender
whose contract has no ``block_layout``, which then reads as the default), and the receiver reads the
bytes as ``[blocks, 2, block, heads, dim]``: every received (row, head) holds another sent row's or
head's key and value. A contract that names both layouts is refused at the handshake instead
(``block_layout``). Import policies, like ``ropekv.faults.handoff``.
"""

from __future__ import annotations

import torch

from ..cache.block_layout import HEADS_OUTER, TOKENS_OUTER, misread_rows
from ..cache.import_policy import ImportPolicy
from ..contract import CacheContract
from .handoff import HandoffFault


class ReceiverReadsHeadsAsBlock(ImportPolicy):
    """Fault: the keys and values were sent heads-outer within each block and are read tokens-outer."""

    name = "receiver-reads-heads-as-block"

    def received_rows(self, sender: CacheContract, rows: torch.Tensor) -> torch.Tensor:
        return misread_rows(rows, HEADS_OUTER, TOKENS_OUTER, sender.block_size)


CATALOGUE: tuple[HandoffFault, ...] = (
    HandoffFault(
        name="receiver-reads-heads-as-block",
        kind="block_layout_mismatch",
        description=(
            "the sender writes blocks as [blocks, 2, heads, block, dim] without naming it, the receiver "
            "reads them as [blocks, 2, block, heads, dim]"
        ),
        policy=ReceiverReadsHeadsAsBlock,
    ),
)
