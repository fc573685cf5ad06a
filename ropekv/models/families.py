"""Decoder descriptions as data: one :class:`Family` per transformers architecture.

Every supported architecture is a pre-norm (or post-norm, or sandwich-norm) decoder with RoPE
attention; what differs between them is data: the norm and where it sits, the MLP and its activation,
which projections carry biases and which config field says so, q/k norms, multipliers, softcaps, the
RoPE pairing layout, whether ``partial_rotary_factor`` is honoured, which layers rotate at all, how
sliding layers are derived, attention sinks, and the tensor names. ``hf_config.read_model_config`` reads a config through its family, the float64 reference
decoder (``models/reference.py``) and the engine (``transformer.py``) both compute from the resulting
config and never look at the architecture name, and the loaders map tensor names through
:func:`canonical_weights`. Adding an architecture is a :class:`Family` entry, not a model file.

Each entry mirrors transformers' ``modeling_<name>.py`` (5.x); the comments name what the entry
encodes where it differs from llama. Architectures ropekv cannot model exactly yet are listed in
:data:`REFUSED` with the feature that stops them (docs/architectures.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

import torch

from ..errors import CheckpointError
from ..rope import Layout

# "layer_plain": mean-centred LayerNorm with neither weight nor bias (OLMo), no tensors at all.
NormKind = Literal["rms", "rms_offset", "layer", "layer_offset", "layer_plain"]
MlpKind = Literal["gated", "plain"]
# q/k norms: one weight [D] applied to every head, a weight per head [heads, D], one weight over
# the whole projection [heads * D], or llama4's weightless per-head L2 norm (RoPE layers only), all
# before RoPE; "head_after_rope" (hunyuan) normalizes each rotated head, so the cached key is
# norm(R(j) k): not a rotation of any raw key.
QkNorm = Literal["none", "head", "per_head", "projection", "l2", "head_after_rope"]
# Rows of a fused query_key_value: q, then k, then v ("concat": phi3); or grouped by KV head,
# [KVH, heads / KVH + 2, D]: each group's query heads, its key head, its value head ("grouped":
# GPT-NeoX and Persimmon with one query head per group, [heads, 3, D]; Falcon).
FusedQkv = Literal["concat", "grouped"]
RopeLayers = Literal["all", "no_rope_layers", "sliding_only", "sliding_only_if_window"]
Flag = bool | str  # a constant, or the config.json field that decides it


@dataclass(frozen=True)
class ConfigReading:
    """How the architecture's transformers config class and modeling code read ``config.json``
    (:mod:`ropekv.models.hf_config`): which fields hold the epsilon, the activation, the biases, the
    sizes and scales, whether ``partial_rotary_factor`` is honoured, which layers rotate, how sliding
    layers are derived, the class's defaults and renames, and the fields it ignores.

    ``parallel``: one input norm feeds attention and MLP, both added to the residual (cohere); a config
    field where the architecture reads one (GPT-NeoX's ``use_parallel_residual``).
    ``parallel_mlp_norm``: in a parallel block the MLP reads the block input through its own norm
    ``mlp_in`` (GPT-NeoX), else through ``attn_in``. Both become ModelConfig fields.
    """

    eps_key: str | None = "rms_norm_eps"  # None: eps_default, whatever the config says (OLMo's 1e-5)
    eps_default: float | None = None  # None: the field is required
    parallel: Flag = False
    parallel_mlp_norm: bool = False
    act_key: str = "hidden_act"
    act_default: str = "silu"
    # Activation names the config class rewrites on load (gemma's legacy "gelu" means the tanh approximation).
    act_renamed: Mapping[str, str] = field(default_factory=dict)
    qkv_bias: Flag = False
    o_bias: Flag = False
    mlp_bias: Flag = False
    qk_norm_flag: Flag = True  # the config field that switches the q/k norms on (stablelm's qk_layernorm)
    head_dim_key: str | None = "head_dim"  # None: head_dim is hidden_size // num_attention_heads, always
    kv_heads_key: str | None = "num_key_value_heads"  # None: one KV head per query head, always
    clip_qkv_key: str | None = None  # OLMo: q, k, v clamped to [-clip, clip] right after their projections
    intermediate_multiple: int | None = None  # intermediate_size null: this many times hidden_size (gptj)
    # "config": RoPE from the config's RoPE fields; "rotary_dim": theta 10000, no scaling, over the
    # config's rotary_dim channels -- GPT-J's fixed sinusoidal table
    rope_from: Literal["config", "rotary_dim"] = "config"
    # "falcon": KV heads, fused-qkv groups and block layout from new_decoder_architecture /
    # multi_query / parallel_attn / num_ln_in_parallel_attn (hf_config._falcon_layout); alibi refused
    heads_rule: Literal["config", "falcon"] = "config"
    layout: Layout = "neox"
    partial_rotary: bool = False  # does the architecture honour partial_rotary_factor?
    rope_layers: RopeLayers = "all"
    # How sliding layers are derived where config.json has no layer_types, as the architecture's config
    # class derives them (hf_config._layer_types): "none"/"layer_types" every layer full; "mistral" every
    # layer slides iff sliding_window; "qwen2" iff use_sliding_window and layer >= max_window_layers;
    # "qwen2_moe" iff use_sliding_window, layer < max_window_layers and layer even; "qwen3_moe" every
    # layer iff use_sliding_window (its modeling never reads layer_types); "period": layer i slides iff
    # (i + 1) % P != 0, P = config[window_period_key] (or window_period where absent); "smollm3" iff
    # use_sliding_window and the layer is NoPE; "llama4": chunked layers where the layer rotates.
    windows: Literal[
        "none", "mistral", "qwen2", "qwen2_moe", "qwen3_moe", "layer_types", "period", "smollm3", "llama4"
    ] = "layer_types"
    window_period: int = 2
    window_period_key: str | None = None  # the config field holding the period, where it is configurable
    moe: (
        Literal[
            "mixtral",
            "qwen2_moe",
            "qwen3_moe",
            "granitemoe",
            "deepseek_v2",
            "deepseek_v3",
            "glm4_moe",
            "llama4",
            "gpt_oss",
        ]
        | None
    ) = None  # models/moe.py
    attention: Literal["standard", "mla"] = "standard"  # "mla": multi-head latent attention (models/mla.py)
    # gpt_oss: a learned logit per query head (``self_attn.sinks [H]``) joins every softmax denominator
    # and is dropped after it: attention weights sum to less than 1. Weights, not cache contents.
    sinks: bool = False
    # hunyuan: a "dynamic" RoPE with a non-zero ``alpha`` is a fixed NTK base, theta * alpha ** (d / (d - 2)),
    # not dynamic NTK (HunYuanDenseV1RotaryEmbedding's ntk_alpha); hf_config._ntk_alpha reads it.
    ntk_alpha: bool = False
    # gemma3: the config field holding the sliding layers' own theta where rope_parameters is not
    # nested by layer type (rope_local_base_freq)
    local_theta_key: str | None = None
    # deepseek_v3: the config field choosing the RoPE pairing, "gptj" where true, "neox" where false
    # (rope_interleave); it overrides the layout the caller asks for
    layout_key: str | None = None
    # config flags the architecture never acts on, with why: a warning where one is true
    # (deepseek_v2's router never renormalizes, whatever norm_topk_prob says)
    ignored_true_flags: Mapping[str, str] = field(default_factory=dict)
    dense_size_key: str = "intermediate_size"  # the dense MLP's size (llama4: intermediate_size_mlp)
    # llama4's attention temperature tuning on NoPE layers (attn_temperature_tuning, floor_scale, attn_scale)
    attn_temperature: bool = False
    mrope: bool = False  # Qwen2-VL: rope_parameters.mrope_section (RopeSpec.mrope_section)
    text_config: bool = False  # a multimodal config: the text model's fields are under text_config
    embedding_scale: Literal["none", "sqrt_hidden", "embedding_multiplier"] = "none"
    residual_scale_key: str | None = None  # granite: residual_multiplier
    attn_scale_key: str | None = None  # granite: attention_multiplier (the scale itself)
    query_pre_attn_scalar: bool = False  # gemma2/3: scale = query_pre_attn_scalar ** -0.5
    attn_softcap_key: str | None = None
    final_softcap_key: str | None = None
    logits_divide_key: str | None = None  # granite: logits / logits_scaling
    logits_multiply_key: str | None = None  # cohere: logits * logit_scale
    # config fields the architecture's implementation never reads although other families do
    ignored_fields: tuple[str, ...] = ()
    # Values the architecture's config class gives fields a config.json may omit, where reading the
    # absence as false / none / llama's value would be another model (gemma ties its embeddings,
    # cohere scales its logits by 0.0625, ...). Keys: config.json fields; "rope_theta",
    # "partial_rotary_factor" and "rope_parameters" apply only when the config names no RoPE at all.
    defaults: Mapping[str, object] = field(default_factory=dict)
    # config.json field -> the field ropekv reads, where the config class renames it on load
    # (GPT-NeoX's rotary_pct -> partial_rotary_factor); the new name wins when both are given
    renamed: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BlockSpec:
    """How one decoder block computes, beyond what ModelConfig's fields say: the norm kind and its
    slots, the MLP kind, the q/k norm kind (the reference decoder and the engine read these).

    Norm slots name the tensors (under ``model.layers.{i}.``) of the norms around attention and MLP:
    ``attn_in`` normalizes the block input before attention, ``attn_out`` the attention output before
    the residual add (gemma2, olmo2), ``mlp_in``/``mlp_out`` likewise for the MLP.
    """

    norm: NormKind = "rms"
    norm_bias: bool = False
    attn_in: str | None = "input_layernorm"
    attn_out: str | None = None
    mlp_in: str | None = "post_attention_layernorm"
    mlp_out: str | None = None
    final_norm: str = "model.norm"
    mlp: MlpKind = "gated"
    qk_norm: QkNorm = "none"
    qk_norm_bias: bool = False
    lm_head_bias: bool = False


@dataclass(frozen=True)
class TensorNames:
    """Where the checkpoint keeps each tensor, relative to ropekv's canonical (llama) names
    (:func:`canonical_weights`).

    ``layers_prefix`` is where the checkpoint keeps its decoder layers (canonical: ``model.layers``),
    ``top_names`` maps canonical names of tensors outside the layers to the checkpoint's
    (``model.embed_tokens`` -> ``gpt_neox.embed_in``), ``names`` per-layer modules, ``stacked``
    per-head modules ``{module}.{h}.weight`` stacked into one canonical ``[heads, D]``.
    """

    # Whole-name prefixes: renamed (a live multimodal model's "model.language_model." -> "model.") or
    # dropped (the vision tower, which ropekv does not check: docs/architectures.md).
    prefixes: Mapping[str, str] = field(default_factory=dict)
    dropped_prefixes: tuple[str, ...] = ()
    layers_prefix: str = "model.layers"
    top_names: Mapping[str, str] = field(default_factory=dict)  # canonical -> checkpoint module, outside layers
    names: Mapping[str, str] = field(default_factory=dict)  # canonical -> checkpoint module name, per layer
    aliases: Mapping[str, str] = field(default_factory=dict)  # checkpoint tensor name -> canonical, per layer
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # fused tensor -> canonical parts
    fused_qkv: FusedQkv = "concat"
    stacked: Mapping[str, str] = field(default_factory=dict)  # per-head checkpoint module -> canonical
    # Per-expert tensors as saved on disk: (module holding experts 0..E-1, (gate, up, down) names),
    # stacked into the canonical experts.gate_up_proj / experts.down_proj (models/moe.py).
    experts: tuple[str, tuple[str, str, str]] | None = None
    # Stacked expert tensors as stored: "rows" is the canonical [E, 2I, hidden] gate-then-up /
    # [E, hidden, I]; "transposed" (llama4) stores [E, hidden, 2I] / [E, I, hidden]; "gpt_oss" stores
    # them transposed with gate and up interleaved (gate = [..., 0::2], up = [..., 1::2]), biases
    # likewise interleaved.
    experts_layout: Literal["rows", "transposed", "gpt_oss"] = "rows"


@dataclass(frozen=True)
class HfHooks:
    """Where the transformers adapter (``adapters/hf.py``) hooks a live model of the architecture:
    ``attn_module`` is the attention module of a layer, under ``layers`` (where not at the
    checkpoint's ``layers_prefix``).
    """

    # a method of the attention module taking (query, key, value, mask) where the architecture does
    # not call transformers' attention interface (GPT-J's _attn); the transformers adapter hooks it
    attention_method: str | None = None
    attention_inline: bool = False  # attention computed inline (Falcon): nothing for the adapter to hook
    # where a live transformers model holds its decoder layers, where not at layers_prefix (Qwen2-VL's
    # image-text class: model.language_model.layers); the transformers adapter reads it
    layers: str | None = None
    attn_module: str = "self_attn"


@dataclass(frozen=True)
class Family:
    """How one transformers architecture is read, computed and named, as data (see the module
    docstring): its ``name`` (transformers' ``model_type``), the ``classes`` of its ``architectures``
    entries, and the four parts."""

    name: str
    classes: tuple[str, ...]
    reading: ConfigReading = field(default_factory=ConfigReading)
    block: BlockSpec = field(default_factory=BlockSpec)
    tensors: TensorNames = field(default_factory=TensorNames)
    hf: HfHooks = field(default_factory=HfHooks)


class _Biases(TypedDict):
    """Which config fields switch a family's biases on (a :class:`ConfigReading`'s bias fields)."""

    qkv_bias: str
    o_bias: str
    mlp_bias: str


# llama's bias fields, shared by the families that read them as llama does
_LLAMA_BIAS = _Biases(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias")

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama",
            ("LlamaForCausalLM",),
            reading=ConfigReading(**_LLAMA_BIAS),
        ),
        # Mistral's attention has no bias at all: attention_bias in its config is ignored.
        Family(
            "mistral",
            ("MistralForCausalLM",),
            reading=ConfigReading(
                windows="mistral", ignored_fields=("attention_bias",), defaults={"sliding_window": 4096}
            ),
        ),
        Family(
            "ministral",
            ("MinistralForCausalLM",),
            reading=ConfigReading(
                ignored_fields=("attention_bias",), windows="mistral", defaults={"sliding_window": 4096}
            ),
        ),
        Family(
            "qwen2",
            ("Qwen2ForCausalLM",),
            reading=ConfigReading(qkv_bias=True, windows="qwen2", defaults={"max_window_layers": 28}),
        ),
        Family(
            "qwen3",
            ("Qwen3ForCausalLM",),
            reading=ConfigReading(
                qkv_bias="attention_bias", o_bias="attention_bias", windows="qwen2", defaults={"max_window_layers": 28}
            ),
            block=BlockSpec(qk_norm="head"),
        ),
        Family(
            "helium",
            ("HeliumForCausalLM",),
            reading=ConfigReading(
                layout="gptj", qkv_bias="attention_bias", mlp_bias="mlp_bias", defaults={"rope_theta": 100000.0}
            ),
        ),
        Family(
            "seed_oss",
            ("SeedOssForCausalLM",),
            reading=ConfigReading(
                qkv_bias="attention_bias",
                o_bias="attention_out_bias",
                mlp_bias="mlp_bias",
                defaults={"attention_bias": True},
            ),
        ),
        Family(
            "smollm3",
            ("SmolLM3ForCausalLM",),
            reading=ConfigReading(
                rope_layers="no_rope_layers",
                windows="smollm3",
                **_LLAMA_BIAS,
                defaults={"tie_word_embeddings": True, "rope_theta": 2000000.0},
            ),
        ),
        # ERNIE 4.5: GLM's interleaved rotate_half over the whole head; one use_bias for every linear.
        Family(
            "ernie4_5",
            ("Ernie4_5ForCausalLM",),
            reading=ConfigReading(
                layout="gptj",
                qkv_bias="use_bias",
                o_bias="use_bias",
                mlp_bias="use_bias",
                defaults={"tie_word_embeddings": True, "rope_theta": 500000.0},
            ),
        ),
        # Arcee: llama with a non-gated ReLU^2 MLP (up_proj, down_proj).
        Family(
            "arcee",
            ("ArceeForCausalLM",),
            reading=ConfigReading(act_default="relu2", **_LLAMA_BIAS),
            block=BlockSpec(mlp="plain"),
        ),
        Family(
            "granite",
            ("GraniteForCausalLM",),
            reading=ConfigReading(
                embedding_scale="embedding_multiplier",
                residual_scale_key="residual_multiplier",
                attn_scale_key="attention_multiplier",
                logits_divide_key="logits_scaling",
                **_LLAMA_BIAS,
                defaults={"attention_multiplier": 1.0},
            ),
        ),  # the scale itself: 1.0 when omitted
        # Gemma: RMSNorm times (1 + weight), embeddings times sqrt(hidden_size), GELU (tanh).
        Family(
            "gemma",
            ("GemmaForCausalLM",),
            reading=ConfigReading(
                embedding_scale="sqrt_hidden",
                act_default="gelu_pytorch_tanh",
                act_renamed={"gelu": "gelu_pytorch_tanh"},  # GemmaConfig.__post_init__
                qkv_bias="attention_bias",
                o_bias="attention_bias",
                defaults={"tie_word_embeddings": True},
            ),
            block=BlockSpec(norm="rms_offset"),
        ),
        Family(
            "gemma2",
            ("Gemma2ForCausalLM",),
            reading=ConfigReading(
                embedding_scale="sqrt_hidden",
                act_key="hidden_activation",
                act_default="gelu_pytorch_tanh",
                qkv_bias="attention_bias",
                o_bias="attention_bias",
                query_pre_attn_scalar=True,
                attn_softcap_key="attn_logit_softcapping",
                final_softcap_key="final_logit_softcapping",
                windows="period",
                defaults={
                    "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256,
                    "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0,
                    "sliding_window": 4096,
                },
            ),
            block=BlockSpec(
                norm="rms_offset",
                attn_out="post_attention_layernorm",
                mlp_in="pre_feedforward_layernorm",
                mlp_out="post_feedforward_layernorm",
            ),
        ),
        Family(
            "gemma3_text",
            ("Gemma3ForCausalLM",),
            reading=ConfigReading(
                local_theta_key="rope_local_base_freq",
                embedding_scale="sqrt_hidden",
                act_key="hidden_activation",
                act_default="gelu_pytorch_tanh",
                qkv_bias="attention_bias",
                o_bias="attention_bias",
                query_pre_attn_scalar=True,
                attn_softcap_key="attn_logit_softcapping",
                final_softcap_key="final_logit_softcapping",
                windows="period",
                window_period=6,
                window_period_key="sliding_window_pattern",
                defaults={
                    "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256,
                    "sliding_window": 4096,
                    "rope_parameters": {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                    },
                },
            ),
            block=BlockSpec(
                norm="rms_offset",
                attn_out="post_attention_layernorm",
                mlp_in="pre_feedforward_layernorm",
                mlp_out="post_feedforward_layernorm",
                qk_norm="head",
            ),
        ),
        # Apertus: llama attention with per-head q/k RMSNorms, attention_layernorm / feedforward_layernorm,
        # a plain up/down MLP with xIELU (learned alpha_p, alpha_n per layer; beta, eps buffers).
        Family(
            "apertus",
            ("ApertusForCausalLM",),
            reading=ConfigReading(
                act_default="xielu",
                qkv_bias="attention_bias",
                o_bias="attention_bias",
                defaults={
                    "rope_parameters": {
                        "rope_type": "llama3",
                        "rope_theta": 12000000.0,
                        "factor": 8.0,
                        "original_max_position_embeddings": 8192,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                    }
                },
            ),
            block=BlockSpec(attn_in="attention_layernorm", mlp_in="feedforward_layernorm", mlp="plain", qk_norm="head"),
        ),
        # OLMo (1): LayerNorm without weight or bias (eps 1e-5, fixed), q/k/v clamped to +-clip_qkv.
        Family(
            "olmo",
            ("OlmoForCausalLM",),
            reading=ConfigReading(
                eps_key=None,
                eps_default=1e-5,
                qkv_bias="attention_bias",
                o_bias="attention_bias",
                clip_qkv_key="clip_qkv",
            ),
            block=BlockSpec(norm="layer_plain"),
        ),
        # OLMo 2/3: post-norm only (on attention and MLP outputs); q/k norms over the whole projection.
        Family(
            "olmo2",
            ("Olmo2ForCausalLM",),
            reading=ConfigReading(qkv_bias="attention_bias", o_bias="attention_bias"),
            block=BlockSpec(
                attn_in=None,
                attn_out="post_attention_layernorm",
                mlp_in=None,
                mlp_out="post_feedforward_layernorm",
                qk_norm="projection",
            ),
        ),
        Family(
            "olmo3",
            ("Olmo3ForCausalLM",),
            reading=ConfigReading(
                qkv_bias="attention_bias",
                o_bias="attention_bias",
                windows="period",
                window_period=4,
                defaults={"sliding_window": 4096, "rope_theta": 500000.0},
            ),
            block=BlockSpec(
                attn_in=None,
                attn_out="post_attention_layernorm",
                mlp_in=None,
                mlp_out="post_feedforward_layernorm",
                qk_norm="projection",
            ),
        ),
        # EXAONE 4: olmo2's post-norms, per-head q/k norms, and NoPE on full layers of a hybrid model.
        Family(
            "exaone4",
            ("Exaone4ForCausalLM",),
            reading=ConfigReading(
                rope_layers="sliding_only_if_window",
                windows="period",
                window_period=4,
                window_period_key="sliding_window_pattern",
                defaults={"sliding_window": 4096},
            ),
            block=BlockSpec(
                attn_in=None,
                attn_out="post_attention_layernorm",
                mlp_in=None,
                mlp_out="post_feedforward_layernorm",
                qk_norm="head",
            ),
        ),
        # Cohere: mean-centred LayerNorm without bias, parallel attention + MLP, interleaved RoPE,
        # logits times logit_scale.
        # use_qk_norm: LayerNorms with a weight per head ([heads, head_dim]), no bias.
        Family(
            "cohere",
            ("CohereForCausalLM",),
            reading=ConfigReading(
                eps_key="layer_norm_eps",
                parallel=True,
                layout="gptj",
                qkv_bias="attention_bias",
                o_bias="attention_bias",
                logits_multiply_key="logit_scale",
                qk_norm_flag="use_qk_norm",
                defaults={"tie_word_embeddings": True, "logit_scale": 0.0625, "rope_theta": 500000.0},
            ),
            block=BlockSpec(norm="layer", mlp_in=None, qk_norm="per_head"),
        ),
        Family(
            "cohere2",
            ("Cohere2ForCausalLM",),
            reading=ConfigReading(
                eps_key="layer_norm_eps",
                parallel=True,
                layout="gptj",
                qkv_bias="attention_bias",
                o_bias="attention_bias",
                logits_multiply_key="logit_scale",
                rope_layers="sliding_only",
                windows="period",
                window_period=4,
                window_period_key="sliding_window_pattern",
                defaults={"tie_word_embeddings": True, "logit_scale": 0.0625, "sliding_window": 4096},
            ),
            block=BlockSpec(norm="layer", mlp_in=None),
        ),
        # StarCoder2: LayerNorm with bias, plain GELU MLP c_fc/c_proj, one use_bias for every linear.
        Family(
            "starcoder2",
            ("Starcoder2ForCausalLM",),
            reading=ConfigReading(
                eps_key="norm_epsilon",
                act_default="gelu_pytorch_tanh",
                qkv_bias="use_bias",
                o_bias="use_bias",
                mlp_bias="use_bias",
                windows="mistral",
                defaults={"tie_word_embeddings": True, "use_bias": True},
            ),
            block=BlockSpec(norm="layer", norm_bias=True, mlp="plain"),
            tensors=TensorNames(names={"mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}),
        ),
        # StableLM: head_dim from the hidden size; qk_layernorm: one bias-free LayerNorm per head
        # (q_layernorm.norms.{h}), stacked into [heads, head_dim]; use_parallel_residual: attention and MLP
        # share input_layernorm (there is no post_attention_layernorm then).
        Family(
            "stablelm",
            ("StableLmForCausalLM",),
            reading=ConfigReading(
                eps_key="layer_norm_eps",
                qkv_bias="use_qkv_bias",
                partial_rotary=True,
                head_dim_key=None,
                qk_norm_flag="qk_layernorm",
                parallel="use_parallel_residual",
                defaults={"partial_rotary_factor": 0.25},
            ),
            block=BlockSpec(norm="layer", norm_bias=True, qk_norm="per_head"),
            tensors=TensorNames(
                stacked={
                    "self_attn.q_layernorm.norms": "self_attn.q_norm",
                    "self_attn.k_layernorm.norms": "self_attn.k_norm",
                }
            ),
        ),
        # Nemotron: LayerNorm with (1 + weight) and bias, ReLU^2 up/down MLP, partial rotary.
        Family(
            "nemotron",
            ("NemotronForCausalLM",),
            reading=ConfigReading(
                eps_key="norm_eps",
                act_default="relu2",
                **_LLAMA_BIAS,
                partial_rotary=True,
                defaults={"partial_rotary_factor": 0.5},
            ),
            block=BlockSpec(norm="layer_offset", norm_bias=True, mlp="plain"),
        ),
        # GLM / GLM-4: interleaved partial rotary, fused gate_up_proj; GLM-4 adds sandwich norms.
        Family(
            "glm",
            ("GlmForCausalLM",),
            reading=ConfigReading(
                layout="gptj",
                partial_rotary=True,
                qkv_bias="attention_bias",
                defaults={"attention_bias": True, "partial_rotary_factor": 0.5},
            ),
            tensors=TensorNames(fused={"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}),
        ),
        Family(
            "glm4",
            ("Glm4ForCausalLM",),
            reading=ConfigReading(
                layout="gptj",
                partial_rotary=True,
                qkv_bias="attention_bias",
                defaults={"attention_bias": True, "partial_rotary_factor": 0.5},
            ),
            block=BlockSpec(attn_out="post_self_attn_layernorm", mlp_out="post_mlp_layernorm"),
            tensors=TensorNames(fused={"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}),
        ),
        # GPT-NeoX (Pythia): fused query_key_value with rows [heads, 3, head_dim], no GQA, head_dim from
        # the hidden size; partial rotary (rotary_pct, 0.25 by default); parallel residual by default,
        # its MLP with its own input norm; LayerNorm with bias; biased plain GELU MLP.
        Family(
            "gpt_neox",
            ("GPTNeoXForCausalLM",),
            reading=ConfigReading(
                eps_key="layer_norm_eps",
                parallel="use_parallel_residual",
                parallel_mlp_norm=True,
                act_default="gelu",
                qkv_bias="attention_bias",
                o_bias="attention_bias",
                mlp_bias=True,
                partial_rotary=True,
                head_dim_key=None,
                kv_heads_key=None,
                renamed={"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"},
                defaults={"partial_rotary_factor": 0.25, "use_parallel_residual": True, "attention_bias": True},
            ),
            block=BlockSpec(norm="layer", norm_bias=True, mlp="plain"),
            tensors=TensorNames(
                layers_prefix="gpt_neox.layers",
                top_names={
                    "model.embed_tokens": "gpt_neox.embed_in",
                    "model.norm": "gpt_neox.final_layer_norm",
                    "lm_head": "embed_out",
                },  # embed_out: checkpoints saved before transformers 5
                names={
                    "self_attn.o_proj": "attention.dense",
                    "mlp.up_proj": "mlp.dense_h_to_4h",
                    "mlp.down_proj": "mlp.dense_4h_to_h",
                },
                fused={"attention.query_key_value": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
                fused_qkv="grouped",
            ),
            hf=HfHooks(attn_module="attention"),
        ),
        # Persimmon: GPT-NeoX's fused query_key_value ([heads, 3, head_dim], no GQA); qk_layernorm (on by
        # default): one LayerNorm with bias over head_dim, applied to every head; biased ReLU^2 MLP.
        Family(
            "persimmon",
            ("PersimmonForCausalLM",),
            reading=ConfigReading(
                eps_key="layer_norm_eps",
                act_default="relu2",
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
                partial_rotary=True,
                head_dim_key=None,
                kv_heads_key=None,
                qk_norm_flag="qk_layernorm",
                defaults={"partial_rotary_factor": 0.5, "qk_layernorm": True},
            ),
            block=BlockSpec(norm="layer", norm_bias=True, mlp="plain", qk_norm="head", qk_norm_bias=True),
            tensors=TensorNames(
                top_names={"model.norm": "model.final_layernorm"},
                names={
                    "self_attn.o_proj": "self_attn.dense",
                    "self_attn.q_norm": "self_attn.q_layernorm",
                    "self_attn.k_norm": "self_attn.k_layernorm",
                    "mlp.up_proj": "mlp.dense_h_to_4h",
                    "mlp.down_proj": "mlp.dense_4h_to_h",
                },
                fused={"self_attn.query_key_value": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
                fused_qkv="grouped",
            ),
        ),
        # Phi (1, 1.5, 2): attention and MLP in parallel on one input LayerNorm, biased q/k/v and `dense`
        # output, biased plain fc1/fc2 MLP (GELU), biased lm_head, partial rotary; qk_layernorm: one
        # LayerNorm with bias over head_dim for every head.
        Family(
            "phi",
            ("PhiForCausalLM",),
            reading=ConfigReading(
                eps_key="layer_norm_eps",
                parallel=True,
                act_default="gelu_new",
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
                partial_rotary=True,
                qk_norm_flag="qk_layernorm",
                defaults={"partial_rotary_factor": 0.5},
            ),
            block=BlockSpec(
                norm="layer",
                norm_bias=True,
                mlp_in=None,
                mlp="plain",
                lm_head_bias=True,
                qk_norm="head",
                qk_norm_bias=True,
            ),
            tensors=TensorNames(
                top_names={"model.norm": "model.final_layernorm"},
                names={
                    "self_attn.o_proj": "self_attn.dense",
                    "self_attn.q_norm": "self_attn.q_layernorm",
                    "self_attn.k_norm": "self_attn.k_layernorm",
                    "mlp.up_proj": "mlp.fc1",
                    "mlp.down_proj": "mlp.fc2",
                },
            ),
        ),
        # GPT-J: parallel block on ln_1, interleaved rotary over rotary_dim channels only (theta 10000
        # fixed: its sin/cos table ignores every RoPE field), biased fc_in/fc_out MLP (4 x hidden when
        # n_inner is null), biased lm_head, no q/k/v/out bias; its attention does not go through
        # transformers' attention interface (GPTJAttention._attn is hooked instead).
        Family(
            "gptj",
            ("GPTJForCausalLM",),
            reading=ConfigReading(
                eps_key="layer_norm_epsilon",
                parallel=True,
                act_key="activation_function",
                act_default="gelu_new",
                mlp_bias=True,
                layout="gptj",
                partial_rotary=True,
                head_dim_key=None,
                kv_heads_key=None,
                rope_from="rotary_dim",
                intermediate_multiple=4,
                ignored_fields=(
                    "intermediate_size",
                    "rope_parameters",
                    "rope_scaling",
                    "rope_theta",
                    "partial_rotary_factor",
                ),
                renamed={
                    "n_embd": "hidden_size",
                    "n_head": "num_attention_heads",
                    "n_layer": "num_hidden_layers",
                    "n_positions": "max_position_embeddings",
                    "n_inner": "intermediate_size",
                },
                defaults={"rotary_dim": 64},
            ),
            block=BlockSpec(norm="layer", norm_bias=True, mlp_in=None, mlp="plain", lm_head_bias=True),
            tensors=TensorNames(
                layers_prefix="transformer.h",
                top_names={"model.embed_tokens": "transformer.wte", "model.norm": "transformer.ln_f"},
                names={
                    "input_layernorm": "ln_1",
                    "self_attn.q_proj": "attn.q_proj",
                    "self_attn.k_proj": "attn.k_proj",
                    "self_attn.v_proj": "attn.v_proj",
                    "self_attn.o_proj": "attn.out_proj",
                    "mlp.up_proj": "mlp.fc_in",
                    "mlp.down_proj": "mlp.fc_out",
                },
            ),
            hf=HfHooks(attention_method="_attn", attn_module="attn"),
        ),
        # Falcon (RoPE variants): fused query_key_value grouped by KV head ([KVH, heads / KVH + 2, D];
        # multi_query: one KV head; new_decoder_architecture: num_kv_heads groups whose keys/values
        # transformers broadcasts to every query head before caching, so the cache holds one per query
        # head); parallel block on one norm or on ln_attn / ln_mlp; one `bias` flag; plain GELU MLP.
        Family(
            "falcon",
            ("FalconForCausalLM",),
            reading=ConfigReading(
                eps_key="layer_norm_epsilon",
                eps_default=1e-5,
                parallel="parallel_attn",
                act_key="activation",
                act_default="gelu",
                qkv_bias="bias",
                o_bias="bias",
                mlp_bias="bias",
                head_dim_key=None,
                kv_heads_key=None,
                heads_rule="falcon",
                ignored_fields=("intermediate_size",),
                renamed={
                    "n_embed": "hidden_size",
                    "n_head": "num_attention_heads",
                    "n_layer": "num_hidden_layers",
                    "ffn_hidden_size": "intermediate_size",
                },
                intermediate_multiple=4,
                defaults={"tie_word_embeddings": True, "multi_query": True, "parallel_attn": True},
            ),
            block=BlockSpec(norm="layer", norm_bias=True, mlp="plain"),
            tensors=TensorNames(
                layers_prefix="transformer.h",
                top_names={"model.embed_tokens": "transformer.word_embeddings", "model.norm": "transformer.ln_f"},
                names={
                    "self_attn.o_proj": "self_attention.dense",
                    "mlp.up_proj": "mlp.dense_h_to_4h",
                    "mlp.down_proj": "mlp.dense_4h_to_h",
                },
                aliases={
                    f"{ln}.{t}": f"{canonical}.{t}"
                    for ln, canonical in (("ln_attn", "input_layernorm"), ("ln_mlp", "post_attention_layernorm"))
                    for t in ("weight", "bias")
                },
                fused={"self_attention.query_key_value": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
                fused_qkv="grouped",
            ),
            hf=HfHooks(attention_inline=True, attn_module="self_attention"),
        ),
        # HunYuan dense: llama with per-head q/k RMSNorm applied after RoPE (query_layernorm/key_layernorm)
        # and its NTK-alpha RoPE (hf_config._hunyuan_rope); no sliding layers.
        Family(
            "hunyuan_v1_dense",
            ("HunYuanDenseV1ForCausalLM",),
            reading=ConfigReading(qkv_bias="attention_bias", o_bias="attention_bias", windows="none", ntk_alpha=True),
            block=BlockSpec(qk_norm="head_after_rope"),
            tensors=TensorNames(
                names={"self_attn.q_norm": "self_attn.query_layernorm", "self_attn.k_norm": "self_attn.key_layernorm"}
            ),
        ),
        # Phi-3: fused qkv_proj and gate_up_proj, partial rotary, LongRoPE.
        Family(
            "phi3",
            ("Phi3ForCausalLM",),
            reading=ConfigReading(partial_rotary=True, windows="mistral"),
            tensors=TensorNames(
                fused={
                    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                }
            ),
        ),
    )
}

FAMILIES.update(
    {
        f.name: f
        for f in (
            # Mixture-of-experts MLPs (models/moe.py); attention as in their dense relatives.
            Family(
                "mixtral",
                ("MixtralForCausalLM",),
                reading=ConfigReading(moe="mixtral", windows="mistral", defaults={"rope_theta": 1000000.0}),
                tensors=TensorNames(
                    aliases={"block_sparse_moe.gate.weight": "mlp.gate.weight"},
                    experts=("block_sparse_moe.experts", ("w1", "w3", "w2")),
                ),
            ),
            Family(
                "qwen2_moe",
                ("Qwen2MoeForCausalLM",),
                reading=ConfigReading(
                    moe="qwen2_moe",
                    qkv_bias="qkv_bias",
                    windows="qwen2_moe",
                    defaults={"qkv_bias": True, "max_window_layers": 28},
                ),
                tensors=TensorNames(experts=("mlp.experts", ("gate_proj", "up_proj", "down_proj"))),
            ),
            Family(
                "qwen3_moe",
                ("Qwen3MoeForCausalLM",),
                reading=ConfigReading(
                    moe="qwen3_moe", qkv_bias="attention_bias", o_bias="attention_bias", windows="qwen3_moe"
                ),
                block=BlockSpec(qk_norm="head"),
                tensors=TensorNames(experts=("mlp.experts", ("gate_proj", "up_proj", "down_proj"))),
            ),
            Family(
                "granitemoe",
                ("GraniteMoeForCausalLM",),
                reading=ConfigReading(
                    moe="granitemoe",
                    embedding_scale="embedding_multiplier",
                    residual_scale_key="residual_multiplier",
                    attn_scale_key="attention_multiplier",
                    logits_divide_key="logits_scaling",
                    qkv_bias="attention_bias",
                    o_bias="attention_bias",
                    defaults={"attention_multiplier": 1.0},
                ),
                tensors=TensorNames(
                    aliases={
                        "block_sparse_moe.router.weight": "mlp.gate.weight",
                        "block_sparse_moe.router.layer.weight": "mlp.gate.weight",
                        "block_sparse_moe.experts.gate_up_proj": "mlp.experts.gate_up_proj",
                        "block_sparse_moe.experts.down_proj": "mlp.experts.down_proj",
                        "block_sparse_moe.input_linear.weight": "mlp.experts.gate_up_proj",
                        "block_sparse_moe.output_linear.weight": "mlp.experts.down_proj",
                    }
                ),
            ),
            # DeepSeek V2/V3: multi-head latent attention (models/mla.py); MoE from first_k_dense_replace on, with
            # shared experts and (grouped) routing. V2 rotates the rope part as complex pairs (interleaved); V3
            # interleaved iff rope_interleave (its default), else rotate_half. Defaults: the config classes'.
            Family(
                "deepseek_v2",
                ("DeepseekV2ForCausalLM",),
                reading=ConfigReading(
                    ignored_true_flags={"norm_topk_prob": "router never renormalizes"},
                    attention="mla",
                    moe="deepseek_v2",
                    layout="gptj",
                    qkv_bias="attention_bias",
                    o_bias="attention_bias",
                    mlp_bias="mlp_bias",
                    windows="none",
                    defaults={
                        "q_lora_rank": 1536,
                        "kv_lora_rank": 512,
                        "qk_nope_head_dim": 128,
                        "qk_rope_head_dim": 64,
                        "v_head_dim": 128,
                        "n_routed_experts": 64,
                        "n_shared_experts": 2,
                        "routed_scaling_factor": 1.0,
                        "topk_method": "greedy",
                        "first_k_dense_replace": 0,
                        "moe_intermediate_size": 1407,
                    },
                ),
                tensors=TensorNames(experts=("mlp.experts", ("gate_proj", "up_proj", "down_proj"))),
            ),
            Family(
                "deepseek_v3",
                ("DeepseekV3ForCausalLM",),
                reading=ConfigReading(
                    layout_key="rope_interleave",
                    attention="mla",
                    moe="deepseek_v3",
                    windows="none",
                    qkv_bias="attention_bias",
                    o_bias="attention_bias",
                    defaults={
                        "q_lora_rank": 1536,
                        "kv_lora_rank": 512,
                        "qk_nope_head_dim": 128,
                        "qk_rope_head_dim": 64,
                        "v_head_dim": 128,
                        "n_routed_experts": 256,
                        "n_shared_experts": 1,
                        "routed_scaling_factor": 2.5,
                        "n_group": 8,
                        "topk_group": 4,
                        "num_experts_per_tok": 8,
                        "first_k_dense_replace": 3,
                        "norm_topk_prob": True,
                        "rope_interleave": True,
                        "moe_intermediate_size": 2048,
                    },
                ),
                tensors=TensorNames(experts=("mlp.experts", ("gate_proj", "up_proj", "down_proj"))),
            ),
            # GLM-4.5 MoE: llama attention with q/k/v biases (attention_bias, none on o_proj), rotate_half partial
            # rotary (0.5 by default), per-head q/k RMSNorm iff use_qk_norm; deepseek_v3's sigmoid grouped routing.
            Family(
                "glm4_moe",
                ("Glm4MoeForCausalLM",),
                reading=ConfigReading(
                    moe="glm4_moe",
                    partial_rotary=True,
                    qkv_bias="attention_bias",
                    qk_norm_flag="use_qk_norm",
                    windows="none",
                    defaults={
                        "partial_rotary_factor": 0.5,
                        "n_routed_experts": 128,
                        "n_shared_experts": 1,
                        "routed_scaling_factor": 1.0,
                        "n_group": 1,
                        "topk_group": 1,
                        "num_experts_per_tok": 8,
                        "first_k_dense_replace": 1,
                        "norm_topk_prob": True,
                        "moe_intermediate_size": 1408,
                    },
                ),
                block=BlockSpec(qk_norm="head"),
                tensors=TensorNames(experts=("mlp.experts", ("gate_proj", "up_proj", "down_proj"))),
            ),
        )
    }
)

_LLAMA4_NAMES = {
    f"mlp.{m}": f"feed_forward.{m}"
    for m in (
        "gate_proj",
        "up_proj",
        "down_proj",
        "shared_expert.gate_proj",
        "shared_expert.up_proj",
        "shared_expert.down_proj",
        "experts",
    )
}

FAMILIES.update(
    {
        f.name: f
        for f in (
            # Llama 4 (text): interleaved RoPE (complex pairs) on chunked layers; every no_rope_layer_interval-th
            # layer NoPE with full attention and a position-dependent query temperature; weightless L2 q/k norm
            # on RoPE layers (after RoPE in transformers: the same as before it, a rotation keeps the norm, as long
            # as cos/sin carry no attention factor); MoE with a sigmoid top-k router scaling the experts' input and
            # an ungated shared expert, dense layers of intermediate_size_mlp.
            Family(
                "llama4_text",
                ("Llama4ForCausalLM",),
                reading=ConfigReading(
                    layout="gptj",
                    rope_layers="no_rope_layers",
                    qk_norm_flag="use_qk_norm",
                    qkv_bias="attention_bias",
                    o_bias="attention_bias",
                    windows="llama4",
                    moe="llama4",
                    dense_size_key="intermediate_size_mlp",
                    attn_temperature=True,
                    defaults={
                        "rope_theta": 500000.0,
                        "attention_chunk_size": 8192,
                        "use_qk_norm": True,
                        "attn_temperature_tuning": True,
                        "floor_scale": 8192,
                        "attn_scale": 0.1,
                        "no_rope_layer_interval": 4,
                        "num_experts_per_tok": 1,
                        "num_local_experts": 16,
                        "interleave_moe_layer_step": 1,
                        "intermediate_size_mlp": 16384,
                    },
                ),
                block=BlockSpec(qk_norm="l2"),
                tensors=TensorNames(
                    experts_layout="transposed", names={**_LLAMA4_NAMES, "mlp.gate": "feed_forward.router"}
                ),
            ),
        )
    }
)


# Qwen2-VL and Qwen2.5-VL read their text model alike: every part of the two families is the same.
def _qwen2_vl(name: str, cls: str) -> Family:
    return Family(
        name,
        (cls,),
        reading=ConfigReading(
            qkv_bias=True,
            windows="qwen2",
            mrope=True,
            text_config=True,
            head_dim_key=None,
            defaults={"rope_theta": 1000000.0},
        ),
        tensors=TensorNames(
            prefixes={"model.language_model.": "model."}, dropped_prefixes=("visual.", "model.visual.")
        ),
        hf=HfHooks(layers="model.language_model.layers"),
    )


FAMILIES.update(
    {
        f.name: f
        for f in (
            # Qwen2-VL / Qwen2.5-VL, the text model of a text-only checkpoint: qwen2's decoder (q/k/v bias, no o
            # bias, head_dim always hidden / heads) with mRoPE, whose three position streams coincide for text.
            _qwen2_vl("qwen2_vl", "Qwen2VLForConditionalGeneration"),
            _qwen2_vl("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
            # gpt-oss: attention sinks, every-other sliding layers, yarn, biases everywhere in attention, and
            # a biased top-k-softmax MoE with the clamped SwiGLU (models/moe.py) on every layer.
            Family(
                "gpt_oss",
                ("GptOssForCausalLM",),
                reading=ConfigReading(
                    qkv_bias="attention_bias",
                    o_bias="attention_bias",
                    sinks=True,
                    moe="gpt_oss",
                    windows="period",
                    window_period=2,
                    defaults={
                        "attention_bias": True,
                        "sliding_window": 128,
                        "rope_theta": 150000.0,
                        "swiglu_alpha": 1.702,
                        "swiglu_limit": 7.0,
                        "rms_norm_eps": 1e-5,
                        "rope_parameters": {
                            "rope_type": "yarn",
                            "factor": 32.0,
                            "beta_fast": 32.0,
                            "beta_slow": 1.0,
                            "truncate": False,
                            "original_max_position_embeddings": 4096,
                        },
                    },
                ),
                tensors=TensorNames(
                    experts_layout="gpt_oss",
                    aliases={"mlp.router.weight": "mlp.gate.weight", "mlp.router.bias": "mlp.gate.bias"},
                ),
            ),
        )
    }
)

# Architectures ropekv refuses, with the feature that is not modelled yet (docs/architectures.md).
REFUSED: dict[str, str] = {}

_CLASS_TO_FAMILY = {c: f.name for f in FAMILIES.values() for c in f.classes}


def family_of(model_type: object) -> str | None:
    """The family of a config's ``model_type`` (what transformers' auto classes build the model from;
    ``architectures`` only names the class saved), None where ropekv describes none."""
    return model_type if isinstance(model_type, str) and model_type in FAMILIES else None


def family_of_class(name: object) -> str | None:
    """The family a transformers model class name (an ``architectures`` entry) belongs to, or None."""
    return _CLASS_TO_FAMILY.get(name) if isinstance(name, str) else None


def layer_tensor_names(family: Family, canonical: str) -> str:
    """The checkpoint name (under the family's ``layers_prefix.{i}.``) of a canonical per-layer tensor name."""
    stem, _, suffix = canonical.rpartition(".")
    return family.tensors.names.get(stem, stem) + "." + suffix


def canonical_weights(config, weights: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of ``config`` (a :class:`~ropekv.models.config.ModelConfig`) under ropekv's
    canonical (llama-style) names: the family's ``layers_prefix`` read as ``model.layers``, renamed
    per ``top_names``, ``names`` and ``aliases``, fused tensors split into their parts
    (``config.split_sizes()`` rows each, in order; a ``grouped`` qkv regrouped by KV head first),
    per-head tensors and per-expert tensors stacked. Works on a saved checkpoint and on a live
    transformers ``state_dict`` (which may already hold the stacked expert layout).

    Unknown names pass through unchanged, so :func:`~ropekv.models.config.validate_weights` still
    names them as unexpected."""
    family = config.family
    split_sizes = config.split_sizes()
    renamed = {family.tensors.names[stem]: stem for stem in family.tensors.names}
    if family.tensors.prefixes or family.tensors.dropped_prefixes:
        weights = {
            _renamed_prefix(family, name): t
            for name, t in weights.items()
            if not name.startswith(family.tensors.dropped_prefixes)
        }
    top = {checkpoint: canonical for canonical, checkpoint in family.tensors.top_names.items()}
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer prefix, part) -> expert -> tensor
    heads: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer prefix, canonical) -> head -> tensor
    for name, tensor in weights.items():
        prefix, rest = _split_layer(name, family.tensors.layers_prefix)
        if prefix is None:
            stem, _, suffix = name.rpartition(".")
            out[f"{top[stem]}.{suffix}" if stem in top else name] = tensor
            continue
        if rest in family.tensors.aliases:
            out[prefix + family.tensors.aliases[rest]] = tensor
            continue
        if family.tensors.experts is not None and rest.startswith(family.tensors.experts[0] + "."):
            index, _, part = rest[len(family.tensors.experts[0]) + 1 :].partition(".")
            if index.isdigit() and part.endswith(".weight") and part[:-7] in family.tensors.experts[1]:
                experts.setdefault((prefix, part[:-7]), {})[int(index)] = tensor
                continue
        module, _, last = rest.rpartition(".")
        group, _, index = module.rpartition(".")
        if group in family.tensors.stacked and index.isdigit():
            heads.setdefault((prefix, f"{family.tensors.stacked[group]}.{last}"), {})[int(index)] = tensor
            continue
        stem, _, suffix = rest.rpartition(".")
        if (
            family.tensors.experts_layout == "transposed"
            and renamed.get(stem, stem) == "mlp.experts"
            and tensor.dim() == 3
        ):
            tensor = tensor.transpose(1, 2)  # [E, hidden, 2I] -> [E, 2I, hidden]; [E, I, hidden] -> [E, hidden, I]
        if stem in family.tensors.fused:
            parts, sizes = family.tensors.fused[stem], split_sizes[stem]
            if tensor.shape[0] != sum(sizes):
                raise CheckpointError(
                    f"{source}: tensor {name} has {tensor.shape[0]} rows, "
                    f"{' + '.join(map(str, sizes))} needed for {', '.join(parts)}"
                )
            pieces: Sequence[torch.Tensor]
            if family.tensors.fused_qkv == "grouped" and parts[0] == "self_attn.q_proj":
                pieces = _ungroup_qkv(
                    tensor,
                    config.num_heads,
                    config.qkv_groups or config.num_kv_heads,
                    config.num_kv_heads,
                    config.head_dim,
                )
            else:
                pieces = torch.split(tensor, list(sizes), dim=0)
            for part, piece in zip(parts, pieces):
                out[f"{prefix}{part}.{suffix}"] = piece
            continue
        out[f"{prefix}{renamed.get(stem, stem)}.{suffix}"] = tensor
    for (prefix, canonical), by_head in heads.items():
        if sorted(by_head) != list(range(len(by_head))):
            raise CheckpointError(
                f"{source}: {prefix}{canonical}: per-head tensors 0..{len(by_head) - 1} needed, "
                f"got heads {sorted(by_head)}"
            )
        out[prefix + canonical] = torch.stack([by_head[h] for h in range(len(by_head))])  # [heads, D]
    if experts and family.tensors.experts is not None:  # collected only where the family names experts
        out.update(_stack_experts(family.tensors.experts, experts, source))
    if family.tensors.experts_layout == "gpt_oss":
        out = {name: _gpt_oss_experts(name, t) for name, t in out.items()}
    return out


def _ungroup_qkv(
    tensor: torch.Tensor, num_heads: int, groups: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``[groups, G + 2, D]`` (per group: its ``G = heads / groups`` query heads, its key, its
    value) to q ``[heads * D]``, k and v ``[num_kv_heads * D]``. With one query head per group this is
    GPT-NeoX's ``view(..., heads, 3 * D)`` then ``chunk(3)``; where ``num_kv_heads`` exceeds ``groups``
    each group's key and value repeat for its query heads (Falcon's new decoder architecture
    broadcasts them so before caching)."""
    group = num_heads // groups
    rest = tensor.shape[1:]
    grouped = tensor.reshape(groups, group + 2, head_dim, *rest)
    q = grouped[:, :group].reshape(num_heads * head_dim, *rest)
    k, v = grouped[:, group], grouped[:, group + 1]  # [groups, D, ...]
    repeat = num_kv_heads // groups
    return (
        q,
        k.repeat_interleave(repeat, dim=0).reshape(num_kv_heads * head_dim, *rest),
        v.repeat_interleave(repeat, dim=0).reshape(num_kv_heads * head_dim, *rest),
    )


def _renamed_prefix(family: Family, name: str) -> str:
    for old, new in family.tensors.prefixes.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _gpt_oss_experts(name: str, t: torch.Tensor) -> torch.Tensor:
    """gpt_oss's stored expert tensors in the canonical layout: ``gate_up_proj [E, hidden, 2I]``
    (gate and up interleaved along the last dim) -> ``[E, 2I, hidden]`` gate rows then up rows;
    ``gate_up_proj_bias [E, 2I]`` de-interleaved the same way; ``down_proj [E, I, hidden]`` ->
    ``[E, hidden, I]``. Any other tensor (or one of another rank) is returned unchanged."""
    if name.endswith("mlp.experts.gate_up_proj") and t.dim() == 3:
        t = t.transpose(1, 2)
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()
    if name.endswith("mlp.experts.gate_up_proj_bias") and t.dim() == 2:
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()
    if name.endswith("mlp.experts.down_proj") and t.dim() == 3:
        return t.transpose(1, 2).contiguous()
    return t


def _stack_experts(spec: tuple[str, tuple[str, str, str]], experts: dict, source: str) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down ``[I, H]``/``[H, I]`` into ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``;
    ``spec``: the family's ``TensorNames.experts``."""
    module, names = spec
    gate_name, up_name, down_name = names
    out = {}
    for prefix in sorted({p for p, _ in experts}):
        parts = {name: experts.get((prefix, name), {}) for name in (gate_name, up_name, down_name)}
        count = len(parts[gate_name])
        if any(sorted(p) != list(range(count)) for p in parts.values()) or count == 0:
            raise CheckpointError(f"{source}: {prefix}{module}: experts 0..E-1 need each of {', '.join(names)}")
        try:
            out[prefix + "mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([parts[gate_name][e], parts[up_name][e]]) for e in range(count)]
            )
            out[prefix + "mlp.experts.down_proj"] = torch.stack([parts[down_name][e] for e in range(count)])
        except RuntimeError as exc:
            raise CheckpointError(f"{source}: {prefix}{module}: expert tensors do not fit: {exc}") from None
    return out


def _split_layer(name: str, layers_prefix: str) -> tuple[str | None, str]:
    """``("model.layers.3.", "self_attn.q_proj.weight")`` for a per-layer name under ``layers_prefix``
    (``gpt_neox.layers.3.attention.dense.weight`` -> ``model.layers.3.``), else ``(None, name)``."""
    if name.startswith(layers_prefix + "."):
        index, _, rest = name[len(layers_prefix) + 1 :].partition(".")
        if index.isdigit() and rest:
            return f"model.layers.{index}.", rest
    return None, name
