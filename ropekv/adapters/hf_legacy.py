"""Probes for transformers releases before 4.53, whose attention has no interface to register a probe in.

Before 4.53 (``AttentionInterface`` without ``AttentionMaskInterface``; before 4.48 no interface at all)
each model file computes attention inline, but every RoPE model file still does, per layer::

    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, ...)
    key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, ...)
    causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]

so three public seams show what the kernel multiplies, without changing an operation:

- the model file's module-level ``apply_rotary_pos_emb`` (looked up as a global at each call): its
  output is the rotated query (and, without a cache, the rotated keys);
- ``Cache.update`` of every cache class: what it returns is every key the kernel reads;
- a forward pre-hook on the attention module: the ``attention_mask`` it is called with (gemma2/3 slice
  a sliding layer's mask in the decoder layer, before this call, so it is the mask the kernel applies).

Key positions: index ``i`` of ``N`` returned keys holds position ``i`` while the newest position ``t``
is below ``N`` (a dynamic cache, a static cache's slots), else ``t - N + 1 + i`` (a static sliding
cache once full: transformers' ``SlidingWindowCache`` and ``HybridCache`` keep the last ``N`` keys in
position order). Those labels are what the cache promises; a release whose cache breaks that promise
shows up as keys that do not sit where their label says.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UsageError


@dataclass
class LegacyLayerSeen:
    """What one attention call of one layer handed its kernel."""

    q: torch.Tensor | None = None  # [B, H, q, D] after RoPE
    k_rope: torch.Tensor | None = None  # [B, KVH, q, D] this call's keys after RoPE
    k_cache: torch.Tensor | None = None  # [B, KVH, N, D] what the cache's update returned
    mask: Any = None  # the attention_mask the attention module was called with


@dataclass
class LegacyProbes:
    """Installed seams for one adapter session; ``on_attention(layer, module, seen)`` is called after each
    attention module's forward with what it saw."""

    on_attention: Callable[[int, torch.nn.Module, LegacyLayerSeen], None]
    current: dict[str, Any] = field(default_factory=dict)  # {"layer": int, "seen": LegacyLayerSeen}


def install_legacy(
    model: torch.nn.Module, attentions: list[Any], probes: LegacyProbes, undo: list[Callable[[], None]]
) -> None:
    """Install the three seams of the module doc on ``model``; every step pushes its undo on ``undo``."""
    import transformers.cache_utils as cache_utils

    modules = {sys.modules[type(attn).__module__] for attn in attentions}
    for module in modules:
        original = getattr(module, "apply_rotary_pos_emb", None)
        if original is None:
            raise UsageError(
                f"{module.__name__}: no module-level apply_rotary_pos_emb, so the transformers adapter cannot see "
                "this model's rotated queries on a release before 4.53"
            )
        module.apply_rotary_pos_emb = _rope_seam(original, probes)  # type: ignore[attr-defined]
        undo.append(_restorer(module, "apply_rotary_pos_emb", original))
    for cls in _cache_classes(cache_utils):
        original = cls.__dict__["update"]
        cls.update = _update_seam(original, probes)  # type: ignore[attr-defined]
        undo.append(_restorer(cls, "update", original))
    for i, attn in enumerate(attentions):
        undo.append(attn.register_forward_pre_hook(_pre_hook(i, probes), with_kwargs=True).remove)
        undo.append(attn.register_forward_hook(_post_hook(i, probes)).remove)


def _restorer(owner: Any, name: str, original: Any) -> Callable[[], None]:
    def restore() -> None:
        setattr(owner, name, original)

    return restore


def legacy_key_positions(num_keys: int, newest: int) -> torch.Tensor:
    """``[N]`` the positions a cache's ``N`` returned keys hold when ``newest`` is the newest position
    (the module doc: slots in position order, the last ``N`` once the newest is past them)."""
    start = 0 if newest < num_keys else newest - num_keys + 1
    return torch.arange(start, start + num_keys)


def _cache_classes(cache_utils: Any) -> list[type]:
    """Every cache class of this release that defines its own ``update`` (the base ``Cache`` included)."""
    base = cache_utils.Cache
    out = []
    for obj in vars(cache_utils).values():
        if isinstance(obj, type) and issubclass(obj, base) and "update" in obj.__dict__:
            out.append(obj)
    return out


def _rope_seam(original: Callable[..., Any], probes: LegacyProbes) -> Callable[..., Any]:
    def apply_rotary_pos_emb(*args: Any, **kwargs: Any) -> Any:
        q, k = original(*args, **kwargs)
        seen = probes.current.get("seen")
        if seen is not None and seen.q is None:
            seen.q, seen.k_rope = q.detach(), k.detach()
        return q, k

    return apply_rotary_pos_emb


def _update_seam(original: Callable[..., Any], probes: LegacyProbes) -> Callable[..., Any]:
    def update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kw: Any):
        keys, values = original(self, key_states, value_states, layer_idx, *args, **kw)
        seen = probes.current.get("seen")
        if seen is not None and probes.current.get("layer") == layer_idx:
            seen.k_cache = keys.detach()
        return keys, values

    return update


def _pre_hook(layer: int, probes: LegacyProbes) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        probes.current["layer"] = getattr(module, "layer_idx", layer)
        probes.current["seen"] = LegacyLayerSeen(mask=mask)

    return hook


def _post_hook(layer: int, probes: LegacyProbes) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        seen = probes.current.pop("seen", None)
        probes.current.pop("layer", None)
        if seen is not None:
            probes.on_attention(layer, module, seen)

    return hook
