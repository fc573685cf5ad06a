"""Each layer's attention kind and RoPE, as the architecture's transformers config class and
attention derive them from a ``config.json`` dict (``Family.windows``, ``Family.rope_layers``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..rope import RopeSpec
from .config import LAYER_TYPES
from .families import Family
from .hf_fields import ConfigFields
from .rope_config import is_nested_by_layer_type, rope_from_hf_config


def layer_types_of(fam: Family, fields: ConfigFields, num_layers: int) -> list[str]:
    """Each layer's attention kind: ``layer_types`` where the architecture reads it, else derived from
    the other fields exactly as its transformers 5 config class derives it (``Family.windows``)."""
    config, source = fields.config, fields.source
    given = config.get("layer_types")
    if given is not None and not isinstance(given, list):
        raise ConfigError(f"{source}: field 'layer_types' must be a list")
    if (
        fam.reading.windows in ("qwen2", "qwen2_moe", "smollm3")
        and given is not None
        and "sliding_attention" in given
        and not fields.flag("use_sliding_window")
    ):
        raise ConfigError(
            f"{source}: layer_types names sliding_attention layers but use_sliding_window is false: "
            f"transformers' {fam.name} then keeps no window and cannot run them; set one of the two"
        )
    if given is not None and fam.reading.windows != "qwen3_moe":  # qwen3_moe's modeling never reads layer_types
        return _given_layer_types(given, num_layers, source)
    return _derived_layer_types(fam, fields, num_layers)


def _given_layer_types(given: list[Any], num_layers: int, source: str) -> list[str]:
    if len(given) != num_layers:
        raise ConfigError(f"{source}: layer_types has {len(given)} entries for {num_layers} layers")
    bad = [t for t in given if not isinstance(t, str) or t not in LAYER_TYPES]
    if bad:
        raise ConfigError(f"{source}: unknown layer type(s) {bad[:5]}; supported: {', '.join(LAYER_TYPES)}")
    return list(given)


def _derived_layer_types(fam: Family, fields: ConfigFields, num_layers: int) -> list[str]:
    """The layer kinds of a config without (or ignoring) ``layer_types``, by ``fam.reading.windows``."""
    config, source, flag = fields.config, fields.source, fields.flag
    rule = fam.reading.windows
    if rule == "llama4":  # Llama4TextConfig: chunked where the layer rotates, full on NoPE layers
        flags = no_rope_flags(config, num_layers, source, empty_is_default=True)
        return ["chunked_attention" if f else "full_attention" for f in flags]
    window = fields.optional_int("sliding_window", 1)
    if rule == "mistral":
        return ["sliding_attention" if window else "full_attention"] * num_layers
    if rule == "qwen3_moe":  # its config drops sliding_window unless use_sliding_window
        return ["sliding_attention" if window and flag("use_sliding_window") else "full_attention"] * num_layers
    if rule in ("qwen2", "qwen2_moe"):
        return _qwen2_layer_types(fields, num_layers, window, moe=rule == "qwen2_moe")
    if rule == "period":
        return _periodic_layer_types(fam, config, num_layers, source)
    if rule == "smollm3":  # sliding iff use_sliding_window, a window, and a NoPE layer
        nope = no_rope_flags(config, num_layers, source)
        use = flag("use_sliding_window") and window is not None
        return ["sliding_attention" if use and not f else "full_attention" for f in nope]
    return ["full_attention"] * num_layers


def _qwen2_layer_types(fields: ConfigFields, num_layers: int, window: int | None, *, moe: bool) -> list[str]:
    """qwen2: layers from ``max_window_layers`` on slide; qwen2_moe: the even layers below it."""
    use = fields.flag("use_sliding_window")
    mwl = fields.optional_int("max_window_layers", 0)
    if mwl is None and use:
        raise ConfigError(
            f"{fields.source}: field 'max_window_layers' is null: transformers cannot derive the sliding layers from it"
        )
    limit = 0 if mwl is None else mwl  # None only where use_sliding_window is off: then nothing slides
    if moe:
        slides = [bool(use and i < limit and i % 2 == 0) for i in range(num_layers)]
    else:
        slides = [bool(use and window and i >= limit) for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def _periodic_layer_types(fam: Family, config: Mapping[str, Any], num_layers: int, source: str) -> list[str]:
    """Layer ``i`` slides iff ``(i + 1) % period != 0`` (gemma2/3, gpt_oss, ...)."""
    period = (
        config.get(fam.reading.window_period_key, fam.reading.window_period)
        if fam.reading.window_period_key
        else fam.reading.window_period
    )
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ConfigError(
            f"{source}: {fam.name} config without 'layer_types' and {fam.reading.window_period_key} = "
            f"{period!r}: transformers derives the layers only from an integer period >= 1 (a "
            "string pattern fails there); give layer_types"
        )
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]


def no_rope_flags(
    config: Mapping[str, Any], num_layers: int, source: str, *, empty_is_default: bool = False
) -> list[int]:
    """``no_rope_layers`` (1: the layer rotates; smollm3, llama4), or the config class's default from
    ``no_rope_layer_interval`` (every 4th layer NoPE) where absent (llama4's config class: or empty)."""
    flags = config.get("no_rope_layers")
    if flags is None or (empty_is_default and flags == []):
        interval = config.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ConfigError(f"{source}: field 'no_rope_layer_interval' must be an integer >= 1, got {interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) != num_layers:
        raise ConfigError(f"{source}: field 'no_rope_layers' must list one 0/1 per layer")
    return flags


def rope_of(
    config: Mapping[str, Any],
    layer_type: str | None,
    layout: str,
    fam: Family,
    source: str,
    warnings: list[str] | None = None,
) -> RopeSpec:
    try:
        return rope_from_hf_config(
            config,
            layer_type=layer_type,
            layout=layout,
            partial_rotary=fam.reading.partial_rotary,
            mrope=fam.reading.mrope,
            warnings=warnings,
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def layer_ropes_of(
    fam: Family,
    config: Mapping[str, Any],
    layer_types: list[str],
    layout: str,
    source: str,
    warnings: list[str] | None = None,
) -> list[RopeSpec | None]:
    """Each layer's RoPE (None: NoPE), as the architecture's attention decides it; parameters it
    ignores go to ``warnings``."""
    params = config.get("rope_parameters")
    nested = is_nested_by_layer_type(params)
    per_type: dict[str, RopeSpec] = {}
    for t in sorted(set(layer_types)):
        per_type[t] = rope_of(config, t if nested and t in (params or {}) else None, layout, fam, source, warnings)
    local_theta = config.get(fam.reading.local_theta_key) if fam.reading.local_theta_key else None
    if not nested and local_theta is not None:  # gemma3's rope_local_base_freq: the sliding layers' theta
        local = {**config, "rope_parameters": None, "rope_scaling": None, "rope_theta": local_theta}
        per_type["sliding_attention"] = rope_of(local, None, layout, fam, source, warnings)
    ropes: list[RopeSpec | None] = [per_type[t] for t in layer_types]
    if fam.reading.rope_layers == "no_rope_layers":
        flags = no_rope_flags(config, len(layer_types), source)
        ropes = [r if f else None for r, f in zip(ropes, flags)]
    elif fam.reading.rope_layers == "sliding_only" or (
        fam.reading.rope_layers == "sliding_only_if_window" and config.get("sliding_window") is not None
    ):
        ropes = [r if t == "sliding_attention" else None for r, t in zip(ropes, layer_types)]
    return ropes
