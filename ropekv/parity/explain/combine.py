"""One diagnosis across every failing case.

Each failing case's evidence is read by every explanation (:mod:`.evidence`); a match counts for its
case when it accounts for at least :data:`~.evidence.PROMOTE` of the case's divergence. The class
named is the one that

1. accounts for the most failing cases,
2. is contradicted by the fewest passing cases (a match of scope ``all`` whose class, by its
   ``shows``, would have failed a case that passed),
3. scores highest in sum over its cases (to two decimals),
4. accounts for every token it could reach (scope ``all``) in the most cases: the simpler reading
   (every key of the last block at its offset in the block, rather than one key missing its rotation),
5. comes first in the registry (specific classes before the generic ones).

Its sentence is taken from the supporting case that diverged at the highest position (the most turned
phases: a query at position 1 or 2 has hardly rotated), ties to the first in the check's order; the
evidence then says which cases support it and which named another class. Where no class accounts for
any case, the diagnosis is ``unknown`` and its sentence describes the key map of that case
(:mod:`.pattern`): the mapping it shows, never a bare "no pattern".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..bug_class import BugClass
from ..cases import Case
from ..diagnosis import Diagnosis
from .cells import quote_keys
from .evidence import PROMOTE, CaseEvidence, Explanation, Match
from .pattern import describe

CLOSE = 0.05  # a case's own pick: the first explanation in the registry within this of its best score


@dataclass(frozen=True)
class CaseReading:
    """One failing case read by every explanation: its matches (score >= PROMOTE) in registry order."""

    evidence: CaseEvidence
    matches: tuple[tuple[int, Match], ...]  # (registry index, match)

    @property
    def label(self) -> str:
        return self.evidence.facts.case.label()

    def pick(self) -> Match | None:
        """The case's own reading: among the explanations within CLOSE of the best, one that accounts
        for every token it could reach (scope ``all``) before one that needs a subset, then the first
        in registry order."""
        if not self.matches:
            return None
        best = max(m.score for _, m in self.matches)
        close = [m for _, m in self.matches if m.score >= best - CLOSE]
        return next((m for m in close if m.scope == "all"), close[0])

    def of(self, kind: BugClass) -> Match | None:
        return next((m for _, m in self.matches if m.kind == kind), None)


def read_case(evidence: CaseEvidence, explanations: Sequence[Explanation]) -> CaseReading:
    found: list[tuple[int, Match]] = []
    for i, ex in enumerate(explanations):
        m = ex.explain(evidence)
        if m is not None and m.score >= PROMOTE:
            found.append((i, m))
    return CaseReading(evidence, tuple(found))


def diagnose_cases(
    evidences: Sequence[CaseEvidence],
    explanations: Sequence[Explanation],
    passing: Sequence[Case] = (),
) -> Diagnosis:
    """The diagnosis of a check whose failing cases gave ``evidences`` (module docstring).
    ``passing``: the cases that passed (weighed against classes with a ``shows``)."""
    readings = [read_case(e, explanations) for e in evidences]
    order = {ex.kind: i for i, ex in enumerate(explanations)}
    support: dict[BugClass, list[tuple[CaseReading, Match]]] = {}
    for r in readings:
        for _, m in r.matches:
            support.setdefault(m.kind, []).append((r, m))
    if not support:
        return _unexplained(readings)

    def against(kind: BugClass) -> list[Case]:
        shows = explanations[order[kind]].shows
        if shows is None or not all(m.scope == "all" for _, m in support[kind]):
            return []
        return [c for c in passing if shows(c)]

    def rank(kind: BugClass) -> tuple[int, int, float, int, int]:
        cases = support[kind]
        whole = sum(m.scope == "all" for _, m in cases)
        return (len(cases), -len(against(kind)), round(sum(m.score for _, m in cases), 2), whole, -order[kind])

    kind = max(support, key=rank)
    cases = support[kind]
    reading, match = max(cases, key=lambda rm: (rm[0].evidence.facts.query_position, -readings.index(rm[0])))
    facts = reading.evidence.facts
    notes = []
    if len(readings) > 1:
        notes.append(f"supported by {len(cases)} of {len(readings)} failing cases")
    others = [(r, r.pick()) for r in readings if all(r is not c for c, _ in cases)]
    for r, other in others[:4]:
        notes.append(
            f"{r.label} names {other.kind.value} instead" if other is not None else f"{r.label} is not explained"
        )
    contra = against(kind)
    if contra:
        shown = ", ".join(c.label() for c in contra[:3])
        notes.append(f"passing case(s) {shown} should have failed under it")
    km = reading.evidence.keymap
    quoted = "; ".join(quote_keys(km, match.shown)) if km is not None else ""
    text = match.text + (f"; {quoted}" if quoted else "") + (f" ({'; '.join(notes)})" if notes else "")
    details = {
        **match.details,
        "case": facts.case.label(),
        "layer": facts.layer,
        "query_position": facts.query_position,
        "score": round(match.score, 4),
        "scope": match.scope,
        "supporting_cases": [r.label for r, _ in cases],
        "other_cases": {r.label: (None if o is None else o.kind.value) for r, o in others},
        "contradicting_passing_cases": [c.label() for c in contra],
    }
    if km is not None:
        details.setdefault("query_effective", int(km.query.effective[0, :, 0].mode().values))
    return Diagnosis(kind, text, details, keymap=km)


def _unexplained(readings: list[CaseReading]) -> Diagnosis:
    """No class accounts for any case: the key map of the case diverging highest, described."""
    with_map = [r for r in readings if r.evidence.keymap is not None]
    if not with_map:
        fd = readings[0].evidence.facts.divergence if readings else None
        text = (
            "the final logits diverged but no layer's attention did"
            if fd is None or fd.layer is None
            else "no bug class accounts for the divergence, and the tier records no keys to fit"
        )
        return Diagnosis(BugClass.UNKNOWN, text, {})
    r = max(with_map, key=lambda x: (x.evidence.facts.query_position, -readings.index(x)))
    km = r.evidence.keymap
    assert km is not None
    facts = r.evidence.facts
    below = r.evidence.below
    if below is not None and facts.input_matched is False:
        exact = not bool(below.wrong_keys().any()) and not bool(below.wrong_query().any())
        at_below = (
            f"no RoPE error visible at layer {below.layer}: its query and every key sit where the contract puts "
            "them, so the divergence entered through its output (the softmax's weights: attention sinks, scaling, "
            "masking; or its values)"
            if exact and not bool(below.values_wrong().any())
            else describe(below, facts)
        )
        text = (
            f"no bug class accounts for it; layer {km.layer}'s input already differed from the reference's (the "
            f"divergence entered below it); {at_below}"
        )
    else:
        text = "no bug class accounts for it; " + describe(km, facts)
    details = {"case": facts.case.label(), "layer": facts.layer, "query_position": facts.query_position}
    return Diagnosis(BugClass.UNKNOWN, text, details, keymap=km)
