"""rollback_stale_keys: ring slots a rolled-back draft overwrote keep the rejected tokens' keys.

On a wrapped ring a draft overwrites the slots of the oldest keys in view; rolling it back must
restore them. A rollback that only moves positions back (mlx-lm ``RotatingKVCache.trim``; a spec
step's rollback after its verify) leaves those slots holding rejected keys, labelled as the older
tokens they replaced: rows that are no rotation of their own token's key, exactly at the overwritten
positions. The evidence names them (a single one is enough: a restore that missed one slot).
"""

from __future__ import annotations

import torch

from ..cache.policy import CacheOpPolicy
from ..faults.native import OpFault
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, Case, OpKind
from ..parity.explain.cells import Cells, rows_of, share, span_text
from ..parity.explain.evidence import CaseEvidence, Explanation, Match

KIND = BugClass.ROLLBACK_STALE_KEYS


def overwritten(case: Case, first: int, stop: int) -> list[int]:
    """Positions whose ring slots the tokens written at ``first..stop-1`` overwrote (none without a ring)."""
    window = case.live_window
    if window is None:
        return []
    ring = window + case.sink_tokens
    return [i - window for i in range(first, stop) if i >= ring]


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    case = f.case
    if km is None or case.op is None:
        return None
    n = case.prefix + case.length
    if case.op.kind == OpKind.ROLLBACK:
        stale = overwritten(case, n, n + case.op.amount)
        why = f"the ring slots the rolled-back {case.op.amount}-token draft overwrote, left holding the rejected tokens' keys"
    elif case.op.kind == OpKind.SPEC and f.role in ("decode", "redraft"):
        drafted, m = case.op.amount, case.spec_accepted
        stop = n + drafted if f.role == "decode" else n + drafted - 1
        stale = overwritten(case, n + m, stop)
        who = "the target's" if f.role == "decode" else "the drafter's"
        why = (
            f"{who} ring slots the rejected draft tokens overwrote (positions {n + m}..{stop - 1} of the verify pass "
            f"of the {drafted}-token draft, {m} accepted), left holding them"
        )
    else:
        return None
    if not stale or not bool(km.query_exact().all()):
        return None
    k = km.keys
    other = (~k.ok | ~k.own_content).any(1)
    at = torch.isin(k.positions, torch.tensor(stale))
    if not bool(other.any()) or bool((other & ~at).any()):
        return None
    bad = k.positions[other].tolist()
    named = int(at.sum())
    some = (
        ""
        if len(bad) == named
        else f" ({len(bad)} of the {named} such positions in view; the other {named - len(bad)} fit)"
    )
    text = (
        f"{len(bad)} key(s) at positions {span_text(bad)} are no rotation of those tokens' keys (fit "
        f"{float(k.fit[other].max()):.2f} at best): they are {why}{some}"
    )
    cells = Cells(other[:, None].expand_as(k.fit).clone(), torch.zeros(km.query.heads, dtype=torch.bool))
    return Match(KIND, share(km, cells), text, "subset", {"stale_positions": bad}, rows_of(cells.keys))


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class RollbackStaleRing(CacheOpPolicy):
    """Ring rollback moves positions back but leaves the rejected tokens' keys and values in the slots
    they overwrote (mlx-lm RotatingKVCache.trim, PRs #1427/#1486)."""

    name = "rollback-stale-ring"

    def ring_restore(self, journal, current, *, age):
        return current


class RollbackKeepsNewestSlot(CacheOpPolicy):
    """Ring rollback restores every slot the rejected draft overwrote except the newest one, whose
    rejected key and value stay in view (an off-by-one in the restore loop's range)."""

    name = "rollback-keeps-newest-slot"

    def ring_restore(self, journal, current, *, age):
        return current if age == 0 else journal


class SpecRejectedKeptRing(CacheOpPolicy):
    """A wrapped ring's rollback after the verify gives back positions but not contents: the rejected
    draft tokens' keys and values stay in the slots they overwrote."""

    name = "spec-rejected-kv-kept"

    def ring_restore(self, journal, current, *, age):
        return current


FAULTS = (
    OpFault(
        name="rollback-stale-ring",
        kind=KIND,
        description="ring rollback leaves the rejected draft's keys in its slots",
        key_form="rotated",
        shows_when="a rollback whose draft overwrote ring slots (a wrapped window)",
        op=CacheOp(OpKind.ROLLBACK, 3),
        cache_ops=RollbackStaleRing,
        needs_window=True,
    ),
    OpFault(
        name="rollback-keeps-newest-slot",
        kind=KIND,
        description="ring rollback restores every overwritten slot but the newest",
        key_form="rotated",
        shows_when="a rollback whose draft overwrote ring slots (a wrapped window)",
        op=CacheOp(OpKind.ROLLBACK, 3),
        cache_ops=RollbackKeepsNewestSlot,
        needs_window=True,
    ),
    OpFault(
        name="spec-rejected-kv-kept",
        kind=KIND,
        description="rollback after the verify leaves the rejected draft's keys in the ring",
        key_form="rotated",
        shows_when="a speculative step whose verify overwrote ring slots (a wrapped window)",
        op=CacheOp(OpKind.SPEC, 3),
        cache_ops=SpecRejectedKeptRing,
        needs_window=True,
    ),
)
