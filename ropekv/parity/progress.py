"""A live progress bar on stderr for long work (tqdm), silent when disabled."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """Counts work in tokens processed; the bar's rate and ETA say how long a sweep will take."""

    def __init__(self, total: int, enabled: bool = True, unit: str = "tok"):
        self._bar = tqdm(total=total, unit=unit, unit_scale=True, file=sys.stderr, disable=not enabled,
                         dynamic_ncols=True, leave=False)

    def describe(self, text: str) -> None:
        self._bar.set_description_str(text[:60], refresh=True)

    def advance(self, n: int) -> None:
        self._bar.update(n)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()
