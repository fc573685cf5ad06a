"""A transformers ``config.json`` dict rewritten into the fields ropekv reads, as the architecture's
config class rewrites it on load: a multimodal config's text model, fields the architecture ignores
removed (with a warning), renamed fields under their new names, the class's defaults for omitted
fields, and RoPE readings that are other types in disguise (hunyuan's NTK alpha, GPT-J's rotary_dim)
as the plain RoPE they compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..numbers import is_finite_number, is_real
from .families import Family


def normalized_config(fam: Family, config: Mapping[str, Any], source: str, warnings: list[str]) -> dict[str, Any]:
    """``config`` as ``fam``'s config class holds it after loading; notes go to ``warnings``."""
    if fam.reading.text_config:
        config, note = _text_config(config, source)
        warnings += note
    config = dict(config)
    for name in fam.reading.ignored_fields:  # removed, so that nothing below reads them
        value = config.pop(name, None)
        if value is not None and value is not False:
            warnings.append(f"{name}={value!r} is ignored: transformers' {fam.name} implementation never reads it")
    config = _with_defaults(fam, _renamed(fam, config))
    if fam.reading.ntk_alpha:
        config = dict(_ntk_alpha(config, source, warnings))
    return config


def _text_config(config: Mapping[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """A multimodal config read as its text model: the ``text_config`` fields, under the top level's
    architecture and ``tie_word_embeddings``; a note that the vision tower is not checked."""
    text = config.get("text_config")
    if text is None:
        return dict(config), []  # already flat (an older config with the text fields at the top)
    if not isinstance(text, Mapping):
        raise ConfigError(f"{source}: field 'text_config' must be an object")
    out = {**text, "architectures": config.get("architectures"), "model_type": config.get("model_type")}
    if "tie_word_embeddings" in config:
        out["tie_word_embeddings"] = config["tie_word_embeddings"]
    notes = []
    if config.get("vision_config") is not None:
        notes.append(
            "vision_config is not checked: ropekv checks the text model, at text positions (the three "
            "mRoPE position streams are one) or image-like ones (--image-grid); vision features are outside the check"
        )
    return out, notes


def _renamed(fam: Family, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the fields the architecture's config class renames on load under their new
    names (``Family.renamed``); a field given under its new name wins, as in the config class."""
    out = dict(config)
    for old, new in fam.reading.renamed.items():
        if old in out:
            value = out.pop(old)
            if new == "partial_rotary_factor" or new == "rope_theta":
                params = out.get("rope_parameters")
                if isinstance(params, Mapping) and params and not any(isinstance(v, Mapping) for v in params.values()):
                    out["rope_parameters"] = {new: value, **params}  # setdefault into the flat RoPE dict
                    continue
            out.setdefault(new, value)
    return out


def _with_defaults(fam: Family, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the architecture's class defaults (``Family.defaults``) for the fields it omits.
    A field present as null keeps its null (gemma2's ``attn_logit_softcapping: null`` means no cap)."""
    out = dict(config)
    for key, value in fam.reading.defaults.items():
        if key == "rope_parameters" and isinstance(value, Mapping) and "rope_type" in value:
            # A flat default scaling (gpt_oss's yarn): the config class sets it whenever the config names
            # no scaling, and a legacy rope_theta is its theta.
            if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
                theta = config.get("rope_theta", fam.reading.defaults.get("rope_theta"))
                out[key] = {**value, **({} if theta is None else {"rope_theta": theta})}
        elif key == "rope_parameters":  # a whole RoPE default (gemma3's per-layer-type thetas)
            if not any(k in config for k in ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq")):
                out[key] = value
        elif key == "partial_rotary_factor":
            if partial_factor(config) is None:
                out[key] = value
        elif key not in config:  # rope_theta too: a flat rope_parameters' own theta still wins
            out[key] = value
    return out


def _ntk_alpha(config: Mapping[str, Any], source: str, warnings: list[str]) -> Mapping[str, Any]:
    """hunyuan's RoPE: ``rope_type`` "dynamic" with a truthy ``alpha`` is NTK scaling by a fixed alpha,
    ``base = rope_theta * alpha ** (head_dim / (head_dim - 2))`` over the whole head, independent of
    the sequence length; any other field of that RoPE dict (``factor``, ``mscale``, ...) is never read.
    Returned as the equivalent plain RoPE at that base, so every side computes the same frequencies;
    without an alpha the config is left to be read as dynamic NTK."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if isinstance(rope, Mapping) and rope:
            break
    else:
        return config
    if rope.get("rope_type", rope.get("type")) != "dynamic" or not rope.get("alpha"):
        return config
    alpha, head_dim = rope["alpha"], config.get("head_dim")
    if not (is_real(alpha) and is_finite_number(alpha) and alpha > 0):
        raise ConfigError(f"{source}: field {key}.alpha must be a finite number > 0, got {alpha!r}")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 2:
        raise ConfigError(
            f"{source}: hunyuan's NTK-alpha RoPE needs an integer 'head_dim' > 2 (transformers "
            f"reads config.head_dim), got {head_dim!r}"
        )
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if not (is_real(theta) and is_finite_number(theta) and theta > 0):
        raise ConfigError(f"{source}: field 'rope_theta' must be a finite number > 0, got {theta!r}")
    unread = sorted(k for k in rope if k not in ("rope_type", "type", "alpha", "rope_theta"))
    if unread:
        warnings.append(
            f"{', '.join(key + '.' + k for k in unread)} ignored: transformers' hunyuan_v1_dense reads "
            "a dynamic RoPE with alpha as a fixed NTK base, rope_theta * alpha ** (d / (d - 2)), nothing else"
        )
    base = float(theta) * float(alpha) ** (head_dim / (head_dim - 2))
    return {
        **config,
        "rope_parameters": {"rope_type": "default", "rope_theta": base},
        "rope_scaling": None,
        "rope_theta": base,
    }


def rotary_dim_rope(config: Mapping[str, Any], head_dim: int, source: str) -> dict[str, Any]:
    """GPT-J's RoPE: theta 10000, no scaling, the first ``rotary_dim`` channels (its config class
    requires an integer there)."""
    rotary = config.get("rotary_dim")
    if not isinstance(rotary, int) or isinstance(rotary, bool) or not 0 < rotary <= head_dim or rotary % 2:
        raise ConfigError(f"{source}: field 'rotary_dim' must be an even integer in [2, {head_dim}], got {rotary!r}")
    factor = rotary / head_dim
    if int(head_dim * factor) != rotary:
        raise ConfigError(f"{source}: rotary_dim {rotary} of head_dim {head_dim} is not representable as a factor")
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}


def partial_factor(config: Mapping[str, Any]) -> Any:
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        if "partial_rotary_factor" in params:
            return params["partial_rotary_factor"]
        for v in params.values():
            if isinstance(v, Mapping) and "partial_rotary_factor" in v:
                return v["partial_rotary_factor"]
    scaling = config.get("rope_scaling")
    if isinstance(scaling, Mapping) and "partial_rotary_factor" in scaling:
        return scaling["partial_rotary_factor"]
    return config.get("partial_rotary_factor")
