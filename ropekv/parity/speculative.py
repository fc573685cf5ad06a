"""What the bugs of a speculative step (``spec:K`` cases, :attr:`Case.spec_records`) look like at the
record that diverged first: a verify row, a target decode row after the rollback, or the drafter's
row after its own rollback. :func:`ropekv.parity.ops.hypotheses` hands them to the forensics.

- verify rows: the query (and the keys the verify writes) one position off (``+1`` / ``-1``);
- target decode rows: the accepted keys the verify wrote one position off; the ring slots the
  rejected draft overwrote still holding its keys; the offset still counting the rejected tokens;
- the drafter's row after its rollback: the same two rollback bugs, on the drafter's cache.
"""

from __future__ import annotations

from .bug_class import BugClass
from .cases import Case
from .forensics import OpHypothesis


def _overwritten(case: Case, first: int, stop: int) -> tuple[int, ...]:
    """Positions whose ring slots the tokens written at indices ``first..stop-1`` overwrote."""
    window = case.live_window
    if window is None:
        return ()
    ring = window + case.sink_tokens
    return tuple(i - window for i in range(first, stop) if i >= ring)


def spec_hypotheses(case: Case, step: int | None) -> tuple[OpHypothesis, ...]:
    """The hypotheses of record ``step`` of a ``spec`` case (every record's, when ``step`` is None)."""
    if case.op is None or case.op.kind != "spec":
        return ()
    k, m, n = case.op.amount, case.spec_accepted, case.prefix + case.length
    records = case.spec_records
    roles = {r for r, _ in records} if step is None or not 0 <= step < len(records) else {records[step][0]}
    what = f"the verify pass of the {k}-token draft (positions {n}..{n + k - 1}, {m} accepted)"
    out: list[OpHypothesis] = []
    if "verify" in roles:
        out += [
            OpHypothesis(
                BugClass.SPEC_VERIFY_POSITION_OFFSET,
                "query",
                f"{what} rotated its tokens at {n + c}..{n + k - 1 + c} (its query rows and the keys it wrote)",
                offsets=(c,),
            )
            for c in (1, -1)
        ]
    if "decode" in roles:
        out += [
            OpHypothesis(
                BugClass.SPEC_VERIFY_POSITION_OFFSET,
                "keys",
                f"the {m} accepted key(s) {what} wrote were rotated at {n + c}..{n + m - 1 + c}",
                offsets=(c,),
                positions=tuple(range(n, n + m)),
            )
            for c in (1, -1)
        ]
        stale = _overwritten(case, n + m, n + k)
        if stale:
            out.append(
                OpHypothesis(
                    BugClass.ROLLBACK_STALE_KEYS,
                    "misfit",
                    f"they are the ring slots the {k - m} rejected token(s) of {what} overwrote "
                    f"(positions {n + m}..{n + k - 1}), left holding the rejected keys after the target's rollback",
                    positions=stale,
                )
            )
        out.append(
            OpHypothesis(
                BugClass.ROLLBACK_OFFSET,
                "query",
                f"the target's offset kept the {k - m} rejected token(s) of {what}",
                offsets=(k - m,),
            )
        )
    if "redraft" in roles and k - 1 > m:
        stale = _overwritten(case, n + m, n + k - 1)
        if stale:
            out.append(
                OpHypothesis(
                    BugClass.ROLLBACK_STALE_KEYS,
                    "misfit",
                    f"they are the drafter's ring slots its {k - 1 - m} rejected draft step(s) overwrote "
                    f"(positions {n + m}..{n + k - 2}; {what}), left holding the rejected keys after the "
                    "drafter's rollback",
                    positions=stale,
                )
            )
        out.append(
            OpHypothesis(
                BugClass.ROLLBACK_OFFSET,
                "query",
                f"the drafter's offset kept its {k - 1 - m} rejected draft step(s) ({what})",
                offsets=(k - 1 - m,),
            )
        )
    return tuple(out)
