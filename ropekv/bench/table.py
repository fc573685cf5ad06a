"""The benchmarks' plain-text tables: columns as wide as their widest cell, two spaces apart."""

from __future__ import annotations


def grid(header: list[str], rows: list[list[str]], *, first_left: bool = True) -> list[str]:
    """The header, a rule of dashes and the rows, each cell right-aligned (the first one left-aligned
    unless ``first_left`` is False), trailing spaces stripped."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i == 0 and first_left else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
