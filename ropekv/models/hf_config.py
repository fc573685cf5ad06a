"""Reading a transformers ``config.json`` the way the architecture's own implementation reads it.

Every field is read through the architecture's :class:`~ropekv.models.families.Family`: the bias
flags it consults, its epsilon and activation fields, whether it honours ``partial_rotary_factor``,
which layers rotate, how it derives sliding layers. A field the implementation ignores although the
config sets it (``attention_bias`` on Mistral, ``partial_rotary_factor`` on llama) is not
reinterpreted: it becomes a one-line entry in ``ModelConfig.warnings``. A config ropekv cannot model
exactly raises :class:`ConfigError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..rope import RopeSpec, _finite, _is_real
from .families import Family
from .mla import read_mla
from .moe import read_moe

if TYPE_CHECKING:
    from .config import ModelConfig

_NESTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def read_hf_config(cls: type[ModelConfig], config: Mapping[str, Any], *, source: str, layout: str) -> ModelConfig:
    from .config import MAX_LAYERS, _architecture

    if not isinstance(config, Mapping):
        raise ConfigError(f"{source}: must be a JSON object")
    arch = _architecture(config, source)
    if config.get("trust_remote_code") or config.get("auto_map"):
        raise ConfigError(
            f"{source}: needs custom code (auto_map / trust_remote_code); ropekv never runs checkpoint code"
        )
    from .families import FAMILIES

    fam = FAMILIES[arch]
    warnings: list[str] = []
    if fam.text_config:
        config, note = _text_config(config, source)
        warnings += note
    config = dict(config)
    for name in fam.ignored_fields:  # removed, so that nothing below reads them
        value = config.pop(name, None)
        if value is not None and value is not False:
            warnings.append(f"{name}={value!r} is ignored: transformers' {arch} implementation never reads it")
    config = _with_defaults(fam, _renamed(fam, config))
    if fam.ntk_alpha:
        config = _ntk_alpha(config, source, warnings)

    def need(name: str, kind: type = int) -> Any:
        if name not in config or config[name] is None:
            raise ConfigError(f"{source}: missing field {name!r}")
        value = config[name]
        if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{source}: field {name!r} must be an integer, got {value!r}")
        if kind is float and not (_is_real(value) and _finite(value)):
            raise ConfigError(f"{source}: field {name!r} must be a finite number, got {value!r}")
        return value

    def flag(name: str) -> bool:
        value = config.get(name)
        if value is None:
            return False
        if not isinstance(value, bool) and value not in (0, 1):
            raise ConfigError(f"{source}: field {name!r} must be true or false, got {value!r}")
        return bool(value)

    def rule(value: bool | str) -> bool:
        return value if isinstance(value, bool) else flag(value)

    def number(name: str, default: float | None) -> float | None:
        value = config.get(name, default)
        if value is None:
            return None
        if not (_is_real(value) and _finite(value)):
            raise ConfigError(f"{source}: field {name!r} must be a finite number, got {value!r}")
        return float(value)

    def optional_int(name: str, low: int) -> int | None:
        value = config.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise ConfigError(f"{source}: field {name!r} must be an integer >= {low}, got {value!r}")
        return value

    act = config.get(fam.act_key) or fam.act_default
    if act == "swish":
        act = "silu"
    from .config import ACTIVATIONS

    if act not in ACTIVATIONS:
        raise ConfigError(f"{source}: field {fam.act_key!r} = {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    num_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    num_layers = need("num_hidden_layers")
    if not 1 <= num_layers <= MAX_LAYERS:
        raise ConfigError(f"{source}: field 'num_hidden_layers' must be in [1, {MAX_LAYERS}], got {num_layers}")
    derived_dim = hidden // num_heads if num_heads else 0
    head_dim = (config.get(fam.head_dim_key) if fam.head_dim_key else None) or derived_dim
    num_kv_heads = config.get(fam.kv_heads_key) if fam.kv_heads_key else None
    if num_kv_heads is None:
        num_kv_heads = num_heads
    block: dict[str, Any] = {"parallel": rule(fam.parallel), "parallel_mlp_norm": fam.parallel_mlp_norm}
    if fam.heads_rule == "falcon":
        num_kv_heads, block = _falcon_layout(config, num_heads, source, flag)
    kv_rule = "multi_query / new_decoder_architecture" if fam.heads_rule == "falcon" else "one KV head per query head"
    for key, used, why in (
        ("head_dim", head_dim, "hidden_size // num_attention_heads"),
        ("num_key_value_heads", num_kv_heads, kv_rule),
    ):
        if config.get(key) not in (None, used):
            warnings.append(f"{key}={config[key]!r} is ignored: transformers' {arch} uses {used} ({why})")
    if fam.head_dim_key is None:  # what the RoPE reads below too
        config["head_dim"] = head_dim
    if fam.intermediate_multiple and config.get("intermediate_size") is None:
        config["intermediate_size"] = fam.intermediate_multiple * hidden
    if fam.rope_from == "rotary_dim":
        config["rope_parameters"] = _rotary_dim_rope(config, head_dim, source)
    sizes = {name: need(name) for name in ("vocab_size", fam.dense_size_key, "max_position_embeddings")}
    sizes["intermediate_size"] = sizes[fam.dense_size_key]
    if fam.eps_key is None:
        eps = fam.eps_default
    elif fam.eps_default is None:
        eps = float(need(fam.eps_key, float))
    else:
        eps = number(fam.eps_key, fam.eps_default)

    layer_types = _layer_types(fam, config, num_layers, source, optional_int, flag)
    sliding = None
    if "sliding_attention" in layer_types:
        sliding = optional_int("sliding_window", 1)
        if sliding is None:
            raise ConfigError(f"{source}: sliding_attention layers need a 'sliding_window'")
    elif config.get("sliding_window") and fam.windows not in ("none", "qwen2", "qwen2_moe"):
        warnings.append(
            f"sliding_window={config['sliding_window']!r} is ignored: no layer of this {arch} config "
            "is a sliding_attention layer"
        )

    chunk = None
    if "chunked_attention" in layer_types:
        if fam.windows != "llama4":
            raise ConfigError(
                f"{source}: layer type 'chunked_attention' on {arch}: transformers' {arch} has no "
                "chunked attention (only llama4 does)"
            )
        chunk = optional_int("attention_chunk_size", 1)
        if chunk is None:
            raise ConfigError(f"{source}: chunked_attention layers need an 'attention_chunk_size'")

    rope_layout = fam.layout if fam.layout != "neox" else layout
    mla = None
    if fam.attention == "mla":  # models/mla.py: the key per head is [k_nope, k_pe]; only k_pe rotates
        mla = read_mla(config, num_heads, source)
        head_dim, num_kv_heads = mla.qk_head_dim, num_heads
        if fam.name == "deepseek_v3":
            rope_layout = "gptj" if flag("rope_interleave") else "neox"
        config = {**config, "head_dim": mla.qk_rope_head_dim}  # what transformers sizes the frequencies by
    ropes = _layer_ropes(fam, config, layer_types, rope_layout, source)
    if mla is not None:
        ropes = [r.replace(head_dim=head_dim, rotary_offset=mla.qk_nope_head_dim) for r in ropes]
    partial = _partial_factor(config)
    if partial not in (None, 1, 1.0) and not fam.partial_rotary:
        warnings.append(f"partial_rotary_factor={partial!r} is ignored: transformers' {arch} rotates the whole head")
    main_rope = next((r for r in ropes if r is not None), None)
    if main_rope is None:  # every layer NoPE: keep a spec for the contract's shape fields
        main_rope = _rope(config, None, rope_layout, fam, source)

    query_scale = None
    if mla is not None:
        query_scale = _mla_scale(config, mla.qk_head_dim, source)
    elif fam.attn_scale_key:
        query_scale = number(fam.attn_scale_key, None)
    elif fam.query_pre_attn_scalar:
        scalar = number("query_pre_attn_scalar", None)
        query_scale = None if scalar is None else scalar**-0.5
    embedding_scale = 1.0
    if fam.embedding_scale == "sqrt_hidden":
        embedding_scale = math.sqrt(hidden)
    elif fam.embedding_scale == "embedding_multiplier":
        embedding_scale = number("embedding_multiplier", 1.0)
    logits_scale = 1.0
    if fam.logits_divide_key:
        divisor = number(fam.logits_divide_key, 1.0)
        if not divisor:
            raise ConfigError(f"{source}: field {fam.logits_divide_key!r} must not be 0")
        logits_scale = 1.0 / divisor
    if fam.logits_multiply_key:
        logits_scale = number(fam.logits_multiply_key, 1.0)
    qk_norm = fam.qk_norm != "none" and rule(fam.qk_norm_flag)
    if qk_norm and fam.qk_norm == "l2" and any(r is not None and r.attention_factor != 1.0 for r in ropes):
        # transformers normalizes after RoPE, which divides the attention factor of cos/sin out again;
        # before RoPE (what a raw-key cache stores) it would stay: refuse rather than check another reading.
        raise ConfigError(
            f"{source}: {arch} L2 q/k norm after RoPE with a RoPE attention factor != 1 "
            f"({next(r.attention_factor for r in ropes if r is not None and r.attention_factor != 1.0)}) "
            "is not modelled (the norm removes the factor again)"
        )
    temperature = {}
    if fam.attn_temperature and flag("attn_temperature_tuning") and any(r is None for r in ropes):
        floor = number("floor_scale", None)
        if floor is None or floor <= 0:
            raise ConfigError(f"{source}: attn_temperature_tuning needs a 'floor_scale' > 0, got {floor!r}")
        temperature = dict(temperature_floor_scale=floor, temperature_attn_scale=number("attn_scale", None) or 0.0)
    moe = read_moe(fam.moe, config, num_layers, source) if fam.moe else None
    if fam.name == "deepseek_v2" and flag("norm_topk_prob"):
        warnings.append("norm_topk_prob=True is ignored: transformers' deepseek_v2 router never renormalizes")
    if flag("use_bidirectional_attention"):  # gemma's embedding variants: not a causal decoder
        raise ConfigError(
            f"{source}: use_bidirectional_attention is true: every query sees later tokens too, so "
            "no cached decode can match the full forward; ropekv checks causal decoders only"
        )
    fields = dict(
        tie_word_embeddings=flag("tie_word_embeddings"),
        attention_bias=rule(fam.qkv_bias),
        o_bias=rule(fam.o_bias),
        mlp_bias=rule(fam.mlp_bias),
        attn_softcap=number(fam.attn_softcap_key, None) if fam.attn_softcap_key else None,
        final_softcap=number(fam.final_softcap_key, None) if fam.final_softcap_key else None,
        residual_scale=number(fam.residual_scale_key, 1.0) if fam.residual_scale_key else 1.0,
        **block,
        clip_qkv=number(fam.clip_qkv_key, None) if fam.clip_qkv_key else None,
        attention_sinks=fam.sinks,
    )
    try:
        return cls(
            architecture=arch,
            vocab_size=sizes["vocab_size"],
            hidden_size=hidden,
            intermediate_size=sizes["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            max_position_embeddings=sizes["max_position_embeddings"],
            rope=main_rope,
            qk_norm=qk_norm,
            sliding_window=sliding,
            layer_types=tuple(layer_types),
            name=str(config.get("_name_or_path") or config.get("name") or arch),
            hidden_act=act,
            layer_ropes=tuple(ropes),
            query_scale=query_scale,
            embedding_scale=embedding_scale,
            logits_scale=logits_scale,
            moe=moe,
            mla=mla,
            attention_chunk_size=chunk,
            warnings=tuple(warnings),
            **temperature,
            **fields,
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


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
    if not (_is_real(factor) and _finite(factor) and factor > 0) or not (_is_real(all_dim) and _finite(all_dim)):
        raise ConfigError(f"{source}: mscale_all_dim {all_dim!r} needs a finite RoPE 'factor' > 0, got {factor!r}")
    mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
    return scale * mscale * mscale


def _falcon_layout(config: Mapping[str, Any], num_heads: int, source: str, flag) -> tuple[int, dict[str, Any]]:
    """Falcon's KV heads as cached and its block, as ``FalconAttention`` / ``FalconDecoderLayer`` build
    them: ``(num_kv_heads, {parallel, parallel_mlp_norm, qkv_groups})``. Combinations transformers
    cannot run (its layer builds one set of norms and reads another) are refused, as is ALiBi."""
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


def _rotary_dim_rope(config: Mapping[str, Any], head_dim: int, source: str) -> dict[str, Any]:
    """GPT-J's RoPE: theta 10000, no scaling, the first ``rotary_dim`` channels (its config class
    requires an integer there)."""
    rotary = config.get("rotary_dim")
    if not isinstance(rotary, int) or isinstance(rotary, bool) or not 0 < rotary <= head_dim or rotary % 2:
        raise ConfigError(f"{source}: field 'rotary_dim' must be an even integer in [2, {head_dim}], got {rotary!r}")
    factor = rotary / head_dim
    if int(head_dim * factor) != rotary:
        raise ConfigError(f"{source}: rotary_dim {rotary} of head_dim {head_dim} is not representable as a factor")
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}


def _renamed(fam: Family, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the fields the architecture's config class renames on load under their new
    names (``Family.renamed``); a field given under its new name wins, as in the config class."""
    out = dict(config)
    for old, new in fam.renamed.items():
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
    for key, value in fam.defaults.items():
        if key == "rope_parameters" and "rope_type" in value:
            # A flat default scaling (gpt_oss's yarn): the config class sets it whenever the config names
            # no scaling, and a legacy rope_theta is its theta.
            if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
                theta = config.get("rope_theta", fam.defaults.get("rope_theta"))
                out[key] = {**value, **({} if theta is None else {"rope_theta": theta})}
        elif key == "rope_parameters":  # a whole RoPE default (gemma3's per-layer-type thetas)
            if not any(k in config for k in ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq")):
                out[key] = value
        elif key == "partial_rotary_factor":
            if _partial_factor(config) is None:
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
    if not (_is_real(alpha) and _finite(alpha) and alpha > 0):
        raise ConfigError(f"{source}: field {key}.alpha must be a finite number > 0, got {alpha!r}")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 2:
        raise ConfigError(
            f"{source}: hunyuan's NTK-alpha RoPE needs an integer 'head_dim' > 2 (transformers "
            f"reads config.head_dim), got {head_dim!r}"
        )
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if not (_is_real(theta) and _finite(theta) and theta > 0):
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


def _partial_factor(config: Mapping[str, Any]) -> Any:
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


def _layer_types(fam: Family, config: Mapping[str, Any], num_layers: int, source: str, optional_int, flag) -> list[str]:
    """Each layer's attention kind: ``layer_types`` where the architecture reads it, else derived from
    the other fields exactly as its transformers 5 config class derives it (``Family.windows``)."""
    given = config.get("layer_types")
    if given is not None and not isinstance(given, list):
        raise ConfigError(f"{source}: field 'layer_types' must be a list")
    if (
        fam.windows in ("qwen2", "qwen2_moe", "smollm3")
        and given is not None
        and "sliding_attention" in given
        and not flag("use_sliding_window")
    ):
        raise ConfigError(
            f"{source}: layer_types names sliding_attention layers but use_sliding_window is false: "
            f"transformers' {fam.name} then keeps no window and cannot run them; set one of the two"
        )
    if given is not None and fam.windows != "qwen3_moe":  # qwen3_moe's modeling never reads layer_types
        from .config import LAYER_TYPES

        if not isinstance(given, list):
            raise ConfigError(f"{source}: field 'layer_types' must be a list")
        if len(given) != num_layers:
            raise ConfigError(f"{source}: layer_types has {len(given)} entries for {num_layers} layers")
        bad = [t for t in given if not isinstance(t, str) or t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"{source}: unknown layer type(s) {bad[:5]}; supported: {', '.join(LAYER_TYPES)}")
        return list(given)
    if fam.windows == "llama4":  # Llama4TextConfig: chunked where the layer rotates, full on NoPE layers
        flags = _no_rope_flags(config, num_layers, source, empty_is_default=True)
        return ["chunked_attention" if f else "full_attention" for f in flags]
    window = optional_int("sliding_window", 1)
    rule = fam.windows
    if rule == "mistral":
        return ["sliding_attention" if window else "full_attention"] * num_layers
    if rule == "qwen3_moe":  # its config drops sliding_window unless use_sliding_window
        return ["sliding_attention" if window and flag("use_sliding_window") else "full_attention"] * num_layers
    if rule in ("qwen2", "qwen2_moe"):
        use = flag("use_sliding_window")
        mwl = optional_int("max_window_layers", 0)
        if mwl is None and use:
            raise ConfigError(
                f"{source}: field 'max_window_layers' is null: transformers cannot derive the sliding layers from it"
            )
        if rule == "qwen2":
            slides = [bool(use and window and i >= mwl) for i in range(num_layers)]
        else:
            slides = [bool(use and i < mwl and i % 2 == 0) for i in range(num_layers)]
        return ["sliding_attention" if s else "full_attention" for s in slides]
    if rule == "period":
        period = config.get(fam.window_period_key, fam.window_period) if fam.window_period_key else fam.window_period
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ConfigError(
                f"{source}: {fam.name} config without 'layer_types' and {fam.window_period_key} = "
                f"{period!r}: transformers derives the layers only from an integer period >= 1 (a "
                "string pattern fails there); give layer_types"
            )
        return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]
    if rule == "smollm3":  # sliding iff use_sliding_window, a window, and a NoPE layer
        nope = _no_rope_flags(config, num_layers, source)
        use = flag("use_sliding_window") and window is not None
        return ["sliding_attention" if use and not f else "full_attention" for f in nope]
    return ["full_attention"] * num_layers


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
            "vision_config is not checked: ropekv checks the text model at text positions, where the "
            "three mRoPE position streams are one (image and video tokens are outside the check)"
        )
    return out, notes


