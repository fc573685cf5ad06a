"""Logical positions of the keys an mlx-lm cache returns, read from the cache's own bookkeeping.

Pure Python (no mlx import): a cache object is read through its public fields right after
``update_and_fetch`` returned ``num_fetched`` keys for ``num_new`` new tokens.

- ``KVCache`` / ``ConcatenateKVCache``: the fetched keys are the first ``offset`` buffer rows, and
  ``offset`` counts every token appended: key ``i`` is at position ``i``.
- ``RotatingKVCache(max_size, keep)``: ``offset`` is logical (tokens seen), ``_idx`` the physical
  write index. A multi-token update (``_update_concat``) returns the buffer in temporal order: the
  ``keep`` sink rows (positions ``0..keep-1``) then the newest ``N - keep`` positions ending at
  ``offset - 1``. A one-token update (``_update_in_place``) writes into a ring: rows below ``keep`` are
  sinks, and row ``s >= keep`` holds position ``offset - 1 - ((_idx - 1 - s) mod (N - keep))`` (the
  row just written, ``_idx - 1``, holds the newest token).

Slots are buffer rows. Positions are never taken from slots, except where the cache's own counters
say they coincide; every result is checked (unique, below ``offset``, the newest token present).
"""

from __future__ import annotations

from typing import Any

SUPPORTED = ("KVCache", "ConcatenateKVCache", "RotatingKVCache")


class BookkeepingError(ValueError):
    """The cache's counters do not describe the keys it returned (an inconsistent cache)."""


def fetched_positions(cache: Any, num_fetched: int, num_new: int) -> tuple[list[int], list[int]]:
    """``(positions, slots)`` of the ``num_fetched`` keys ``cache.update_and_fetch`` just returned."""
    kind = type(cache).__name__
    offset = int(cache.offset)
    if kind in ("KVCache", "ConcatenateKVCache"):
        if num_fetched != offset:
            raise BookkeepingError(f"{kind} returned {num_fetched} keys with offset {offset}")
        positions = list(range(offset))
    elif kind == "RotatingKVCache":
        positions = _rotating(offset, int(cache._idx), int(cache.keep), num_fetched, num_new)
    else:
        raise BookkeepingError(f"cache class {kind} is not supported (supported: {', '.join(SUPPORTED)})")
    _check(kind, positions, offset, num_new)
    return positions, list(range(num_fetched))


def _rotating(offset: int, idx: int, keep: int, n: int, num_new: int) -> list[int]:
    if n == offset:  # nothing dropped yet: row i is position i
        return list(range(n))
    if n > offset or n <= keep:
        raise BookkeepingError(f"RotatingKVCache returned {n} keys with offset {offset} and keep {keep}")
    sinks = list(range(keep))
    if num_new > 1:  # _update_concat: temporal order
        return sinks + list(range(offset - (n - keep), offset))
    ring = n - keep  # _update_in_place: a ring over rows keep..n-1
    if not keep < idx <= n:
        raise BookkeepingError(f"RotatingKVCache write index {idx} outside its ring [{keep + 1}, {n}]")
    return sinks + [offset - 1 - ((idx - 1 - s) % ring) for s in range(keep, n)]


def _check(kind: str, positions: list[int], offset: int, num_new: int) -> None:
    if len(set(positions)) != len(positions):
        raise BookkeepingError(f"{kind}: two rows claim one position")
    if positions and (min(positions) < 0 or max(positions) != offset - 1):
        raise BookkeepingError(f"{kind}: positions span {min(positions)}..{max(positions)}, offset is {offset}")
    newest = set(range(offset - num_new, offset))
    if not newest <= set(positions):
        raise BookkeepingError(f"{kind}: the {num_new} token(s) just appended are not among the keys returned")
