"""Reading a transformers ``config.json`` the way the architecture's own implementation reads it.

Every field is read through the architecture's :class:`~ropekv.models.families.Family`: the bias
flags it consults, its epsilon and activation fields, whether it honours ``partial_rotary_factor``,
which layers rotate, how it derives sliding layers. A field the implementation ignores although the
config sets it (``attention_bias`` on Mistral, ``partial_rotary_factor`` on llama) is not
reinterpreted: it becomes a one-line entry in ``ModelConfig.warnings``. A config ropekv cannot model
exactly raises :class:`ConfigError`.

The steps, in the order they read (and refuse) fields: the architecture (:func:`architecture_of`),
the config rewritten as its config class holds it (``hf_normalize``), the activation, the heads and
block layout, the sizes and epsilon, each layer's attention kind and RoPE (``hf_layers``), the scales
and norms, then the MoE; :class:`~ropekv.models.config.ModelConfig` validates the result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..numbers import is_finite_number, is_real
from ..rope import RopeSpec
from .config import ACTIVATIONS, ARCHITECTURES, ModelConfig
from .families import FAMILIES, REFUSED, Family, family_of, family_of_class
from .hf_fields import ConfigFields
from .hf_layers import layer_ropes_of, layer_types_of, rope_of
from .hf_normalize import normalized_config, partial_factor, rotary_dim_rope
from .limits import MAX_LAYERS, shown
from .mla import MlaSpec, read_mla
from .moe import read_moe
from .no_rope import NO_ROPE


def read_model_config(config: Mapping[str, Any], *, source: str = "config.json", layout: str = "neox") -> ModelConfig:
    """Validate a transformers ``config.json`` dict, read as the architecture's own implementation
    reads it (:mod:`ropekv.models.families`). Errors name ``source`` and the field; fields the
    implementation ignores become ``warnings`` instead of being reinterpreted. ``layout``: the RoPE
    pairing for architectures that do not fix one (a GGUF file's, for instance)."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"{source}: must be a JSON object")
    warnings: list[str] = []
    arch = architecture_of(config, source, warnings)
    if config.get("trust_remote_code") or config.get("auto_map"):
        raise ConfigError(
            f"{source}: needs custom code (auto_map / trust_remote_code); ropekv never runs checkpoint code"
        )
    fam = FAMILIES[arch]
    config = normalized_config(fam, config, source, warnings)
    fields = ConfigFields(config, source)
    act = _activation(fam, fields, warnings)
    num_heads = fields.need("num_attention_heads")
    hidden = fields.need("hidden_size")
    num_layers = fields.need("num_hidden_layers")
    if not 1 <= num_layers <= MAX_LAYERS:
        raise ConfigError(f"{source}: field 'num_hidden_layers' must be in [1, {MAX_LAYERS}], got {num_layers}")
    head_dim, num_kv_heads, block = _heads(fam, fields, num_heads, hidden, warnings)
    if fam.reading.head_dim_key is None:  # what the RoPE reads below too
        config["head_dim"] = head_dim
    if fam.reading.intermediate_multiple and config.get("intermediate_size") is None:
        config["intermediate_size"] = fam.reading.intermediate_multiple * hidden
    if fam.reading.rope_from == "rotary_dim":
        config["rope_parameters"] = rotary_dim_rope(config, head_dim, source)
    sizes = {name: fields.need(name) for name in ("vocab_size", fam.reading.dense_size_key, "max_position_embeddings")}
    eps = _eps(fam, fields)
    layer_types = layer_types_of(fam, fields, num_layers)
    sliding = _sliding_window(fam, fields, layer_types, warnings)
    chunk = _chunk_size(fam, fields, layer_types)

    rope_layout = fam.reading.layout if fam.reading.layout != "neox" else layout
    mla = None
    if fam.reading.attention == "mla":  # models/mla.py: the key per head is [k_nope, k_pe]; only k_pe rotates
        mla = read_mla(config, num_heads, source)
        head_dim, num_kv_heads = mla.qk_head_dim, num_heads
    if fam.reading.layout_key:
        rope_layout = "gptj" if fields.flag(fam.reading.layout_key) else "neox"
    if mla is not None:
        config = {**config, "head_dim": mla.qk_rope_head_dim}  # what transformers sizes the frequencies by
    ropes = _ropes(fam, config, layer_types, rope_layout, mla, warnings, source)
    main_rope = next((r for r in ropes if r is not None), None)
    if main_rope is None:  # every layer NoPE: keep a spec for the contract's shape fields
        main_rope = rope_of(config, None, rope_layout, fam, source)

    query_scale = _query_scale(fam, fields, config, mla)
    # Numbers as read: None where the config gives null, which ModelConfig refuses naming the field.
    scales: dict[str, Any] = {
        "rms_norm_eps": eps,
        "embedding_scale": _embedding_scale(fam, fields, hidden),
        "logits_scale": _logits_scale(fam, fields),
    }
    qk_norm = _qk_norm(fam, fields, ropes, arch)
    temperature = _temperature(fam, fields, ropes)
    moe = read_moe(fam.reading.moe, config, num_layers, source) if fam.reading.moe else None
    for name, why in fam.reading.ignored_true_flags.items():
        if fields.flag(name):
            warnings.append(f"{name}=True is ignored: transformers' {arch} {why}")
    if fields.flag("use_bidirectional_attention"):  # gemma's embedding variants: not a causal decoder
        raise ConfigError(
            f"{source}: use_bidirectional_attention is true: every query sees later tokens too, so "
            "no cached decode can match the full forward; ropekv checks causal decoders only"
        )
    flags = _flags_and_caps(fam, fields, block)
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=sizes["vocab_size"],
            hidden_size=hidden,
            intermediate_size=sizes[fam.reading.dense_size_key],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=sizes["max_position_embeddings"],
            rope=main_rope,
            qk_norm=qk_norm,
            sliding_window=sliding,
            layer_types=tuple(layer_types),
            name=str(config.get("_name_or_path") or config.get("name") or arch),
            hidden_act=act,
            layer_ropes=tuple(ropes),
            query_scale=query_scale,
            moe=moe,
            mla=mla,
            attention_chunk_size=chunk,
            warnings=tuple(warnings),
            **scales,
            **temperature,
            **flags,
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def architecture_of(config: Mapping[str, Any], source: str, warnings: list[str] | None = None) -> str:
    """The family of a config, by its ``model_type`` as transformers' auto classes choose the model
    (``architectures`` only records the class that saved it: a contradicting entry is a warning, the
    model is still the ``model_type``'s); refused where transformers would refuse it (no
    ``model_type``) or ropekv has no family for it, saying so where the architecture has no RoPE."""
    archs = config.get("architectures")
    if archs is not None and not isinstance(archs, list):
        raise ConfigError(f"{source}: field 'architectures' must be a list")
    archs = archs or []
    model_type = config.get("model_type")
    if model_type is None:
        named = f" (architectures {archs!r})" if archs else ""
        raise ConfigError(
            f"{source}: missing field 'model_type'{named}: transformers chooses the model by model_type "
            "and cannot load a config without it (nor can ropekv read it as transformers would)"
        )
    if not isinstance(model_type, str):
        raise ConfigError(f"{source}: field 'model_type' must be a string, got {shown(model_type)}")
    family = family_of(model_type)
    if family is None:
        named = f"{archs[0]!r} (model_type {model_type!r})" if archs and isinstance(archs[0], str) else repr(model_type)
        refused = REFUSED.get(model_type)
        if refused:
            raise ConfigError(
                f"{source}: unsupported architecture {named}: ropekv does not model its {refused} "
                "yet (see docs/architectures.md)"
            )
        positions = NO_ROPE.get(model_type)
        if positions:
            raise ConfigError(
                f"{source}: unsupported architecture {named}: it has no RoPE ({positions}); ropekv checks "
                "the RoPE of KV caches only"
            )
        raise ConfigError(f"{source}: unsupported architecture {named}; supported: {', '.join(ARCHITECTURES)}")
    others = sorted({str(a) for a in archs if family_of_class(a) not in (None, family)})
    if others and warnings is not None:
        warnings.append(
            f"architectures={others!r} is ignored: transformers builds the model from model_type "
            f"{model_type!r} ({', '.join(FAMILIES[family].classes)})"
        )
    return family


def _activation(fam: Family, fields: ConfigFields, warnings: list[str]) -> str:
    """The activation as the architecture's config class holds it: its default where the field is
    absent, a string naming an activation otherwise (transformers' configs refuse anything else,
    null included), rewritten where the class rewrites it (with a warning)."""
    key = fam.reading.act_key
    act = fields.config.get(key, fam.reading.act_default)
    if not isinstance(act, str):
        raise ConfigError(
            f"{fields.source}: field {key!r} must be a string naming an activation ({', '.join(ACTIVATIONS)}), "
            f"got {shown(act)}"
        )
    if act in fam.reading.act_renamed:
        renamed = fam.reading.act_renamed[act]
        warnings.append(f"{key}={act!r} is read as {renamed!r}: transformers' {fam.name} config rewrites it so")
        act = renamed
    if act == "swish":
        act = "silu"
    if act not in ACTIVATIONS:
        raise ConfigError(f"{fields.source}: field {key!r} = {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    return act


def _heads(
    fam: Family, fields: ConfigFields, num_heads: int, hidden: int, warnings: list[str]
) -> tuple[int, int, dict[str, Any]]:
    """``(head_dim, num_kv_heads, block fields)`` as the architecture's attention builds them; given
    values it does not use become warnings."""
    config = fields.config
    derived_dim = hidden // num_heads if num_heads else 0
    head_dim = (config.get(fam.reading.head_dim_key) if fam.reading.head_dim_key else None) or derived_dim
    num_kv_heads = config.get(fam.reading.kv_heads_key) if fam.reading.kv_heads_key else None
    if num_kv_heads is None:
        num_kv_heads = num_heads
    block: dict[str, Any] = {
        "parallel": fields.rule(fam.reading.parallel),
        "parallel_mlp_norm": fam.reading.parallel_mlp_norm,
    }
    if fam.reading.heads_rule == "falcon":
        num_kv_heads, block = _falcon_layout(fields, num_heads)
    kv_rule = (
        "multi_query / new_decoder_architecture" if fam.reading.heads_rule == "falcon" else "one KV head per query head"
    )
    for key, used, why in (
        ("head_dim", head_dim, "hidden_size // num_attention_heads"),
        ("num_key_value_heads", num_kv_heads, kv_rule),
    ):
        if config.get(key) not in (None, used):
            warnings.append(f"{key}={config[key]!r} is ignored: transformers' {fam.name} uses {used} ({why})")
    return head_dim, num_kv_heads, block


def _eps(fam: Family, fields: ConfigFields) -> float | None:
    if fam.reading.eps_key is None:
        return fam.reading.eps_default
    if fam.reading.eps_default is None:
        return float(fields.need(fam.reading.eps_key, float))
    return fields.number(fam.reading.eps_key, fam.reading.eps_default)


def _sliding_window(fam: Family, fields: ConfigFields, layer_types: list[str], warnings: list[str]) -> int | None:
    """The window of the sliding layers (None where no layer slides; a given one is then a warning)."""
    config = fields.config
    if "sliding_attention" in layer_types:
        sliding = fields.optional_int("sliding_window", 1)
        if sliding is None:
            raise ConfigError(f"{fields.source}: sliding_attention layers need a 'sliding_window'")
        return sliding
    if config.get("sliding_window") and fam.reading.windows not in ("none", "qwen2", "qwen2_moe"):
        warnings.append(
            f"sliding_window={config['sliding_window']!r} is ignored: no layer of this {fam.name} config "
            "is a sliding_attention layer"
        )
    return None


def _chunk_size(fam: Family, fields: ConfigFields, layer_types: list[str]) -> int | None:
    """The chunk of the chunked layers (llama4 only), None where no layer is chunked."""
    if "chunked_attention" not in layer_types:
        return None
    arch = fam.name
    if fam.reading.windows != "llama4":
        raise ConfigError(
            f"{fields.source}: layer type 'chunked_attention' on {arch}: transformers' {arch} has no "
            "chunked attention (only llama4 does)"
        )
    chunk = fields.optional_int("attention_chunk_size", 1)
    if chunk is None:
        raise ConfigError(f"{fields.source}: chunked_attention layers need an 'attention_chunk_size'")
    return chunk


def _ropes(
    fam: Family,
    config: Mapping[str, Any],
    layer_types: list[str],
    layout: str,
    mla: MlaSpec | None,
    warnings: list[str],
    source: str,
) -> list[RopeSpec | None]:
    """Each layer's RoPE (None: NoPE); an MLA key's RoPE turns its trailing rope part only."""
    ropes = layer_ropes_of(fam, config, layer_types, layout, source, warnings)
    if mla is not None:
        ropes = [
            None if r is None else r.replace(head_dim=mla.qk_head_dim, rotary_offset=mla.qk_nope_head_dim)
            for r in ropes
        ]
    partial = partial_factor(config)
    if partial not in (None, 1, 1.0) and not fam.reading.partial_rotary:
        warnings.append(
            f"partial_rotary_factor={partial!r} is ignored: transformers' {fam.name} rotates the whole head"
        )
    return ropes


def _query_scale(fam: Family, fields: ConfigFields, config: Mapping[str, Any], mla: MlaSpec | None) -> float | None:
    """The factor on ``q . k`` where not ``head_dim ** -0.5`` (None)."""
    if mla is not None:
        return _mla_scale(config, mla.qk_head_dim, fields.source)
    if fam.reading.attn_scale_key:
        return fields.number(fam.reading.attn_scale_key, None)
    if fam.reading.query_pre_attn_scalar:
        scalar = fields.number("query_pre_attn_scalar", None)
        return None if scalar is None else scalar**-0.5
    return None


def _embedding_scale(fam: Family, fields: ConfigFields, hidden: int) -> float | None:
    if fam.reading.embedding_scale == "sqrt_hidden":
        return math.sqrt(hidden)
    if fam.reading.embedding_scale == "embedding_multiplier":
        return fields.number("embedding_multiplier", 1.0)
    return 1.0


def _logits_scale(fam: Family, fields: ConfigFields) -> float | None:
    logits_scale: float | None = 1.0
    if fam.reading.logits_divide_key:
        divisor = fields.number(fam.reading.logits_divide_key, 1.0)
        if not divisor:
            raise ConfigError(f"{fields.source}: field {fam.reading.logits_divide_key!r} must not be 0")
        logits_scale = 1.0 / divisor
    if fam.reading.logits_multiply_key:
        logits_scale = fields.number(fam.reading.logits_multiply_key, 1.0)
    return logits_scale


def _qk_norm(fam: Family, fields: ConfigFields, ropes: list[RopeSpec | None], arch: str) -> bool:
    qk_norm = fam.block.qk_norm != "none" and fields.rule(fam.reading.qk_norm_flag)
    factors = [r.attention_factor for r in ropes if r is not None and r.attention_factor != 1.0]
    if qk_norm and fam.block.qk_norm == "l2" and factors:
        # transformers normalizes after RoPE, which divides the attention factor of cos/sin out again;
        # before RoPE (what a raw-key cache stores) it would stay: refuse rather than check another reading.
        raise ConfigError(
            f"{fields.source}: {arch} L2 q/k norm after RoPE with a RoPE attention factor != 1 "
            f"({factors[0]}) is not modelled (the norm removes the factor again)"
        )
    return qk_norm


def _temperature(fam: Family, fields: ConfigFields, ropes: list[RopeSpec | None]) -> dict[str, Any]:
    """llama4's attention temperature on NoPE layers, as ModelConfig fields (none where off)."""
    if not (fam.reading.attn_temperature and fields.flag("attn_temperature_tuning") and any(r is None for r in ropes)):
        return {}
    floor = fields.number("floor_scale", None)
    if floor is None or floor <= 0:
        raise ConfigError(f"{fields.source}: attn_temperature_tuning needs a 'floor_scale' > 0, got {floor!r}")
    return {"temperature_floor_scale": floor, "temperature_attn_scale": fields.number("attn_scale", None) or 0.0}


def _flags_and_caps(fam: Family, fields: ConfigFields, block: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields read straight from the family's flags and keys, in reading order."""
    number = fields.number
    return dict(
        tie_word_embeddings=fields.flag("tie_word_embeddings"),
        attention_bias=fields.rule(fam.reading.qkv_bias),
        o_bias=fields.rule(fam.reading.o_bias),
        mlp_bias=fields.rule(fam.reading.mlp_bias),
        attn_softcap=number(fam.reading.attn_softcap_key, None) if fam.reading.attn_softcap_key else None,
        final_softcap=number(fam.reading.final_softcap_key, None) if fam.reading.final_softcap_key else None,
        residual_scale=number(fam.reading.residual_scale_key, 1.0) if fam.reading.residual_scale_key else 1.0,
        **block,
        clip_qkv=number(fam.reading.clip_qkv_key, None) if fam.reading.clip_qkv_key else None,
        attention_sinks=fam.reading.sinks,
    )


def _mla_scale(config: Mapping[str, Any], qk_head_dim: int, source: str) -> float:
    """DeepSeek's softmax scale: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2``
    for any non-default RoPE type whose parameters set ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    scale = qk_head_dim**-0.5
    if not isinstance(params, Mapping):
        return scale
    all_dim = params.get("mscale_all_dim") or 0
    if params.get("rope_type", params.get("type", "default")) == "default" or not all_dim:
        return scale
    factor = params.get("factor")
    if not (is_real(factor) and is_finite_number(factor) and factor > 0) or not (
        is_real(all_dim) and is_finite_number(all_dim)
    ):
        raise ConfigError(f"{source}: mscale_all_dim {all_dim!r} needs a finite RoPE 'factor' > 0, got {factor!r}")
    mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
    return scale * mscale * mscale


def _falcon_layout(fields: ConfigFields, num_heads: int) -> tuple[int, dict[str, Any]]:
    """Falcon's KV heads as cached and its block, as ``FalconAttention`` / ``FalconDecoderLayer`` build
    them: ``(num_kv_heads, {parallel, parallel_mlp_norm, qkv_groups})``. Combinations transformers
    cannot run (its layer builds one set of norms and reads another) are refused, as is ALiBi."""
    config, source, flag = fields.config, fields.source, fields.flag
    if flag("alibi"):
        raise ConfigError(
            f"{source}: falcon with alibi=True uses ALiBi attention biases, not RoPE: ropekv has no "
            "RoPE to check there (refused: alibi)"
        )
    new, parallel = flag("new_decoder_architecture"), flag("parallel_attn")
    groups = config.get("num_kv_heads") or num_heads
    norms = config.get("num_ln_in_parallel_attn")
    if new:
        norms = 2 if norms is None else norms
        if not parallel or norms not in (1, 2):
            raise ConfigError(
                f"{source}: falcon new_decoder_architecture with parallel_attn={parallel} and "
                f"num_ln_in_parallel_attn={norms}: transformers' falcon cannot run that layer"
            )
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or num_heads % groups:
            raise ConfigError(f"{source}: field 'num_kv_heads' must divide num_attention_heads, got {groups!r}")
        return num_heads, {
            "parallel": True,
            "parallel_mlp_norm": norms == 2,
            "qkv_groups": None if groups == num_heads else groups,
        }
    if parallel and norms == 2:
        raise ConfigError(
            f"{source}: falcon parallel_attn with num_ln_in_parallel_attn=2 outside the new decoder "
            "architecture: transformers' falcon cannot run that layer"
        )
    if flag("multi_query"):
        return 1, {"parallel": parallel, "parallel_mlp_norm": False}
    if groups != num_heads:
        raise ConfigError(
            f"{source}: falcon without multi_query or the new decoder architecture has one KV head per "
            f"query head; num_kv_heads={groups!r} cannot be run by transformers"
        )
    return num_heads, {"parallel": parallel, "parallel_mlp_norm": False}
