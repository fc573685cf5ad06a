"""Probes at mlx-lm's attention boundary, installed for one forward and removed after it.

mlx-lm's attention (``mlx_lm/models/llama.py`` and its relatives) does, per layer::

    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)   # every key the kernel reads
    mx.fast.scaled_dot_product_attention(queries, keys, values, mask=mask, ...)

so three thin wrappers see what the kernel sees, without changing one operation:

- :class:`CacheProbe` stands in for a layer's cache object: it forwards ``offset`` (read and write)
  and every other attribute, and records what ``update_and_fetch`` returns together with the keys'
  logical positions, read from the real cache's counters right after the update
  (:mod:`.positions`). It also records the mask the model asked the cache for.
- :class:`RopeProbe` wraps a layer's ``rope`` module: its first call per forward is the query, the
  second the new keys (the order of the source above); it records the rotated query and its offset.
- :class:`NormProbe` wraps ``input_layernorm`` to record the layer input (the residual stream).
- :class:`AttnProbe` wraps ``self_attn`` to record the mask the layer's attention is called with: a
  decode step's boolean mask (sliding layers whose cache holds more than the window) selects the
  fetched keys the kernel reads.

Arrays are only kept as references during the forward; :meth:`ForwardProbe.layers` converts them to
torch after the caller evaluated the logits, so probing adds no evaluation inside the graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import AdapterError
from ...parity.recorder import AttentionRecorder
from ...probe import LayerProbe
from .positions import BookkeepingError, fetched_positions


@dataclass
class _LayerCalls:
    rope: list[tuple[Any, Any, int]] = field(default_factory=list)  # (input, output, offset) per rope call
    fetched: tuple[Any, Any, list[int], list[int]] | None = None  # keys, values, positions, slots
    hidden_in: Any = None
    mask: Any = None  # what the layer's cache made when the model asked it for a mask
    given_mask: Any = None  # the mask the layer's attention was called with (what its kernel applies)


class CacheProbe:
    """A layer's cache as the attention sees it; every attribute is the real cache's."""

    def __init__(self, cache: Any, calls: _LayerCalls, adapter: str, mask: Any = None):
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "_calls", calls)
        object.__setattr__(self, "_adapter", adapter)
        object.__setattr__(self, "_mask", mask)  # a full forward's explicit window mask, else None

    @property
    def offset(self) -> int:
        return self._cache.offset

    @offset.setter
    def offset(self, value: int) -> None:
        self._cache.offset = value

    def update_and_fetch(self, keys, values):
        # keys, values: [B, KVH, S, D] new tokens -> [B, KVH, N, D] every key the kernel reads
        out_k, out_v = self._cache.update_and_fetch(keys, values)
        try:
            positions, slots = fetched_positions(self._cache, out_k.shape[2], keys.shape[2])
        except BookkeepingError as exc:
            raise AdapterError(
                self._adapter, "key_positions", "the cache's counters to describe its keys", str(exc)
            ) from None
        self._calls.fetched = (out_k, out_v, positions, slots)
        return out_k, out_v

    def make_mask(self, *args, **kwargs):
        mask = self._mask if self._mask is not None else self._cache.make_mask(*args, **kwargs)
        self._calls.mask = mask
        return mask

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cache, name, value)


def _module_wrapper(nn: Any):
    """Builds the wrapper classes on the imported ``mlx.nn`` (kept out of module scope: no mlx import here)."""

    class RopeProbe(nn.Module):
        def __init__(self, inner, calls: _LayerCalls):
            super().__init__()
            self.inner = inner
            self._probe_calls = calls

        def __call__(self, x, offset=0, **kwargs):
            out = self.inner(x, offset=offset, **kwargs)
            self._probe_calls.rope.append((x, out, offset))
            return out

    class NormProbe(nn.Module):
        def __init__(self, inner, calls: _LayerCalls):
            super().__init__()
            self.inner = inner
            self._probe_calls = calls

        def __call__(self, x):
            self._probe_calls.hidden_in = x
            return self.inner(x)

    class AttnProbe(nn.Module):
        def __init__(self, inner, calls: _LayerCalls):
            super().__init__()
            self.inner = inner
            self._probe_calls = calls

        def __call__(self, x, mask=None, cache=None):
            self._probe_calls.given_mask = mask
            return self.inner(x, mask, cache)

    return RopeProbe, NormProbe, AttnProbe


class ForwardProbe:
    """Probes for one forward of ``model``; :meth:`layers` turns what they saw into LayerProbes."""

    def __init__(self, num_layers: int, adapter: str):
        self.adapter = adapter
        self.calls = [_LayerCalls() for _ in range(num_layers)]

    def caches(self, caches: list[Any], mask: Any = None) -> list[CacheProbe]:
        return [CacheProbe(c, self.calls[i], self.adapter, mask) for i, c in enumerate(caches)]

    def layers(self, rows: list[int] | None = None) -> tuple[LayerProbe, ...]:
        """One LayerProbe per layer: ``q [R, H, D]`` at ``rows`` of this forward's new tokens (all when
        None), ``k``/``v [N, KVH, D]`` as fetched, ``key_positions``/``key_slots [N]``, ``hidden_in [R, hidden]``.

        A decode step reads every key its cache returns, or those its layer's boolean mask keeps (the
        mask that layer's attention was called with); any other decode mask is refused (AdapterError)."""
        recorder = AttentionRecorder(len(self.calls))
        for i, c in enumerate(self.calls):
            if not c.rope or c.fetched is None or c.hidden_in is None:
                raise AdapterError(
                    self.adapter,
                    f"layers[{i}]",
                    "a query rope and a cache update",
                    f"{len(c.rope)} rope call(s), update {'seen' if c.fetched else 'missing'}",
                )
            q_in, q_out, _ = c.rope[0]
            keys, values, positions, slots = c.fetched
            q = _torch(q_out)[0].transpose(0, 1)  # [B, H, S, D] -> [S, H, D]
            q_raw = _torch(q_in)[0].transpose(0, 1)
            k = _torch(keys)[0].transpose(0, 1)  # [B, KVH, N, D] -> [N, KVH, D]
            v = _torch(values)[0].transpose(0, 1)
            hidden = _torch(c.hidden_in)[0]  # [S, hidden]
            pos = torch.tensor(positions, dtype=torch.int64)
            slot = torch.tensor(slots, dtype=torch.int64)
            if q.shape[0] == 1 and c.given_mask is not None and not isinstance(c.given_mask, str):
                # mlx-lm masks a decode on sliding layers whose cache holds more than the window (a
                # KVCache, a larger ring): the kernel reads the fetched rows the mask keeps.
                keep = _read_mask(c.given_mask, k.shape[0], self.adapter, i)
                k, v, pos, slot = k[keep], v[keep], pos[keep], slot[keep]
            sel = slice(None) if rows is None else torch.as_tensor(rows)
            recorder.record(
                i, q=q[sel], k=k, key_positions=pos, key_slots=slot, hidden_in=hidden[sel], q_raw=q_raw[sel], v=v
            )
        return recorder.take()


