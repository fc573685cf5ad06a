"""Key positions from mlx-lm's cache bookkeeping, checked against keys that carry their own position.

Every key written is filled with its logical position, so the value read back at a buffer row says
which token the cache really holds there; the adapter's positions (from offset / _idx / keep only)
must agree, through prefill chunks, one-token decodes, a wrapped ring with and without sinks, trim
and a save/load round trip.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

from ropekv.adapters.mlx.positions import BookkeepingError, fetched_positions


def _tokens(start: int, n: int):
    # [1, 1, n, 2] keys whose every channel is the token's position
    pos = mx.arange(start, start + n, dtype=mx.float32)
    return mx.broadcast_to(pos[None, None, :, None], (1, 1, n, 2))


def _feed(cache, start: int, n: int) -> None:
    k, _ = cache.update_and_fetch(_tokens(start, n), _tokens(start, n))
    got, _ = fetched_positions(cache, k.shape[2], n)
    held = [int(v) for v in k[0, 0, :, 0].tolist()]
    assert got == held, f"{type(cache).__name__} offset {cache.offset}: adapter says {got}, keys hold {held}"


@pytest.mark.parametrize("chunks", [[1] * 12, [12], [5, 7], [3, 1, 1, 4, 1, 2]])
def test_kv_cache(chunks):
    cache, start = C.KVCache(), 0
    for n in chunks:
        _feed(cache, start, n)
        start += n


@pytest.mark.parametrize("max_size,keep", [(7, 0), (7, 2), (8, 4), (13, 2)])
@pytest.mark.parametrize("plan", [[1] * 30, [20] + [1] * 12, [4, 1, 1, 9, 1, 1, 1, 6, 1, 1], [3] * 6 + [1] * 9])
def test_rotating_cache(max_size, keep, plan):
    cache, start = C.RotatingKVCache(max_size=max_size, keep=keep), 0
    for n in plan:
        _feed(cache, start, n)
        start += n


def test_rotating_cache_after_trim_and_reload(tmp_path):
    cache = C.RotatingKVCache(max_size=16, keep=2)
    _feed(cache, 0, 9)
    assert C.trim_prompt_cache([cache], 3) == 3
    _feed(cache, 6, 1)
    file = str(tmp_path / "c.safetensors")
    C.save_prompt_cache(file, [cache])
    (restored,) = C.load_prompt_cache(file)
    for p in range(7, 30):
        _feed(restored, p, 1)


def test_inconsistent_counters_are_refused():
    cache = C.KVCache()
    k, _ = cache.update_and_fetch(_tokens(0, 4), _tokens(0, 4))
    with pytest.raises(BookkeepingError):
        fetched_positions(cache, 3, 1)
    cache.offset = 9  # counters no longer describe the buffer
    with pytest.raises(BookkeepingError):
        fetched_positions(cache, 4, 1)
    with pytest.raises(BookkeepingError, match="not supported"):
        fetched_positions(C.QuantizedKVCache(), 0, 1)
