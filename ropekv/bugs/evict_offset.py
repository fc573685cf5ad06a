"""evict_offset: after an eviction the offset counts the kept rows; later positions lose the evicted tokens.

Evicting tokens (H2O, SnapKV) must keep the survivors' positions and continue from the true count of
tokens seen. An engine that resets its offset to the kept-row count turns every later query and key
that many positions early (VeloxQuant-MLX #138, #389); one that also compacts its cache labels the
survivors by kept row (0..n-1) and turns raw keys at those numbers. The evidence gives the offset, and
for a compacting cache the relabelled keys and their true positions.
"""

from __future__ import annotations

import torch

from ..cache.policy import CacheOpPolicy
from ..faults.native import OpFault
from ..faults.shapes import OffsetRotation
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, Case, OpKind
from ..parity.explain.cells import Cells, rows_of, share
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import offset_match

KIND = BugClass.EVICT_OFFSET


def _compacted(ev: CaseEvidence, gone: list[int]) -> Match | None:
    """Keys labelled by kept row (0..n-1) holding the surviving positions' keys in order."""
    km, f = ev.keymap, ev.facts
    if km is None:
        return None
    k = km.keys
    labels = k.positions
    end = f.prompt_end
    kept = labels < end - len(gone)  # the rows cached before the eviction, as a compacting cache numbers them
    if not torch.equal(labels[kept].sort().values, torch.arange(int(kept.sum()))):
        return None
    survivors = [p for p in range(end) if p not in gone]
    if len(survivors) != int(kept.sum()):
        return None
    true = labels.clone()  # each key's true position: the kept rows in order, the later ones as labelled
    order = labels[kept].argsort()
    true_kept = torch.empty_like(labels[kept])
    true_kept[order] = torch.tensor(survivors)
    true[kept] = true_kept
    moved = true != labels
    if not bool(moved.any()):
        return None
    holds = (k.source == (true - f.shift)[:, None]) & k.ok  # [N, K] the content is the true token's
    if int((holds | ~moved[:, None]).all(1).sum()) < 0.9 * labels.numel():
        return None
    renumbered = k.effective[..., 0] == labels[:, None]
    masked = int((~km.visible).sum()) + int(km.missed.numel())
    t_eff = f.query_position - len(gone)
    cells = Cells(holds & moved[:, None], (km.query.effective[0, :, 0] == t_eff) & km.query.ok[0], masked)
    n = int(kept.sum())
    text = (
        f"the cache labels its {n} keys kept by the eviction 0..{n - 1} (compacted: numbered by kept row, "
        f"{int(moved.sum())} of them not their positions; the evicted positions {gone} were renumbered away)"
        + (
            f"; every key sits at its kept-row number and the query at {f.query_position} - {len(gone)} = {t_eff}: "
            f"the offset counts kept rows, so positions lost the {len(gone)} evicted tokens"
            if bool((renumbered | ~holds).all())
            else ""
        )
    )
    return Match(KIND, share(km, cells), text, "all", {"compacted": True, "offset": -len(gone)}, rows_of(cells.keys))


def explain(ev: CaseEvidence) -> Match | None:
    f = ev.facts
    case = f.case
    if case.op is None or case.op.kind != OpKind.EVICT:
        return None
    gone = list(case.evicted_positions)
    e = len(gone)
    plain = offset_match(
        ev,
        KIND,
        -e,
        f.prompt_end,
        f"the offset counts kept rows ({e} evicted tokens subtracted from every later position)",
    )
    compact = _compacted(ev, gone)
    return max((m for m in (plain, compact) if m is not None), key=lambda m: m.score, default=None)


def shows(case: Case) -> bool:
    return case.op is not None and case.op.kind == OpKind.EVICT


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class EvictOffset(OffsetRotation):
    """After an eviction the offset is the number of kept rows (VeloxQuant-MLX #138, #389)."""

    name = "evict-offset"

    def offset(self, ctx):
        return -ctx.ops.evicted


class EvictCompacts(CacheOpPolicy):
    """Eviction compacts the cache and renumbers the survivors 0..n-1 by their kept-row index: raw keys
    are then turned at those numbers on read, and the cache labels its keys with them."""

    name = "evict-compacts-positions"

    def survivor_positions(self, positions):
        return positions.argsort().argsort()


class EvictCompactsPositions(EvictOffset):
    """The rotation side of a compacting eviction: new tokens continue from the kept-row count."""


FAULTS = (
    OpFault(
        name="evict-offset",
        kind=KIND,
        description="eviction resets the offset to the kept-row count",
        key_form="rotated",
        shows_when="any eviction",
        op=CacheOp(OpKind.EVICT, 5),
        rotation=EvictOffset,
    ),
    OpFault(
        name="evict-compacts-positions",
        kind=KIND,
        description="eviction renumbers the survivors 0..n-1 (compaction) and continues from the kept count",
        key_form="raw",
        shows_when="any eviction of raw keys",
        op=CacheOp(OpKind.EVICT, 4),
        rotation=EvictCompactsPositions,
        cache_ops=EvictCompacts,
        fixed_key_form=True,
    ),
)
