"""Whether this process has run adapter code a user handed to ropekv (``--engine path.py:Class`` or
``--engine module:Class``).

Such code runs in ropekv's own process and can change anything there, ropekv's RoPE functions and its
float64 reference included, so whatever ropekv computes afterwards is only as trustworthy as that code.
The reference cache reads this flag before writing an entry that later checks, in other processes,
would read (:mod:`ropekv.parity.reference_cache`). At the bottom of the package: it imports nothing.
"""

from __future__ import annotations

_loaded: list[str] = []  # the specs of the user code this process imported, in order


def mark_loaded(spec: str) -> None:
    """Record that the user code ``spec`` (as the user wrote it) is about to run in this process."""
    _loaded.append(spec)


def loaded() -> str | None:
    """The first user code this process imported (its spec), or None when it imported none."""
    return _loaded[0] if _loaded else None
