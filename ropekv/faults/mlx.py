"""Bugs injected into mlx-lm's decode path in the running process, to prove ropekv catches them.

Each is a context manager that patches the model's attention class (``type(layer.self_attn)``, e.g.
``mlx_lm.models.llama.Attention``) for one-token calls only and restores it on exit. The attention code
itself is untouched: the patch hands it a view of its cache that behaves like a buggy cache would.

- :func:`decode_keys_rotated_again`: a decode fast path that rotates the new key once more before
  writing it (by ``R(delta)``, or by ``R(offset)`` = double rotation when ``delta`` is None), so decoded
  keys sit at ``t + delta`` (or ``2t``) while prefill keys are right.
- :func:`offset_counts_kept_rows`: the offset the attention rotates with is the number of rows the cache
  keeps (``cache.size()``, ``min(offset, max_size)`` for a ``RotatingKVCache``) instead of the tokens
  seen: the eviction-offset bug (ropekv/bugs/evict_offset.py: evict-offset). Invisible until a rotating cache has wrapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..parity.bug_class import BugClass
from .record import Fault, FaultEngine


class _CacheView:
    """Delegates everything to ``cache``; subclasses change one thing."""

    def __init__(self, cache: Any):
        object.__setattr__(self, "_cache", cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cache, name, value)


class _RotateOnWrite(_CacheView):
    def __init__(self, cache: Any, rope: Any, delta: int | None):
        super().__init__(cache)
        object.__setattr__(self, "_rope", rope)
        object.__setattr__(self, "_delta", delta)

    @property
    def offset(self) -> int:
        return self._cache.offset

    def update_and_fetch(self, keys, values):
        delta = self._cache.offset if self._delta is None else self._delta
        return self._cache.update_and_fetch(self._rope(keys, offset=delta), values)


class _KeptRowsOffset(_CacheView):
    @property
    def offset(self) -> int:
        return self._cache.size()


@contextmanager
def _patched_decode(model: Any, view: Callable[[Any, Any], Any]) -> Iterator[None]:
    cls = type(model.layers[0].self_attn)
    original = cls.__call__

    def call(self, x, mask=None, cache=None):
        if cache is not None and x.shape[1] == 1:
            cache = view(self, cache)
        return original(self, x, mask, cache)

    cls.__call__ = call
    try:
        yield
    finally:
        cls.__call__ = original


def decode_keys_rotated_again(model: Any, delta: int | None = None) -> AbstractContextManager[None]:
    """Decoded keys rotated once more before they are cached: at ``t + delta``, or ``2t`` (None)."""
    return _patched_decode(model, lambda attn, cache: _RotateOnWrite(cache, attn.rope, delta))


def offset_counts_kept_rows(model: Any) -> AbstractContextManager[None]:
    """Decode queries and keys rotated at the cache's kept-row count instead of its logical offset."""
    return _patched_decode(model, lambda attn, cache: _KeptRowsOffset(cache))


@dataclass(frozen=True, kw_only=True)
class MlxFault(Fault):
    """A :class:`~ropekv.faults.record.Fault` patched into mlx-lm in this process; ``patch(model)`` is
    the context manager that patches it (the functions above, with their defaults)."""

    engine: FaultEngine = field(default="mlx", init=False)
    patch: Callable[[Any], AbstractContextManager[None]]


CATALOGUE: tuple[MlxFault, ...] = (
    MlxFault(
        name="decode-keys-rotated-again",
        kind=BugClass.KEY_POSITION_OFFSET,
        description="decoded keys rotated once more before they are cached (at 2t)",
        shows_when="any decode past position 0",
        patch=decode_keys_rotated_again,
    ),
    MlxFault(
        name="offset-counts-kept-rows",
        kind=BugClass.QUERY_POSITION_OFFSET,
        description="decode rotates at the cache's kept-row count instead of its logical offset",
        shows_when="a rotating cache that has wrapped",
        patch=offset_counts_kept_rows,
    ),
)


@contextmanager
def layer_rope_base(model: Any, layer: int, base: float) -> Iterator[None]:
    """Layer ``layer`` turns its queries and keys with RoPE base ``base`` (same dims and pairing),
    prefill and decode alike: e.g. a Gemma 3 sliding layer given the global layers' 1e6 instead of
    its 1e4, what a loader that reads one ``rope_theta`` for every layer builds. The module is put
    back on exit."""
    import mlx.nn as nn

    attn = model.layers[layer].self_attn
    original = attn.rope
    attn.rope = nn.RoPE(int(original.dims), traditional=bool(original.traditional), base=float(base))
    try:
        yield
    finally:
        attn.rope = original


@contextmanager
def window_ignored(model: Any) -> Iterator[None]:
    """Sliding layers attend to every key: ``make_cache`` gives every layer a plain ``KVCache`` and the
    model builds its sliding mask without a window (``window_size = None``), what a loader that never
    read ``sliding_window`` runs. Both are needed: with plain KVCaches alone mlx-lm's gemma3 mask still
    applies the window, in prefill and decode (docs/engines/mlx.md). Put back on exit."""
    from mlx_lm.models.cache import KVCache

    cls, inner = type(model), model.model
    original, window = cls.make_cache, inner.window_size
    cls.make_cache = lambda self: [KVCache() for _ in self.layers]
    inner.window_size = None
    try:
        yield
    finally:
        cls.make_cache = original
        inner.window_size = window
