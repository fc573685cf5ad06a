"""Reading a :class:`~ropekv.rope.RopeSpec` from a transformers ``config.json`` (as a dict).

Understands transformers 5's ``rope_parameters`` (flat, or nested by layer type such as
``"full_attention"`` / ``"sliding_attention"``) and the legacy ``rope_theta`` / ``rope_scaling`` /
``partial_rotary_factor`` fields. Defaults follow transformers' ``standardize_rope_params``:
``original_max_position_embeddings`` falls back to ``max_position_embeddings`` for llama3, yarn and
longrope. Architecture-specific readings (which layers rotate, renamed fields, class defaults) are
:mod:`ropekv.models.hf_config`'s; this module reads one RoPE dict.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..numbers import check_number, is_int
from ..rope import MAX_HEAD_DIM, MAX_POSITIONS, OPTIONAL_PARAMS, REQUIRED_PARAMS, SCALING_TYPES, RopeScaling, RopeSpec
from .limits import shown

# Keys of a config's rope dict that are not scaling parameters.
_NON_SCALING_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "attention_factor"}
# Qwen2VLRotaryEmbedding's mrope_section where the config gives none.
_DEFAULT_MROPE_SECTION = [16, 24, 24]


def rope_from_hf_config(
    config: Mapping[str, Any],
    layer_type: str | None = None,
    layout: str = "neox",
    *,
    partial_rotary: bool = True,
    mrope: bool = False,
    warnings: list[str] | None = None,
) -> RopeSpec:
    """The RoPE of a transformers ``config.json`` dict (of layer type ``layer_type`` where
    ``rope_parameters`` is nested by layer type).

    ``partial_rotary=False`` reads the config as architectures whose attention rotates the whole
    head do (llama, mistral, qwen2/3, gemma, ...): their default RoPE never reads
    ``partial_rotary_factor``, so the whole head rotates; their other RoPE types compute
    frequencies for the partial dimension and then fail to broadcast them over the head in
    transformers, a config no implementation runs, so it is refused.

    ``mrope=True`` reads ``mrope_section`` as Qwen2-VL does (default ``[16, 24, 24]`` when absent;
    a legacy ``rope_type: "mrope"`` is the default type); elsewhere the key is refused.

    Parameters the type never reads (a ``factor`` of the default type, an ``attention_factor`` outside
    yarn and longrope) are ignored, as transformers ignores them, whatever their value; each becomes
    an entry of ``warnings`` (transformers logs them as unrecognized keys).
    """
    if not isinstance(config, Mapping):
        raise ConfigError("model config must be a JSON object")
    head_dim = _head_dim(config)
    max_pos = _max_positions(config)
    rope = _rope_dict(config, layer_type)
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "partial_rotary_factor" not in rope and config.get("partial_rotary_factor") is not None:
        rope["partial_rotary_factor"] = config["partial_rotary_factor"]
    mrope_section = _take_mrope_section(rope) if mrope else None
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SCALING_TYPES:
        raise ConfigError(f"unknown RoPE type {rope_type!r} in config; supported: {', '.join(SCALING_TYPES)}")
    if rope_type in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", config.get("original_max_position_embeddings", max_pos))
    theta, partial = rope["rope_theta"], rope.get("partial_rotary_factor", 1.0)
    check_number("RoPE 'rope_theta'", theta, 1, strict=True)
    check_number("RoPE 'partial_rotary_factor'", partial, 0, strict=True)
    if partial > 1:
        raise ConfigError(f"RoPE 'partial_rotary_factor' must be in (0, 1], got {partial!r}")
    rotary_dim = _rotary_dim(head_dim, partial, rope_type, partial_rotary=partial_rotary)
    scaling = _scaling(rope, rope_type, max_pos, warnings)
    # Only yarn and longrope use a configured attention_factor; transformers ignores it elsewhere.
    given_factor = rope.get("attention_factor") if rope_type in ("yarn", "longrope") else None
    if rope_type not in ("yarn", "longrope") and rope.get("attention_factor") is not None:
        _ignored(warnings, "attention_factor", rope["attention_factor"], rope_type)
    return RopeSpec(
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        theta=float(theta),
        layout=layout,
        scaling=scaling,
        attention_factor=attention_factor_of(scaling, given_factor, max_pos),
        max_position_embeddings=max_pos,
        mrope_section=None if mrope_section is None else tuple(mrope_section),
    )


def _head_dim(config: Mapping[str, Any]) -> int:
    """``head_dim``, else ``hidden_size // num_attention_heads``."""
    try:
        hidden = config.get("hidden_size")
        heads = config.get("num_attention_heads")
        head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    except (TypeError, ZeroDivisionError) as exc:
        raise ConfigError(f"config has unusable hidden_size/num_attention_heads: {exc}") from None
    if not is_int(head_dim) or head_dim <= 0:
        raise ConfigError(
            f"config lacks a positive integer 'head_dim' (or 'hidden_size' and 'num_attention_heads'), got {head_dim!r}"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ConfigError(f"config 'head_dim' = {head_dim} is implausible (at most {MAX_HEAD_DIM})")
    return int(head_dim)


def _max_positions(config: Mapping[str, Any]) -> int:
    max_pos = config.get("max_position_embeddings")
    if not is_int(max_pos) or max_pos < 1:
        raise ConfigError(f"config lacks a positive integer 'max_position_embeddings', got {max_pos!r}")
    if max_pos > MAX_POSITIONS:
        raise ConfigError(f"config 'max_position_embeddings' = {max_pos} is implausible (at most 2**40)")
    return int(max_pos)


def is_nested_by_layer_type(params: Any) -> bool:
    """Whether ``rope_parameters`` is a dict of RoPE dicts by layer type (transformers 5, e.g.
    gemma3, qwen3-next), rather than one flat RoPE dict."""
    return (
        isinstance(params, Mapping)
        and bool(params)
        and all(isinstance(v, Mapping) or v is None for v in params.values())
    )


def _rope_dict(config: Mapping[str, Any], layer_type: str | None) -> dict[str, Any]:
    """A copy of the RoPE dict that applies: ``rope_parameters`` (its ``layer_type`` entry where
    nested by layer type), else the legacy ``rope_scaling`` (or nothing)."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError("config field 'rope_parameters' must be an object")
    if isinstance(params, Mapping) and is_nested_by_layer_type(params):
        if layer_type is None:
            distinct = {json.dumps(v, sort_keys=True) for v in params.values() if v is not None}
            if len(distinct) != 1:
                raise ConfigError(
                    f"config 'rope_parameters' differs per layer type ({', '.join(sorted(params))}); name the layer type"
                )
            layer_type = next(k for k, v in params.items() if v is not None)
        if layer_type not in params or params[layer_type] is None:
            raise ConfigError(f"config 'rope_parameters' has no entry for layer type {layer_type!r}")
        return dict(params[layer_type])
    if params:
        return dict(params)
    legacy = config.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, Mapping):
        raise ConfigError("config field 'rope_scaling' must be an object or null")
    return dict(legacy or {})


def _take_mrope_section(rope: dict[str, Any]) -> list[Any]:
    """Qwen2-VL's ``mrope_section``, popped from ``rope``; a legacy ``rope_type: "mrope"`` is
    rewritten in ``rope`` to the default type it names."""
    section = rope.pop("mrope_section", None) or list(_DEFAULT_MROPE_SECTION)
    if not isinstance(section, list):
        raise ConfigError(f"config 'mrope_section' must be a list of integers, got {section!r}")
    if rope.get("rope_type", rope.get("type")) == "mrope":  # legacy name of the default type
        rope["rope_type"] = "default"
        rope.pop("type", None)
    return section


def _rotary_dim(head_dim: int, partial: float, rope_type: str, *, partial_rotary: bool) -> int:
    """The rotated channels: ``head_dim * partial_rotary_factor`` (rounded down to even), or the
    whole head on an architecture that ignores the factor (refused where it would break there)."""
    if partial != 1 and not partial_rotary:
        if rope_type != "default":
            raise ConfigError(
                f"partial_rotary_factor {partial!r} with RoPE type {rope_type!r} on an architecture that rotates "
                "the whole head: transformers computes frequencies for part of the head and cannot apply them; "
                "ropekv refuses to check it under another reading"
            )
        partial = 1.0
    rotary_dim = int(head_dim * partial)
    return rotary_dim - rotary_dim % 2


def _ignored(warnings: list[str] | None, name: str, value: Any, rope_type: str) -> None:
    if warnings is not None:
        note = f"RoPE parameter {name}={shown(value)} is ignored: transformers' RoPE type {rope_type!r} never reads it"
        if note not in warnings:  # one note where every layer type's RoPE repeats it
            warnings.append(note)


def _scaling(rope: Mapping[str, Any], rope_type: str, max_pos: int, warnings: list[str] | None) -> RopeScaling:
    """The scaling parameters of ``rope`` that ``rope_type`` uses (unknown names refused, known names
    it does not use dropped with a warning, as transformers does), with yarn's / longrope's derived
    ``factor``."""
    scaling_kwargs = {k: v for k, v in rope.items() if k not in _NON_SCALING_KEYS}
    allowed = set(REQUIRED_PARAMS[rope_type]) | set(OPTIONAL_PARAMS[rope_type])
    known = {f.name for f in dataclasses.fields(RopeScaling)}
    unknown = set(scaling_kwargs) - known
    if unknown:
        raise ConfigError(f"unknown RoPE parameter(s) {', '.join(sorted(unknown))} for type {rope_type!r}")
    for k in sorted(set(scaling_kwargs) - allowed):
        if scaling_kwargs[k] is not None:
            _ignored(warnings, k, scaling_kwargs[k], rope_type)
    scaling_kwargs = {k: v for k, v in scaling_kwargs.items() if k in allowed and v is not None}
    if rope_type in ("yarn", "longrope") and scaling_kwargs.get("factor") is None:
        orig = scaling_kwargs.get("original_max_position_embeddings")
        if orig is not None and not (is_int(orig) and orig >= 1):
            raise ConfigError(f"RoPE original_max_position_embeddings must be an integer >= 1, got {orig!r}")
        if rope_type == "yarn" or orig:
            scaling_kwargs["factor"] = max_pos / orig if orig else None
    if rope_type == "longrope" and scaling_kwargs.get("factor") is None:
        scaling_kwargs.pop("factor", None)
    try:
        return RopeScaling.from_dict({"rope_type": rope_type, **scaling_kwargs})
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ConfigError(f"bad RoPE parameters for type {rope_type!r}: {exc}") from None


def attention_factor_of(scaling: RopeScaling, given: Any, max_pos: int) -> float:
    """The factor on cos and sin: ``given`` where the config sets one, else transformers' default for
    the type (yarn's ``get_mscale``, longrope's ``sqrt(1 + log(factor) / log(original))``, else 1)."""
    if given is not None:
        check_number("RoPE attention_factor", given, 0, strict=True)
        return float(given)
    if scaling.rope_type == "yarn":
        assert scaling.factor is not None  # yarn requires it (RopeScaling)
        if scaling.mscale and scaling.mscale_all_dim:
            return float(
                _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
            )
        return _yarn_mscale(scaling.factor)
    if scaling.rope_type == "longrope":
        orig = scaling.original_max_position_embeddings
        assert orig is not None  # longrope requires it (RopeScaling)
        factor = scaling.factor if scaling.factor is not None else max_pos / orig
        if factor <= 1.0:
            return 1.0
        if orig < 2:  # transformers divides by log(original_max_position_embeddings)
            raise ConfigError(
                f"longrope original_max_position_embeddings must be >= 2 to scale by {factor:g}, got {orig}"
            )
        return math.sqrt(1 + math.log(factor) / math.log(orig))
    return 1.0


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
