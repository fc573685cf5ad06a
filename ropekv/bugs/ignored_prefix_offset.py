"""ignored_prefix_offset: after a prefix-cache hit of ``P`` tokens, the new tokens are rotated from 0.

The prompt's own keys (positions ``P`` on) sit at ``j - P``, and the query at ``t - P`` when the decode
step forgets the offset too; the cached prefix is right. It shows only with a prefix hit. The
evidence names the keys at ``j - P`` and says whether the query moved with them.
"""

from __future__ import annotations

from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import position_match

KIND = BugClass.IGNORED_PREFIX_OFFSET


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    if km is None or f.prefix <= 0:
        return None
    j, p = km.keys.positions, f.prefix

    def text(which: str, query: bool) -> str:
        out = f"{which} sit at j - {p}: the keys after the {p}-token cached prefix were rotated from 0" if which else ""
        if query:
            out += f"{'; ' if out else ''}the query sits at t - {p} = {f.query_position - p} too"
        return out

    return position_match(ev, KIND, keys=j - p, query=f.query_position - p, informative=j >= p + f.shift, text=text)


def shows(case: Case) -> bool:
    return case.prefix > 0


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class IgnoredPrefixOffset(RotationPolicy):
    """After a prefix-cache hit the new tokens are rotated from 0 instead of from P (key at j - P)."""

    name = "ignored-prefix-offset"

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, positions - ctx.fork_offset if ctx.cached else positions, ctx)

    def write_key(self, rope, k, positions, slots, ctx):
        shifted = positions - ctx.fork_offset if ctx.cached else positions
        return super().write_key(rope, k, shifted, slots, ctx)


FAULTS = (
    NativeFault(
        name="ignored-prefix-offset",
        kind=KIND,
        description="positions restart at 0 after a prefix-cache hit",
        key_form="rotated",
        shows_when="a nonzero prefix offset",
        rotation=IgnoredPrefixOffset,
    ),
)
