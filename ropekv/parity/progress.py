"""Progress on stderr for long work: a live bar (tqdm) on a terminal, one plain line per case in a
log (CI), or nothing."""

from __future__ import annotations

import sys

from tqdm import tqdm

MODES = ("bar", "lines", "off")


class Progress:
    """Counts work in tokens processed; the bar's rate and ETA say how long a sweep will take.

    ``mode``: ``"bar"`` (or True), ``"lines"`` (a line per finished case, nothing else), ``"off"``
    (or False)."""

    def __init__(self, total: int, mode: bool | str = True, unit: str = "tok"):
        if mode is True:
            mode = "bar"
        elif mode is False:
            mode = "off"
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._bar = tqdm(
            total=total,
            unit=unit,
            unit_scale=True,
            file=sys.stderr,
            disable=mode != "bar",
            dynamic_ncols=True,
            leave=False,
        )

    def describe(self, text: str) -> None:
        self._bar.set_description_str(text[:70], refresh=True)

    def advance(self, n: int) -> None:
        self._bar.update(n)

    def case_done(self, line: str) -> None:
        """One finished unit of work: a plain line in ``lines`` mode (CI logs show progress)."""
        if self.mode == "lines":
            print(line, file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()
