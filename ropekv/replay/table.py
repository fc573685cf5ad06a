"""The replay table: one row per entry, the buggy release's verdict and named class beside the fixed one's."""

from __future__ import annotations

from .run import Outcome, Side

HEADER = ("entry", "engine", "buggy", "verdict", "named class", "first divergence", "fixed", "verdict", "replays")


def _named(side: Side) -> str:
    if side.error is not None:
        return "-"
    return side.kind or "-"


def _where(side: Side) -> str:
    if side.error is not None:
        return "(did not run)"
    return side.divergence or "-"


def rows(outcomes: list[Outcome]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for o in outcomes:
        out.append(
            (
                o.entry.name,
                o.entry.engine,
                o.buggy.version,
                o.buggy.verdict(),
                _named(o.buggy),
                _where(o.buggy),
                o.fixed.version,
                o.fixed.verdict(),
                "yes" if o.replayed else "NO",
            )
        )
    return out


def format_table(outcomes: list[Outcome]) -> str:
    """The table, then under it each entry's problems and each engine reading that differs from
    transformers' (the reference followed the engine; named, never hidden)."""
    body = rows(outcomes)
    widths = [max(len(r[i]) for r in [HEADER, *body]) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(HEADER, widths)).rstrip(), "-" * (sum(widths) + 2 * len(widths) - 2)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    notes = []
    for o in outcomes:
        notes += [f"{o.entry.name}: {p}" for p in o.problems]
        for label, side in (("buggy", o.buggy), ("fixed", o.fixed)):
            notes += [f"{o.entry.name}: {label} {side.version} reads the config otherwise: {r}" for r in side.reading]
    replayed = sum(o.replayed for o in outcomes)
    summary = f"{replayed} of {len(outcomes)} entries replay"
    engines = sorted({o.entry.engine for o in outcomes})
    summary += f" ({len(engines)} engine{'s' if len(engines) != 1 else ''}: {', '.join(engines)})"
    return "\n".join([*lines, "", *notes, *([""] if notes else []), summary])
