"""``bounded``: a block that must finish fast and small (a reader that believed a declared size, or
read a file it should have refused, would allocate or loop for it)."""

from __future__ import annotations

import signal
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager


class TooSlow(Exception):
    """The block was still running when its time was up (raised inside it, by SIGALRM)."""


@contextmanager
def bounded(seconds: float = 5.0, peak_bytes: int = 8 << 20) -> Iterator[None]:
    """Fail if the block takes longer than ``seconds`` (interrupting it) or its traced peak exceeds
    ``peak_bytes``."""

    def alarm(signum, frame):
        raise TooSlow(f"still running after {seconds} s: a declared size was believed")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert peak < peak_bytes, f"peak of {peak} traced bytes"
    assert time.perf_counter() - started < seconds
