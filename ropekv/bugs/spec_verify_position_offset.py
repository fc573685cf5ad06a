"""spec_verify_position_offset: the verify pass of a speculative step rotated its draft off by ``c``.

The target verifies ``K`` draft tokens in one forward at positions ``n..n+K-1``. Off by ``c`` (SGLang
#25015: +1), its query rows and the keys it writes sit at ``j + c``; the accepted keys stay in the cache
that way, so the target's later decode steps read them off too. A verify that turns only its keys off
(its queries right) shows the same in its rows. The evidence gives ``c`` and which rows.
"""

from __future__ import annotations

import torch

from ..engine.rotation import RotationPolicy
from ..faults.native import OpFault
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, Case, OpKind
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import position_match

KIND = BugClass.SPEC_VERIFY_POSITION_OFFSET


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    case = f.case
    if km is None or case.op is None or case.op.kind != OpKind.SPEC or f.role not in ("verify", "decode"):
        return None
    k, m = case.op.amount, case.spec_accepted
    n = f.prompt_end
    j, t = km.keys.positions, f.query_position
    written = (j >= n) & (j < n + (k if f.role == "verify" else m))
    moved = km.keys.offsets()[..., 0][written]
    offsets = [int(x) for x in torch.unique(moved).tolist() if x != 0]
    q_off = int(km.query.offsets()[0, :, 0].mode().values) if f.role == "verify" else 0
    best = None
    for c in sorted(set(offsets + ([q_off] if q_off else []))):
        what = (
            f"the verify pass of the {k}-token draft (positions {n}..{n + k - 1}, {m} accepted) rotated its tokens at "
            f"{n + c}..{n + k - 1 + c}"
        )

        def text(which: str, query: bool, what: str = what, c: int = c) -> str:
            parts = [what]
            if query:
                parts.append(f"its query row sits at {t + c} (logical {t})")
            if which:
                parts.append(f"{which} (the keys it wrote) sit at j {c:+d}")
            return "; ".join(parts)

        found = position_match(
            ev,
            KIND,
            keys=torch.where(written, j + c, j),
            query=t + c if f.role == "verify" else None,
            informative=written,
            text=text,
            details={"offset": c},
        )
        if found is not None and (best is None or found.score > best.score):
            best = found
    return best


def shows(case: Case) -> bool:
    return case.op is not None and case.op.kind == OpKind.SPEC


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class SpecVerifyOffByOne(RotationPolicy):
    """The verify forward's positions start one past the last cached token's successor."""

    name = "spec-draft-positions-off-by-one"

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, positions + 1 if ctx.phase == "verify" else positions, ctx)

    def write_key(self, rope, k, positions, slots, ctx):
        return super().write_key(rope, k, positions + 1 if ctx.phase == "verify" else positions, slots, ctx)


FAULTS = (
    OpFault(
        name="spec-draft-positions-off-by-one",
        kind=KIND,
        description="the verify pass rotates its K draft tokens at t+1..t+K",
        key_form="rotated",
        shows_when="a speculative step (spec:K)",
        op=CacheOp(OpKind.SPEC, 3),
        rotation=SpecVerifyOffByOne,
    ),
)
