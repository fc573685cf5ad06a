"""Decoder descriptions as data: one :class:`Family` per transformers architecture.

Every supported architecture is a pre-norm (or post-norm, or sandwich-norm) decoder with RoPE
attention; what differs between them is data: the norm and where it sits, the MLP and its activation,
which projections carry biases and which config field says so, q/k norms, multipliers, softcaps, the
RoPE pairing layout, whether ``partial_rotary_factor`` is honoured, which layers rotate at all, how
sliding layers are derived, attention sinks, and the tensor names. ``ModelConfig.from_hf_config`` reads a config through its family, the float64 reference
decoder (``models/reference.py``) and the engine (``transformer.py``) both compute from the resulting
config and never look at the architecture name, and the loaders map tensor names through
:func:`canonical_weights`. Adding an architecture is a :class:`Family` entry, not a model file.

Each entry mirrors transformers' ``modeling_<name>.py`` (5.x); the comments name what the entry
encodes where it differs from llama. Architectures ropekv cannot model exactly yet are listed in
:data:`REFUSED` with the feature that stops them (docs/architectures.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

import torch

from ..errors import CheckpointError

NormKind = Literal["rms", "rms_offset", "layer", "layer_offset"]
MlpKind = Literal["gated", "plain"]
# q/k norms: per head or over the whole projection, before RoPE; "head_after_rope" (hunyuan) normalizes
# each rotated head, so the cached key is norm(R(j) k): not a rotation of any raw key.
QkNorm = Literal["none", "head", "projection", "head_after_rope"]
RopeLayers = Literal["all", "no_rope_layers", "sliding_only", "sliding_only_if_window"]
Layout = Literal["neox", "gptj"]
Flag = bool | str  # a constant, or the config.json field that decides it


@dataclass(frozen=True)
class Family:
    """How one transformers architecture computes, as data (see the module docstring).

    Norm slots name the tensors (under ``model.layers.{i}.``) of the norms around attention and MLP:
    ``attn_in`` normalizes the block input before attention, ``attn_out`` the attention output before
    the residual add (gemma2, olmo2), ``mlp_in``/``mlp_out`` likewise for the MLP. ``parallel``: one
    input norm feeds attention and MLP, both added to the residual (cohere).
    """

    name: str
    classes: tuple[str, ...]
    norm: NormKind = "rms"
    norm_bias: bool = False
    eps_key: str = "rms_norm_eps"
    eps_default: float | None = None  # None: the field is required
    attn_in: str | None = "input_layernorm"
    attn_out: str | None = None
    mlp_in: str | None = "post_attention_layernorm"
    mlp_out: str | None = None
    final_norm: str = "model.norm"
    parallel: bool = False
    mlp: MlpKind = "gated"
    act_key: str = "hidden_act"
    act_default: str = "silu"
    qkv_bias: Flag = False
    o_bias: Flag = False
    mlp_bias: Flag = False
    qk_norm: QkNorm = "none"
    layout: Layout = "neox"
    partial_rotary: bool = False  # does the architecture honour partial_rotary_factor?
    rope_layers: RopeLayers = "all"
    # How sliding layers are derived where config.json has no layer_types, as the architecture's config
    # class derives them (hf_config._layer_types): "none"/"layer_types" every layer full; "mistral" every
    # layer slides iff sliding_window; "qwen2" iff use_sliding_window and layer >= max_window_layers;
    # "qwen2_moe" iff use_sliding_window, layer < max_window_layers and layer even; "qwen3_moe" every
    # layer iff use_sliding_window (its modeling never reads layer_types); "period": layer i slides iff
    # (i + 1) % P != 0, P = config[window_period_key] (or window_period where absent); "smollm3" iff
    # use_sliding_window and the layer is NoPE.
    windows: Literal["none", "mistral", "qwen2", "qwen2_moe", "qwen3_moe", "layer_types", "period",
                     "smollm3"] = "layer_types"
    window_period: int = 2
    window_period_key: str | None = None  # the config field holding the period, where it is configurable
    moe: Literal["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "gpt_oss"] | None = None  # models/moe.py
    # gpt_oss: a learned logit per query head (``self_attn.sinks [H]``) joins every softmax denominator
    # and is dropped after it: attention weights sum to less than 1. Weights, not cache contents.
    sinks: bool = False
    # hunyuan: a "dynamic" RoPE with a non-zero ``alpha`` is a fixed NTK base, theta * alpha ** (d / (d - 2)),
    # not dynamic NTK (HunYuanDenseV1RotaryEmbedding's ntk_alpha); hf_config._ntk_alpha reads it.
    ntk_alpha: bool = False
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
    names: Mapping[str, str] = field(default_factory=dict)  # canonical -> checkpoint module name, per layer
    aliases: Mapping[str, str] = field(default_factory=dict)  # checkpoint tensor name -> canonical, per layer
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # fused tensor -> canonical parts
    # Per-expert tensors as saved on disk: (module holding experts 0..E-1, (gate, up, down) names),
    # stacked into the canonical experts.gate_up_proj / experts.down_proj (models/moe.py).
    experts: tuple[str, tuple[str, str, str]] | None = None
    # Stacked expert tensors as stored: "rows" is the canonical [E, 2I, hidden] gate-then-up /
    # [E, hidden, I]; "gpt_oss" stores them transposed ([E, hidden, 2I] / [E, I, hidden]) with gate and
    # up interleaved (gate = [..., 0::2], up = [..., 1::2]), biases likewise interleaved.
    experts_layout: Literal["rows", "gpt_oss"] = "rows"


_LLAMA_BIAS = dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM",), **_LLAMA_BIAS),
    # Mistral's attention has no bias at all: attention_bias in its config is ignored.
    Family("mistral", ("MistralForCausalLM",), windows="mistral", ignored_fields=("attention_bias",),
           defaults={"sliding_window": 4096}),
    Family("ministral", ("MinistralForCausalLM",), ignored_fields=("attention_bias",), windows="mistral",
           defaults={"sliding_window": 4096}),
    Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True, windows="qwen2", defaults={"max_window_layers": 28}),
    Family("qwen3", ("Qwen3ForCausalLM",), qkv_bias="attention_bias", o_bias="attention_bias", qk_norm="head",
           windows="qwen2", defaults={"max_window_layers": 28}),
    Family("helium", ("HeliumForCausalLM",), layout="gptj", qkv_bias="attention_bias", mlp_bias="mlp_bias",
           defaults={"rope_theta": 100000.0}),
    Family("seed_oss", ("SeedOssForCausalLM",), qkv_bias="attention_bias", o_bias="attention_out_bias",
           mlp_bias="mlp_bias",
           defaults={"attention_bias": True}),
    Family("smollm3", ("SmolLM3ForCausalLM",), rope_layers="no_rope_layers", windows="smollm3", **_LLAMA_BIAS,
           defaults={"tie_word_embeddings": True, "rope_theta": 2000000.0}),
    # ERNIE 4.5: GLM's interleaved rotate_half over the whole head; one use_bias for every linear.
    Family("ernie4_5", ("Ernie4_5ForCausalLM",), layout="gptj", qkv_bias="use_bias", o_bias="use_bias",
           mlp_bias="use_bias",
           defaults={"tie_word_embeddings": True, "rope_theta": 500000.0}),
    # Arcee: llama with a non-gated ReLU^2 MLP (up_proj, down_proj).
    Family("arcee", ("ArceeForCausalLM",), mlp="plain", act_default="relu2", **_LLAMA_BIAS),
    Family("granite", ("GraniteForCausalLM",), embedding_scale="embedding_multiplier",
           residual_scale_key="residual_multiplier", attn_scale_key="attention_multiplier",
           logits_divide_key="logits_scaling", **_LLAMA_BIAS,
           defaults={"attention_multiplier": 1.0}),  # the scale itself: 1.0 when omitted
    # Gemma: RMSNorm times (1 + weight), embeddings times sqrt(hidden_size), GELU (tanh).
    Family("gemma", ("GemmaForCausalLM",), norm="rms_offset", embedding_scale="sqrt_hidden",
           act_default="gelu_pytorch_tanh", qkv_bias="attention_bias", o_bias="attention_bias",
           defaults={"tie_word_embeddings": True}),
    Family("gemma2", ("Gemma2ForCausalLM",), norm="rms_offset", embedding_scale="sqrt_hidden",
           act_key="hidden_activation", act_default="gelu_pytorch_tanh", attn_out="post_attention_layernorm",
           mlp_in="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm",
           qkv_bias="attention_bias", o_bias="attention_bias", query_pre_attn_scalar=True,
           attn_softcap_key="attn_logit_softcapping", final_softcap_key="final_logit_softcapping", windows="period",
           defaults={"tie_word_embeddings": True, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                     "final_logit_softcapping": 30.0, "sliding_window": 4096}),
    Family("gemma3_text", ("Gemma3ForCausalLM",), norm="rms_offset", embedding_scale="sqrt_hidden",
           act_key="hidden_activation", act_default="gelu_pytorch_tanh", attn_out="post_attention_layernorm",
           mlp_in="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm", qk_norm="head",
           qkv_bias="attention_bias", o_bias="attention_bias", query_pre_attn_scalar=True,
           attn_softcap_key="attn_logit_softcapping", final_softcap_key="final_logit_softcapping",
           windows="period", window_period=6, window_period_key="sliding_window_pattern",
           defaults={"tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
    # OLMo 2/3: post-norm only (on attention and MLP outputs); q/k norms over the whole projection.
    Family("olmo2", ("Olmo2ForCausalLM",), attn_in=None, attn_out="post_attention_layernorm", mlp_in=None,
           mlp_out="post_feedforward_layernorm", qk_norm="projection", qkv_bias="attention_bias",
           o_bias="attention_bias"),
    Family("olmo3", ("Olmo3ForCausalLM",), attn_in=None, attn_out="post_attention_layernorm", mlp_in=None,
           mlp_out="post_feedforward_layernorm", qk_norm="projection", qkv_bias="attention_bias",
           o_bias="attention_bias", windows="period", window_period=4,
           defaults={"sliding_window": 4096, "rope_theta": 500000.0}),
    # EXAONE 4: olmo2's post-norms, per-head q/k norms, and NoPE on full layers of a hybrid model.
    Family("exaone4", ("Exaone4ForCausalLM",), attn_in=None, attn_out="post_attention_layernorm", mlp_in=None,
           mlp_out="post_feedforward_layernorm", qk_norm="head", rope_layers="sliding_only_if_window",
           windows="period", window_period=4, window_period_key="sliding_window_pattern",
           defaults={"sliding_window": 4096}),
    # Cohere: mean-centred LayerNorm without bias, parallel attention + MLP, interleaved RoPE,
    # logits times logit_scale.
    Family("cohere", ("CohereForCausalLM",), norm="layer", eps_key="layer_norm_eps", mlp_in=None, parallel=True,
           layout="gptj", qkv_bias="attention_bias", o_bias="attention_bias", logits_multiply_key="logit_scale",
           defaults={"tie_word_embeddings": True, "logit_scale": 0.0625, "rope_theta": 500000.0}),
    Family("cohere2", ("Cohere2ForCausalLM",), norm="layer", eps_key="layer_norm_eps", mlp_in=None, parallel=True,
           layout="gptj", qkv_bias="attention_bias", o_bias="attention_bias", logits_multiply_key="logit_scale",
           rope_layers="sliding_only", windows="period", window_period=4, window_period_key="sliding_window_pattern",
           defaults={"tie_word_embeddings": True, "logit_scale": 0.0625, "sliding_window": 4096}),
    # StarCoder2: LayerNorm with bias, plain GELU MLP c_fc/c_proj, one use_bias for every linear.
    Family("starcoder2", ("Starcoder2ForCausalLM",), norm="layer", norm_bias=True, eps_key="norm_epsilon",
           mlp="plain", act_default="gelu_pytorch_tanh", qkv_bias="use_bias", o_bias="use_bias",
           mlp_bias="use_bias", windows="mistral",
           names={"mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"},
           defaults={"tie_word_embeddings": True, "use_bias": True}),
    Family("stablelm", ("StableLmForCausalLM",), norm="layer", norm_bias=True, eps_key="layer_norm_eps",
           qkv_bias="use_qkv_bias", partial_rotary=True,
           defaults={"partial_rotary_factor": 0.25}),
    # Nemotron: LayerNorm with (1 + weight) and bias, ReLU^2 up/down MLP, partial rotary.
    Family("nemotron", ("NemotronForCausalLM",), norm="layer_offset", norm_bias=True, eps_key="norm_eps",
           mlp="plain", act_default="relu2", qkv_bias="attention_bias", o_bias="attention_bias",
           mlp_bias="mlp_bias", partial_rotary=True,
           defaults={"partial_rotary_factor": 0.5}),
    # GLM / GLM-4: interleaved partial rotary, fused gate_up_proj; GLM-4 adds sandwich norms.
    Family("glm", ("GlmForCausalLM",), layout="gptj", partial_rotary=True, qkv_bias="attention_bias",
           fused={"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
           defaults={"attention_bias": True, "partial_rotary_factor": 0.5}),
    Family("glm4", ("Glm4ForCausalLM",), layout="gptj", partial_rotary=True, qkv_bias="attention_bias",
           attn_out="post_self_attn_layernorm", mlp_out="post_mlp_layernorm",
           fused={"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
           defaults={"attention_bias": True, "partial_rotary_factor": 0.5}),
    # HunYuan dense: llama with per-head q/k RMSNorm applied after RoPE (query_layernorm/key_layernorm)
    # and its NTK-alpha RoPE (hf_config._hunyuan_rope); no sliding layers.
    Family("hunyuan_v1_dense", ("HunYuanDenseV1ForCausalLM",), qkv_bias="attention_bias", o_bias="attention_bias",
           qk_norm="head_after_rope", windows="none", ntk_alpha=True,
           names={"self_attn.q_norm": "self_attn.query_layernorm", "self_attn.k_norm": "self_attn.key_layernorm"}),
    # Phi-3: fused qkv_proj and gate_up_proj, partial rotary, LongRoPE.
    Family("phi3", ("Phi3ForCausalLM",), partial_rotary=True, windows="mistral",
           fused={"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}),
)}

FAMILIES.update({f.name: f for f in (
    # Mixture-of-experts MLPs (models/moe.py); attention as in their dense relatives.
    Family("mixtral", ("MixtralForCausalLM",), moe="mixtral", windows="mistral",
           aliases={"block_sparse_moe.gate.weight": "mlp.gate.weight"},
           experts=("block_sparse_moe.experts", ("w1", "w3", "w2")),
           defaults={"rope_theta": 1000000.0}),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), moe="qwen2_moe", qkv_bias="qkv_bias", windows="qwen2_moe",
           experts=("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
           defaults={"qkv_bias": True, "max_window_layers": 28}),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), moe="qwen3_moe", qkv_bias="attention_bias",
           o_bias="attention_bias", qk_norm="head", windows="qwen3_moe",
           experts=("mlp.experts", ("gate_proj", "up_proj", "down_proj"))),
    Family("granitemoe", ("GraniteMoeForCausalLM",), moe="granitemoe", embedding_scale="embedding_multiplier",
           residual_scale_key="residual_multiplier", attn_scale_key="attention_multiplier",
           logits_divide_key="logits_scaling", qkv_bias="attention_bias", o_bias="attention_bias",
           defaults={"attention_multiplier": 1.0},
           aliases={"block_sparse_moe.router.weight": "mlp.gate.weight",
                    "block_sparse_moe.router.layer.weight": "mlp.gate.weight",
                    "block_sparse_moe.experts.gate_up_proj": "mlp.experts.gate_up_proj",
                    "block_sparse_moe.experts.down_proj": "mlp.experts.down_proj",
                    "block_sparse_moe.input_linear.weight": "mlp.experts.gate_up_proj",
                    "block_sparse_moe.output_linear.weight": "mlp.experts.down_proj"}),
    # gpt-oss: attention sinks, every-other sliding layers, yarn, biases everywhere in attention, and
    # a biased top-k-softmax MoE with the clamped SwiGLU (models/moe.py) on every layer.
    Family("gpt_oss", ("GptOssForCausalLM",), qkv_bias="attention_bias", o_bias="attention_bias", sinks=True,
           moe="gpt_oss", windows="period", window_period=2, experts_layout="gpt_oss",
           aliases={"mlp.router.weight": "mlp.gate.weight", "mlp.router.bias": "mlp.gate.bias"},
           defaults={"attention_bias": True, "sliding_window": 128, "rope_theta": 150000.0,
                     "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5,
                     "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096}}),
)})

# Architectures ropekv refuses, with the feature that is not modelled yet (docs/architectures.md).
REFUSED: dict[str, str] = {
    "glm4_moe": "mixture-of-experts MLP with grouped routing",
    "olmo": "non-parametric LayerNorm and clip_qkv",
    "gpt_neox": "fused per-head interleaved query_key_value and parallel residual",
    "phi": "parallel attention/MLP with a dense output and biased lm_head",
    "persimmon": "fused per-head query_key_value and per-head LayerNorm q/k norms",
    "gptj": "parallel block with interleaved partial rotary over fused-free GPT-J names (not described)",
    "falcon": "fused multi-query query_key_value and alibi/rotary switch",
    "apertus": "xIELU activation with learned parameters",
    "llama4_text": "chunked attention, mixture of experts, L2 q/k norm and attention temperature tuning",
    "deepseek_v2": "multi-head latent attention (MLA): RoPE on a decoupled qk_rope_head_dim part",
    "deepseek_v3": "multi-head latent attention (MLA): RoPE on a decoupled qk_rope_head_dim part",
    "qwen2_vl": "multimodal RoPE (mrope_section position streams)",
}

_CLASS_TO_FAMILY = {c: f.name for f in FAMILIES.values() for c in f.classes}


def family_of(architectures: list, model_type: str | None) -> str | None:
    """The family named by a config's ``architectures`` entries or ``model_type``; None if unknown."""
    for a in architectures:
        if isinstance(a, str) and a in _CLASS_TO_FAMILY:
            return _CLASS_TO_FAMILY[a]
    return model_type if isinstance(model_type, str) and model_type in FAMILIES else None


