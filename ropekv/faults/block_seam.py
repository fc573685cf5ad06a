"""Faults at a block seam: a prefix hit that is not block-aligned mixes stored and recomputed KV in one block.

With a hit at ``P`` not a multiple of the block size ``B``, the block holding ``P`` (the seam block)
holds the stored prefix's rows below ``P`` and this request's recomputed rows from ``P`` on. The
engine shares that block with the earlier request that stored it and copies it on the first write.
:class:`SeamRowsFromStore` keeps the stored block's rows wherever the earlier request had written
one, as an engine that loads a whole stored block (or chunk) after recomputing the suffix does: the
first recomputed rows of the seam block then hold the earlier request's continuation, keys and
values both, at the right positions and with the wrong contents. An aligned hit has no seam (the
request's rows start in a block of their own) and hides it; so does a store that held nothing past
the hit.
"""

from __future__ import annotations

import torch

from ..cache.policy import CacheOpPolicy
from ..parity.cases import Case
from .native import NativeFault


class SeamRowsFromStore(CacheOpPolicy):
    """The stored block's rows win over the recomputed ones where the store held a token."""

    name = "seam-rows-from-store"

    def copied_block_rows(self, written: torch.Tensor, stored: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        return torch.where(held[:, None, None], stored, written)


# A non-aligned hit at each block size: P = 3B + B // 2 (the earlier request stored 3 tokens past P,
# which land in the seam block wherever B - B // 2 >= 3, else in the next one, never shared).
SEAM_CASES = tuple(Case(length=20, prefix=3 * b + b // 2, block_size=b, decode_steps=2) for b in (5, 7, 16))

CATALOGUE: tuple[NativeFault, ...] = (
    NativeFault(
        name="seam-rows-from-store",
        kind="block_seam",
        description="a non-aligned prefix hit keeps the stored block's rows over the recomputed ones",
        key_form="rotated",
        shows_when="a prefix hit that is not a multiple of the block size",
        cache_ops=SeamRowsFromStore,
        exposing=SEAM_CASES,
    ),
)