def _read_mask(mask: Any, num_keys: int, adapter: str, layer: int) -> torch.Tensor:
    """Indices of the fetched rows a one-query boolean mask keeps (``[..., N]``, every leading dim 1)."""
    import mlx.core as mx

    if mask.dtype != mx.bool_ or mask.size != num_keys:
        raise AdapterError(
            adapter,
            f"layers[{layer}]",
            f"a boolean decode mask over the {num_keys} fetched keys",
            f"a {mask.dtype} mask of shape {tuple(mask.shape)}",
        )
    return torch.from_numpy(np.array(mask, copy=True)).reshape(-1).nonzero()[:, 0]


def _torch(a) -> torch.Tensor:
    """An mlx array as a float32 torch tensor (bf16/f16 are widened exactly)."""
    import mlx.core as mx

    if a.dtype in (mx.bfloat16, mx.float16):
        a = a.astype(mx.float32)
    return torch.from_numpy(np.array(a, copy=True))


@contextmanager
def installed(model: Any, probe: ForwardProbe | None, nn) -> Iterator[None]:
    """Wrap each layer's ``self_attn.rope`` and ``input_layernorm`` for one forward; always restored."""
    if probe is None:
        yield
        return
    RopeProbe, NormProbe, AttnProbe = _module_wrapper(nn)
    layers = model.layers
    saved = [(layer.self_attn, layer.self_attn.rope, layer.input_layernorm) for layer in layers]
    try:
        for layer, calls in zip(layers, probe.calls):
            layer.self_attn.rope = RopeProbe(layer.self_attn.rope, calls)
            layer.input_layernorm = NormProbe(layer.input_layernorm, calls)
            layer.self_attn = AttnProbe(layer.self_attn, calls)
        yield
    finally:
        for layer, (attn, rope, norm) in zip(layers, saved):
            layer.self_attn = attn
            attn.rope = rope
            layer.input_layernorm = norm
