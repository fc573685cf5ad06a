"""The model description shared by the loaders, the reference decoder and the engine.

A :class:`Checkpoint` is a validated :class:`ModelConfig` plus float tensors named as in transformers
(``model.layers.{i}.self_attn.q_proj.weight`` ...). Nothing here knows about caches.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..attention_kind import AttentionKindName, LayerAttention
from ..errors import CheckpointError, ConfigError
from ..numbers import is_finite_number, is_int, is_real
from ..rope import RopeSpec
from .families import FAMILIES, Family, canonical_weights
from .limits import MODEL_INT_BOUNDS, bound_text, shown
from .mla import MlaSpec
from .moe import MoeSpec
from .weights import non_finite, weights_digest, weights_fingerprint_of

ARCHITECTURES = tuple(FAMILIES)
# transformers' layer_types strings, kept as the config's per-layer record (its to_dict and so its
# fingerprint hold them), and the attention kind each one names (:class:`LayerAttention`).
ATTENTION_KIND_OF_LAYER_TYPE: dict[str, AttentionKindName] = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
}
LAYER_TYPES = tuple(ATTENTION_KIND_OF_LAYER_TYPE)
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "relu2", "xielu")
# xIELU's learned parameters, per layer under model.layers.{i}.mlp.act_fn. (apertus): shape of each
XIELU_PARAMS = {"alpha_p": (1,), "alpha_n": (1,), "beta": (), "eps": ()}

# ModelConfig fields left out of its config fingerprint: the cache contract compares RoPE (by what it
# computes: max_position_embeddings only under dynamic NTK), windows, chunks and sizes as fields of their
# own, and ``name`` is a label (transformers fills it from the path a model was loaded from).
CONTRACT_COMPARED = frozenset(
    (
        "name",
        "max_position_embeddings",
        "rope",
        "layer_ropes",
        "sliding_window",
        "layer_types",
        "attention_chunk_size",
        "num_layers",
        "num_kv_heads",
        "head_dim",
    )
)
# ModelConfig fields whose config.json name differs (for error messages).
_HF_FIELD_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
}
# Fields added with the architecture descriptions: left out of to_dict (and so of fingerprints) at
# their defaults, so configs of the original four families keep their fingerprints.
_LATER_FIELDS = {
    "hidden_act": "silu",
    "layer_ropes": None,
    "query_scale": None,
    "attn_softcap": None,
    "final_softcap": None,
    "embedding_scale": 1.0,
    "residual_scale": 1.0,
    "logits_scale": 1.0,
    "moe": None,
    "mla": None,
    "parallel": False,
    "clip_qkv": None,
    "parallel_mlp_norm": False,
    "qkv_groups": None,
    "attention_chunk_size": None,
    "temperature_floor_scale": None,
    "temperature_attn_scale": 0.0,
    "attention_sinks": False,
}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only RoPE transformer in the terms ropekv needs; ``family`` says how it computes.

    ``layer_types[i]`` is ``"sliding_attention"`` for layers that see only the last ``sliding_window``
    keys (HF semantics: key ``j`` visible to query ``i`` iff ``i - W < j <= i``), ``"chunked_attention"``
    for layers that see only the keys of their own chunk of ``attention_chunk_size`` positions. ``layer_ropes[i]``
    is layer ``i``'s :class:`RopeSpec`, or None for a layer without position embedding (NoPE);
    empty means ``rope`` on every layer. ``rms_norm_eps`` is the epsilon of every norm, whatever the
    norm kind. ``warnings`` name config fields the architecture's reference implementation ignores.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v projections
    o_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # q/k norms (per head or over the projection, before RoPE or after: family.block.qk_norm)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    name: str = ""
    hidden_act: str = "silu"
    layer_ropes: tuple[RopeSpec | None, ...] | None = None
    query_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    embedding_scale: float = 1.0
    residual_scale: float = 1.0  # multiplies attention and MLP outputs before the residual add
    logits_scale: float = 1.0
    moe: MoeSpec | None = None  # mixture-of-experts MLP on moe.sparse_layers (models/moe.py)
    mla: MlaSpec | None = None  # multi-head latent attention (models/mla.py): head_dim is the key's, nope + rope
    parallel: bool = False  # attention and MLP both read the block input (family.reading.parallel)
    clip_qkv: float | None = None  # q, k, v clamped to [-clip_qkv, clip_qkv] after their projections
    parallel_mlp_norm: bool = False  # a parallel block's MLP reads the input through its own norm (mlp_in)
    # KV groups of a grouped fused qkv where fewer than num_kv_heads (Falcon's new decoder
    # architecture: each group's key/value serves, and is cached for, each of its query heads)
    qkv_groups: int | None = None
    attention_chunk_size: int | None = None  # chunked_attention layers: keys of the query's own chunk only
    # llama4's attention temperature tuning on NoPE layers: queries times
    # log1p(floor((position + 1) / floor_scale)) * attn_scale + 1; None: no tuning
    temperature_floor_scale: float | None = None
    temperature_attn_scale: float = 0.0
    # A learned logit per query head (self_attn.sinks [H]) in every layer's softmax denominator (gpt_oss).
    attention_sinks: bool = False
    warnings: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        for f, high in MODEL_INT_BOUNDS.items():
            v = getattr(self, f)
            if v is None and f in ("sliding_window", "attention_chunk_size", "qkv_groups"):
                continue  # optional: checked below where a layer needs it
            hf = f" ({_HF_FIELD_NAMES[f]} in config.json)" if f in _HF_FIELD_NAMES else ""
            if not is_int(v) or v < 1:
                raise ConfigError(f"config field {f!r}{hf} must be a positive integer, got {shown(v)}")
            if v > high:
                raise ConfigError(f"config field {f!r}{hf} = {shown(v)} is implausible (at most {bound_text(high)})")
        eps = self.rms_norm_eps
        if not is_real(eps) or not is_finite_number(eps) or eps < 0:
            raise ConfigError(f"config field 'rms_norm_eps' must be a finite number >= 0, got {eps!r}")
        if not isinstance(self.rope, RopeSpec):
            raise ConfigError(f"config field 'rope' must be a RopeSpec, got {type(self.rope).__name__}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rope.head_dim != self.head_dim:
            raise ConfigError(f"RoPE head_dim {self.rope.head_dim} != model head_dim {self.head_dim}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) or self.sliding_window < 1
        ):
            raise ConfigError(f"sliding_window must be an integer >= 1, got {self.sliding_window!r}")
        if not isinstance(self.layer_types, tuple):
            raise ConfigError(f"layer_types must be a tuple, got {type(self.layer_types).__name__}")
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = [t for t in self.layer_types if not isinstance(t, str) or t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"unknown layer type(s) {bad[:5]}; supported: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError("sliding_attention layers need a sliding_window")
        c = self.attention_chunk_size
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
            raise ConfigError(f"attention_chunk_size must be an integer >= 1, got {c!r}")
        if "chunked_attention" in self.layer_types and c is None:
            raise ConfigError("chunked_attention layers need an attention_chunk_size")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"activation {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if self.hidden_act == "xielu" and (self.family.block.mlp != "plain" or self.moe is not None):
            raise ConfigError("the xielu activation is modelled on a plain dense MLP only (apertus)")
        if self.layer_ropes is not None:
            if not isinstance(self.layer_ropes, tuple) or len(self.layer_ropes) != self.num_layers:
                raise ConfigError(f"layer_ropes must be a tuple of {self.num_layers} RopeSpec or None entries")
            for spec in self.layer_ropes:
                if spec is not None and (not isinstance(spec, RopeSpec) or spec.head_dim != self.head_dim):
                    raise ConfigError(
                        f"layer_ropes entries must be RopeSpecs over head_dim {self.head_dim}, got {spec!r}"
                    )
            if all(spec == self.rope for spec in self.layer_ropes):
                object.__setattr__(self, "layer_ropes", None)  # normalize: one RoPE for every layer
        for name in ("query_scale", "attn_softcap", "final_softcap", "clip_qkv"):
            value = getattr(self, name)
            if value is not None and not (is_real(value) and is_finite_number(value) and value > 0):
                raise ConfigError(f"config field {name!r} must be a finite number > 0 or null, got {value!r}")
        if self.qkv_groups is not None and (
            not isinstance(self.qkv_groups, int)
            or isinstance(self.qkv_groups, bool)
            or self.qkv_groups < 1
            or self.num_kv_heads % self.qkv_groups
            or self.num_heads % self.qkv_groups
        ):
            raise ConfigError(
                f"qkv_groups must divide num_kv_heads ({self.num_kv_heads}) and num_heads, got {self.qkv_groups!r}"
            )
        if not isinstance(self.attention_sinks, bool):
            raise ConfigError(f"config field 'attention_sinks' must be true or false, got {self.attention_sinks!r}")
        if self.moe is not None and not isinstance(self.moe, MoeSpec):
            raise ConfigError(f"config field 'moe' must be a MoeSpec or None, got {type(self.moe).__name__}")
        t = self.temperature_floor_scale
        if t is not None and not (is_real(t) and is_finite_number(t) and t > 0):
            raise ConfigError(f"config field 'temperature_floor_scale' must be a finite number > 0 or null, got {t!r}")
        for name in ("embedding_scale", "residual_scale", "logits_scale", "temperature_attn_scale"):
            value = getattr(self, name)
            if not (is_real(value) and is_finite_number(value)):
                raise ConfigError(f"config field {name!r} must be a finite number, got {value!r}")
        if self.mla is not None:
            self._check_mla()

    def _check_mla(self) -> None:
        """An MLA config's key is ``[k_nope, k_pe]`` per head, one head per query head, and every
        layer's RoPE turns exactly the trailing rope part."""
        m = self.mla
        if not isinstance(m, MlaSpec):
            raise ConfigError(f"config field 'mla' must be an MlaSpec or None, got {type(m).__name__}")
        if self.head_dim != m.qk_head_dim or self.num_kv_heads != self.num_heads:
            raise ConfigError(
                f"MLA config needs head_dim = qk_nope_head_dim + qk_rope_head_dim = {m.qk_head_dim} and "
                f"num_kv_heads = num_heads, got {self.head_dim} and {self.num_kv_heads}/{self.num_heads}"
            )
        for i in range(self.num_layers):
            r = self.layer_rope(i)
            if r is None or r.rotary_offset != m.qk_nope_head_dim or r.rotary_dim != m.qk_rope_head_dim:
                raise ConfigError(
                    f"MLA layer {i} must rotate exactly its rope part (channels {m.qk_nope_head_dim}.."
                    f"{m.qk_head_dim - 1}), got {r!r}"
                )

    @property
    def family(self) -> Family:
        """How this architecture computes (norms, MLP, names, ...): :mod:`ropekv.models.families`."""
        return FAMILIES[self.architecture]

    @property
    def norm_slots(self) -> tuple[str | None, str | None, str | None, str | None]:
        """The norms around attention and MLP, ``(attn_in, attn_out, mlp_in, mlp_out)`` (tensor names
        under ``model.layers.{i}.``; None: no norm there). In a parallel block ``mlp_in`` is the
        MLP's own norm of the block input (``parallel_mlp_norm``), None where it shares ``attn_in``."""
        fam = self.family
        mlp_in = (fam.block.mlp_in if self.parallel_mlp_norm else None) if self.parallel else fam.block.mlp_in
        return fam.block.attn_in, fam.block.attn_out, mlp_in, fam.block.mlp_out

    @property
    def attn_scale(self) -> float:
        """The factor on ``q . k`` before softmax: ``query_scale``, else ``head_dim ** -0.5``."""
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @property
    def position_limit(self) -> int:
        """Positions the model can be run at: ``max_position_embeddings``, except that dynamic NTK
        exists to go past it (up to ``factor`` times, as it was tuned for)."""
        if self.rope.scaling.rope_type == "dynamic":
            base = max(self.max_position_embeddings, self.rope.max_position_embeddings)
            factor = self.rope.scaling.factor
            assert factor is not None  # dynamic NTK requires it (RopeScaling)
            return int(base * max(1.0, factor))
        return self.max_position_embeddings

    def layer_attention(self, layer: int) -> LayerAttention:
        """Which keys ``layer``'s queries see: its layer type with its window or chunk size."""
        kind = ATTENTION_KIND_OF_LAYER_TYPE[self.layer_types[layer]]
        size = {"full": None, "sliding": self.sliding_window, "chunked": self.attention_chunk_size}[kind]
        return LayerAttention(kind, size)

    @property
    def layer_attentions(self) -> tuple[LayerAttention, ...]:
        """:meth:`layer_attention` of every layer."""
        return tuple(self.layer_attention(i) for i in range(self.num_layers))

    def layer_window(self, layer: int) -> int | None:
        """The window of ``layer``, or None for full attention."""
        return self.layer_attention(layer).window

    def layer_chunk(self, layer: int) -> int | None:
        """The chunk size of ``layer`` (a query at ``p`` sees keys at ``[floor(p/C)*C, p]``), or None."""
        return self.layer_attention(layer).chunk

    def layer_temperature(self, layer: int) -> bool:
        """Whether ``layer``'s queries are scaled by llama4's position-dependent temperature (NoPE layers)."""
        return self.temperature_floor_scale is not None and self.layer_rope(layer) is None

    def layer_qk_norm(self, layer: int) -> bool:
        """Whether ``layer`` normalizes q and k (llama4's L2 norm only on layers that rotate)."""
        return self.qk_norm and (self.family.block.qk_norm != "l2" or self.layer_rope(layer) is not None)

    def layer_moe(self, layer: int) -> MoeSpec | None:
        """The MoE MLP of ``layer``, or None where the layer's MLP is dense."""
        return self.moe if self.moe is not None and layer in self.moe.sparse_layers else None

    def layer_rope(self, layer: int) -> RopeSpec | None:
        """Layer ``layer``'s RoPE, or None for a NoPE layer."""
        return self.rope if self.layer_ropes is None else self.layer_ropes[layer]

    @property
    def uniform_rope(self) -> bool:
        """True when every layer rotates with ``rope`` (no NoPE layer, no per-layer-type RoPE)."""
        return self.layer_ropes is None

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "warnings"}
        d["rope"] = self.rope.to_dict()
        d["layer_types"] = list(self.layer_types)
        if self.layer_ropes is not None:
            d["layer_ropes"] = [None if s is None else s.to_dict() for s in self.layer_ropes]
        if self.moe is not None:
            d["moe"] = self.moe.to_dict()
        if self.mla is not None:
            d["mla"] = self.mla.to_dict()
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d

    def config_fingerprint(self) -> str:
        """A short hash of what this config computes outside the fields a cache contract compares on
        its own (:data:`CONTRACT_COMPARED`): head counts, norms, activations, scales, MoE, MLA. Two
        configs that differ only there (another ``max_position_embeddings`` or RoPE spelling, another
        name) get one fingerprint."""
        semantics = {k: v for k, v in self.to_dict().items() if k not in CONTRACT_COMPARED}
        blob = json.dumps(semantics, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of this config must hold, with its shape, under ropekv's canonical
        names (transformers' llama names; :func:`~ropekv.models.families.canonical_weights` maps others)."""
        fam = self.family
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        final = fam.block.final_norm
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        norm_tensors: tuple[str, ...] = (".weight", ".bias") if fam.block.norm_bias else (".weight",)
        if fam.block.norm == "layer_plain":  # no tensors
            norm_tensors = ()
        shapes.update({final + t: (h,) for t in norm_tensors})
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        if fam.block.lm_head_bias:
            shapes["lm_head.bias"] = (self.vocab_size,)
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            for norm in self.norm_slots:
                if norm is not None:
                    shapes.update({p + norm + t: (h,) for t in norm_tensors})
            if self.mla is not None:
                shapes.update(self._mla_shapes(self.mla, p))
            else:
                shapes.update(
                    {
                        p + "self_attn.q_proj.weight": (q, h),
                        p + "self_attn.k_proj.weight": (kv, h),
                        p + "self_attn.v_proj.weight": (kv, h),
                        p + "self_attn.o_proj.weight": (h, q),
                    }
                )
            moe = self.layer_moe(n)
            if moe is not None:
                e, m = moe.num_experts, moe.expert_size
                shapes.update(
                    {
                        p + "mlp.gate.weight": (e, h),
                        p + "mlp.experts.gate_up_proj": (e, 2 * m, h),
                        p + "mlp.experts.down_proj": (e, h, m),
                    }
                )
                if moe.bias:
                    shapes.update(
                        {
                            p + "mlp.gate.bias": (e,),
                            p + "mlp.experts.gate_up_proj_bias": (e, 2 * m),
                            p + "mlp.experts.down_proj_bias": (e, h),
                        }
                    )
                if moe.shared_expert_size is not None:
                    s = moe.shared_expert_size
                    shapes.update(
                        {
                            p + "mlp.shared_expert.gate_proj.weight": (s, h),
                            p + "mlp.shared_expert.up_proj.weight": (s, h),
                            p + "mlp.shared_expert.down_proj.weight": (h, s),
                        }
                    )
                    if moe.shared_expert_gated:
                        shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
                if moe.shared_experts_size is not None:
                    s = moe.shared_experts_size
                    for part, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
                        shapes[p + f"mlp.shared_experts.{part}.weight"] = shape
                        if self.mlp_bias:
                            shapes[p + f"mlp.shared_experts.{part}.bias"] = shape[:1]
                if moe.correction_bias:
                    shapes[p + "mlp.gate.e_score_correction_bias"] = (e,)
            else:
                shapes.update({p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)})
                if self.hidden_act == "xielu":
                    shapes.update({p + "mlp.act_fn." + n: shape for n, shape in XIELU_PARAMS.items()})
            if fam.block.mlp == "gated" and moe is None:
                shapes[p + "mlp.gate_proj.weight"] = (i, h)
            if self.attention_bias and self.mla is None:
                shapes.update(
                    {
                        p + "self_attn.q_proj.bias": (q,),
                        p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,),
                    }
                )
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)  # MLA: attention_bias too
            if self.mlp_bias and moe is None:
                shapes.update({p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (h,)})
                if fam.block.mlp == "gated":
                    shapes[p + "mlp.gate_proj.bias"] = (i,)
            if self.attention_sinks:
                shapes[p + "self_attn.sinks"] = (self.num_heads,)
            if self.qk_norm and fam.block.qk_norm != "l2":  # llama4's L2 norm has no weights
                qn, kn = {
                    "head": ((d,), (d,)),
                    "head_after_rope": ((d,), (d,)),
                    "per_head": ((self.num_heads, d), (self.num_kv_heads, d)),
                    "projection": ((q,), (kv,)),
                }[fam.block.qk_norm]
                shapes.update({p + "self_attn.q_norm.weight": qn, p + "self_attn.k_norm.weight": kn})
                if fam.block.qk_norm_bias:
                    shapes.update({p + "self_attn.q_norm.bias": qn, p + "self_attn.k_norm.bias": kn})
        return shapes

    def _mla_shapes(self, m: MlaSpec, p: str) -> dict[str, tuple[int, ...]]:
        """MLA's attention tensors under ``p`` (models/mla.py); ``attention_bias`` biases q_a_proj,
        kv_a_proj_with_mqa and o_proj."""
        h, a = self.hidden_size, p + "self_attn."
        heads = self.num_heads
        shapes: dict[str, tuple[int, ...]] = {
            a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
            a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
            a + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            a + "o_proj.weight": (h, heads * m.v_head_dim),
        }
        if m.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (heads * m.qk_head_dim, h)
        else:
            shapes.update(
                {
                    a + "q_a_proj.weight": (m.q_lora_rank, h),
                    a + "q_a_layernorm.weight": (m.q_lora_rank,),
                    a + "q_b_proj.weight": (heads * m.qk_head_dim, m.q_lora_rank),
                }
            )
        if self.attention_bias:
            shapes[a + "kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
            if m.q_lora_rank is not None:
                shapes[a + "q_a_proj.bias"] = (m.q_lora_rank,)
        return shapes

    def split_sizes(self) -> dict[str, tuple[int, ...]]:
        """Rows of each part of the family's fused tensors (``self_attn.qkv_proj`` -> q, k, v rows)."""
        q, i = self.num_heads * self.head_dim, self.intermediate_size
        kv = (self.qkv_groups or self.num_kv_heads) * self.head_dim  # rows of k and of v in the fused tensor
        return {
            name: (q, kv, kv) if parts[0] == "self_attn.q_proj" else (i, i)
            for name, parts in self.family.tensors.fused.items()
        }


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A validated config and its float tensors (HF names). ``fingerprint`` identifies the weights.

    An engine built in the checkpoint's own dtype and device re-points the q/k/v and gate/up entries
    of ``weights`` at rows of its fused copies (the same values bit for bit), so the model is held once
    (:func:`ropekv.engine.transformer.DecoderWeights.from_checkpoint`)."""

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    source: str
    fingerprint: str

    def __post_init__(self) -> None:
        validate_weights(self.config, self.weights, self.source)

    def weight(self, name: str) -> torch.Tensor:
        return self.weights[name]

    @functools.cached_property
    def weights_fingerprint(self) -> str:
        """The weights alone (:func:`~ropekv.models.weights.weights_fingerprint_of`: names, shapes,
        dtypes, bytes); unlike :attr:`fingerprint`, no configuration. Hashed once, on first use."""
        return weights_fingerprint_of(self.weights)

    @property
    def config_fingerprint(self) -> str:
        """:meth:`ModelConfig.config_fingerprint` of this checkpoint's config."""
        return self.config.config_fingerprint()

    @classmethod
    def from_tensors(
        cls,
        config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor],
        *,
        source: str = "tensors",
    ) -> Checkpoint:
        """A checkpoint from a config and a state dict (HF names), e.g. a model built in memory (a
        transformers ``config.json`` dict: :func:`~ropekv.models.hf_config.read_model_config` first).
        Tensors are taken in float32 (shared, not copied, where they already are); a NaN or infinity
        is refused naming the tensor. The fingerprint is :func:`fingerprint_of` the config and
        :func:`~ropekv.models.weights.weights_digest` of the tensors: the fingerprint a loader of
        the same weights from disk gives."""
        cfg = config
        expected = cfg.expected_shapes()
        state_dict = canonical_weights(cfg, state_dict, source)
        weights = {k: v.detach().to(torch.float32) for k, v in state_dict.items() if k in expected}
        for k in sorted(weights):
            problem = non_finite(weights[k])
            if problem is not None:
                raise CheckpointError(f"{source}: tensor {k!r} holds {problem}: a checkpoint's weights must be finite")
        return cls(cfg, weights, source, fingerprint_of(cfg, weights_digest(weights)))

    def with_config(self, config: ModelConfig) -> Checkpoint:
        """The same weights under another config (e.g. another RoPE); the fingerprint covers both."""
        return Checkpoint(config, self.weights, self.source, fingerprint_of(config, self.fingerprint))