def layer_tensor_names(family: Family, canonical: str) -> str:
    """The checkpoint name (under ``model.layers.{i}.``) of a canonical per-layer tensor name."""
    stem, _, suffix = canonical.rpartition(".")
    return family.names.get(stem, stem) + "." + suffix


def canonical_weights(family: Family, num_layers: int, weights: Mapping[str, torch.Tensor],
                      split_sizes: Mapping[str, tuple[int, ...]], source: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under ropekv's canonical (llama-style) names: renamed per ``family.names``
    and ``family.aliases``, fused tensors split into their parts (``split_sizes[fused]`` rows each, in
    order), per-expert tensors stacked. Works on a saved checkpoint and on a live transformers
    ``state_dict`` (which may already hold the stacked expert layout).

    Unknown names pass through unchanged, so :func:`~ropekv.models.config.validate_weights` still
    names them as unexpected."""
    renamed = {family.names[stem]: stem for stem in family.names}
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer prefix, part) -> expert -> tensor
    for name, tensor in weights.items():
        prefix, rest = _split_layer(name)
        if prefix is None:
            out[name] = tensor
            continue
        if rest in family.aliases:
            out[prefix + family.aliases[rest]] = tensor
            continue
        if family.experts is not None and rest.startswith(family.experts[0] + "."):
            index, _, part = rest[len(family.experts[0]) + 1:].partition(".")
            if index.isdigit() and part.endswith(".weight") and part[:-7] in family.experts[1]:
                experts.setdefault((prefix, part[:-7]), {})[int(index)] = tensor
                continue
        stem, _, suffix = rest.rpartition(".")
        if stem in family.fused:
            parts, sizes = family.fused[stem], split_sizes[stem]
            if tensor.shape[0] != sum(sizes):
                raise CheckpointError(f"{source}: tensor {name} has {tensor.shape[0]} rows, "
                                      f"{' + '.join(map(str, sizes))} needed for {', '.join(parts)}")
            for part, piece in zip(parts, torch.split(tensor, list(sizes), dim=0)):
                out[f"{prefix}{part}.{suffix}"] = piece
            continue
        out[f"{prefix}{renamed.get(stem, stem)}.{suffix}"] = tensor
    if experts:
        out.update(_stack_experts(family, experts, source))
    if family.experts_layout == "gpt_oss":
        out = {name: _gpt_oss_experts(name, t) for name, t in out.items()}
    return out


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


def _stack_experts(family: Family, experts: dict, source: str) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down ``[I, H]``/``[H, I]`` into ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""
    gate_name, up_name, down_name = family.experts[1]
    out = {}
    for prefix in sorted({p for p, _ in experts}):
        parts = {name: experts.get((prefix, name), {}) for name in (gate_name, up_name, down_name)}
        count = len(parts[gate_name])
        if any(sorted(p) != list(range(count)) for p in parts.values()) or count == 0:
            raise CheckpointError(f"{source}: {prefix}{family.experts[0]}: experts 0..E-1 need each of "
                                  f"{', '.join(family.experts[1])}")
        try:
            out[prefix + "mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([parts[gate_name][e], parts[up_name][e]]) for e in range(count)])
            out[prefix + "mlp.experts.down_proj"] = torch.stack([parts[down_name][e] for e in range(count)])
        except RuntimeError as exc:
            raise CheckpointError(f"{source}: {prefix}{family.experts[0]}: expert tensors do not fit: {exc}") from None
    return out


def _split_layer(name: str) -> tuple[str | None, str]:
    """``("model.layers.3.", "self_attn.q_proj.weight")`` for a per-layer name, else ``(None, name)``."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return ".".join(parts[:3]) + ".", ".".join(parts[3:])
    return None, name