def _no_rope_flags(
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


def _rope(config: Mapping[str, Any], layer_type: str | None, layout: str, fam: Family, source: str) -> RopeSpec:
    try:
        return RopeSpec.from_hf_config(
            config, layer_type=layer_type, layout=layout, partial_rotary=fam.partial_rotary, mrope=fam.mrope
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _layer_ropes(
    fam: Family, config: Mapping[str, Any], layer_types: list[str], layout: str, source: str
) -> list[RopeSpec | None]:
    """Each layer's RoPE (None: NoPE), as the architecture's attention decides it."""
    params = config.get("rope_parameters")
    nested = (
        isinstance(params, Mapping) and params and all(isinstance(v, Mapping) or v is None for v in params.values())
    )
    per_type: dict[str, RopeSpec] = {}
    for t in sorted(set(layer_types)):
        per_type[t] = _rope(config, t if nested and t in params else None, layout, fam, source)
    if fam.name == "gemma3_text" and not nested and config.get("rope_local_base_freq") is not None:
        local = {**config, "rope_parameters": None, "rope_scaling": None, "rope_theta": config["rope_local_base_freq"]}
        per_type["sliding_attention"] = _rope(local, None, layout, fam, source)
    ropes: list[RopeSpec | None] = [per_type[t] for t in layer_types]
    if fam.rope_layers == "no_rope_layers":
        flags = _no_rope_flags(config, len(layer_types), source)
        ropes = [r if f else None for r, f in zip(ropes, flags)]
    elif fam.rope_layers == "sliding_only" or (
        fam.rope_layers == "sliding_only_if_window" and config.get("sliding_window") is not None
    ):
        ropes = [r if t == "sliding_attention" else None for r, t in zip(ropes, layer_types)]
    return ropes