def validate_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise :class:`CheckpointError` naming every missing, unexpected or misshaped tensor."""
    expected = config.expected_shapes()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(k for k in set(weights) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    problems = []
    if missing:
        problems.append(
            f"missing tensor(s) {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    if extra:
        problems.append(
            f"unexpected tensor(s) {', '.join(extra[:5])}" + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        )
    for name, shape in expected.items():
        t = weights.get(name)
        if t is not None and tuple(t.shape) != shape:
            problems.append(f"tensor {name} has shape {tuple(t.shape)}, config needs {shape}")
        if t is not None and not t.is_floating_point():
            problems.append(f"tensor {name} has dtype {t.dtype}, a float type is needed")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems[:8]))


def fingerprint_of(config: ModelConfig, digest: str) -> str:
    """Model fingerprint: what the config computes (including RoPE) plus ``digest``, the weights'
    :func:`~ropekv.models.weights.weights_digest`.

    The config's ``name`` is left out: it is a label (transformers fills it from the path a model was
    loaded from, ``_name_or_path``), so the same checkpoint loaded from a relative path, an absolute
    one, a copy in another folder, a GGUF file or a transformers model in memory gets one fingerprint.
    """
    semantics = config.to_dict()
    del semantics["name"]
    blob = json.dumps(semantics, sort_keys=True) + digest
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
