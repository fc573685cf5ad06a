"""block_seam: a prefix hit that is not block-aligned mixes stored and recomputed rows in one block.

With a hit at ``P`` not a multiple of the block size ``B``, the block holding ``P`` holds the stored
prefix below ``P`` and this request's recomputed rows from ``P``. An engine that keeps the stored
block's rows over the recomputed ones (or loads a stored block after recomputing) leaves the seam
block's first recomputed rows holding other contents at the right positions (LMCache #2206). The
evidence names the seam block, the rows that hold other contents, and that every other key is right.
"""

from __future__ import annotations

import torch

from ..cache.policy import CacheOpPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.cells import Cells, rows_of, share, span_text
from ..parity.explain.evidence import CaseEvidence, Explanation, Match

KIND = BugClass.BLOCK_SEAM


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    p, b = f.prefix, f.block_size
    if km is None or p <= 0 or b <= 1 or p % b == 0 or not bool(km.query_exact().all()):
        return None
    k = km.keys
    other = (~k.ok | ~k.own_content).any(1)  # rows that hold no rotation of their own token's key
    if not bool(other.any()):
        return None
    wrong = sorted(int(x) - f.shift for x in k.positions[other].tolist())
    start = p // b * b
    end = start + b
    if wrong != list(range(p, p + len(wrong))) or wrong[-1] >= end:
        return None
    rest_exact = km.key_exact().all(1) | other
    if not bool(rest_exact.all()):
        return None
    fit = float(k.fit[other].max())
    text = (
        f"block {p // b} (positions {start}..{end - 1}) mixes the stored prefix ({span_text(list(range(start, p)))}) and "
        f"recomputed rows: key(s) {span_text(wrong)} are wrong (no rotation of their own tokens' keys at any position, "
        f"fit {fit:.2f} at best; every other key and the query sit at their positions): the seam block's first "
        "recomputed rows hold other contents (stored rows kept over them)"
    )
    cells = Cells(other[:, None].expand_as(k.fit).clone(), torch.zeros(km.query.heads, dtype=torch.bool))
    return Match(
        KIND, share(km, cells), text, "all", {"seam_block": p // b, "seam_wrong_keys": len(wrong)}, rows_of(cells.keys)
    )


def shows(case: Case) -> bool:
    return case.prefix > 0 and case.prefix % case.block_size != 0


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class SeamRowsFromStore(CacheOpPolicy):
    """The stored block's rows win over the recomputed ones where the store held a token."""

    name = "seam-rows-from-store"

    def copied_block_rows(self, written: torch.Tensor, stored: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        return torch.where(held[:, None, None], stored, written)


# A non-aligned hit at each block size: P = 3B + B // 2 (the earlier request stored 3 tokens past P,
# which land in the seam block wherever B - B // 2 >= 3, else in the next one, never shared).
SEAM_CASES = tuple(Case(length=20, prefix=3 * b + b // 2, block_size=b, decode_steps=2) for b in (5, 7, 16))


FAULTS = (
    NativeFault(
        name="seam-rows-from-store",
        kind=KIND,
        description="a non-aligned prefix hit keeps the stored block's rows over the recomputed ones",
        key_form="rotated",
        shows_when="a prefix hit that is not a multiple of the block size",
        cache_ops=SeamRowsFromStore,
        exposing=SEAM_CASES,
    ),
)
