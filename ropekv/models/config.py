"""The model description shared by the loaders, the reference decoder and the engine.

A :class:`Checkpoint` is a validated :class:`ModelConfig` plus float tensors named as in transformers
(``model.layers.{i}.self_attn.q_proj.weight`` ...). Nothing here knows about caches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..errors import CheckpointError, ConfigError
from ..rope import MAX_POSITIONS, RopeSpec, _finite, _is_real

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Far above any real model (~130 layers): a config's layer count sizes lists built before any tensor is read.
MAX_LAYERS = 4096

# ModelConfig fields whose config.json name differs (for error messages).
_HF_FIELD_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                   "num_kv_heads": "num_key_value_heads"}
# transformers "architectures" entries and "model_type" values we accept.
_HF_CLASS_TO_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only RoPE transformer (llama family) in the terms ropekv needs.

    ``layer_types[i]`` is ``"sliding_attention"`` for layers that see only the last ``sliding_window``
    keys (HF semantics: key ``j`` visible to query ``i`` iff ``i - W < j <= i``).
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
    attention_bias: bool = False  # bias on q, k, v projections (qwen2; llama's attention_bias)
    o_bias: bool = False  # bias on o_proj (llama's attention_bias also covers it)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (qwen3)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                hf = f" ({_HF_FIELD_NAMES[f]} in config.json)" if f in _HF_FIELD_NAMES else ""
                raise ConfigError(f"config field {f!r}{hf} must be a positive integer, got {v!r}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ConfigError(f"config field 'max_position_embeddings' = {self.max_position_embeddings} is implausible "
                              "(at most 2**40)")
        if self.num_layers > MAX_LAYERS:
            raise ConfigError(f"config field 'num_layers' = {self.num_layers} is implausible (at most {MAX_LAYERS})")
        eps = self.rms_norm_eps
        if not _is_real(eps) or not _finite(eps) or eps < 0:
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

    @property
    def position_limit(self) -> int:
        """Positions the model can be run at: ``max_position_embeddings``, except that dynamic NTK
        exists to go past it (up to ``factor`` times, as it was tuned for)."""
        if self.rope.scaling.rope_type == "dynamic":
            base = max(self.max_position_embeddings, self.rope.max_position_embeddings)
            return int(base * max(1.0, self.rope.scaling.factor))
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """The window of ``layer``, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["rope"] = self.rope.to_dict()
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, source: str = "config.json", layout: str = "neox") -> "ModelConfig":
        """Validate a transformers ``config.json`` dict. Errors name ``source`` and the field."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"{source}: must be a JSON object")
        arch = _architecture(config, source)
        if config.get("trust_remote_code") or config.get("auto_map"):
            raise ConfigError(f"{source}: needs custom code (auto_map / trust_remote_code); ropekv never runs checkpoint code")

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

        def optional_int(name: str, low: int) -> int | None:
            value = config.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ConfigError(f"{source}: field {name!r} must be an integer >= {low}, got {value!r}")
            return value

        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"{source}: field 'hidden_act' = {act!r} is not supported (silu only)")
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        num_layers = need("num_hidden_layers")
        if not 1 <= num_layers <= MAX_LAYERS:
            raise ConfigError(f"{source}: field 'num_hidden_layers' must be in [1, {MAX_LAYERS}], got {num_layers}")
        head_dim = config.get("head_dim") or (hidden // num_heads if num_heads else 0)
        num_kv_heads = config.get("num_key_value_heads")
        if num_kv_heads is None:
            num_kv_heads = num_heads
        sizes = {name: need(name) for name in ("vocab_size", "intermediate_size", "max_position_embeddings")}
        rms_norm_eps = float(need("rms_norm_eps", float))
        try:
            rope = RopeSpec.from_hf_config(config, layout=layout)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

        sliding = None
        layer_types = config.get("layer_types")
        if arch == "mistral":
            sliding = optional_int("sliding_window", 1)
            default_types = ["sliding_attention" if sliding else "full_attention"] * num_layers
        elif arch in ("qwen2", "qwen3"):
            use = flag("use_sliding_window")
            sliding = optional_int("sliding_window", 1) if use else None
            mwl = optional_int("max_window_layers", 0)
            mwl = num_layers if mwl is None else mwl
            default_types = [
                "sliding_attention" if (sliding and i >= mwl) else "full_attention" for i in range(num_layers)
            ]
        else:
            default_types = ["full_attention"] * num_layers
        if layer_types is None:
            layer_types = default_types
        if not isinstance(layer_types, list):
            raise ConfigError(f"{source}: field 'layer_types' must be a list")
        if "sliding_attention" in layer_types and not sliding:
            sliding = optional_int("sliding_window", 1)
        if "sliding_attention" not in layer_types:
            sliding = None
        attention_bias = flag("attention_bias")
        tie_word_embeddings, mlp_bias = flag("tie_word_embeddings"), flag("mlp_bias")
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
                rms_norm_eps=rms_norm_eps,
                max_position_embeddings=sizes["max_position_embeddings"],
                rope=rope,
                tie_word_embeddings=tie_word_embeddings,
                attention_bias=attention_bias or arch == "qwen2",
                o_bias=attention_bias and arch in ("llama", "qwen3"),
                mlp_bias=mlp_bias,
                qk_norm=arch == "qwen3",
                sliding_window=sliding,
                layer_types=tuple(layer_types),
                name=str(config.get("_name_or_path") or config.get("name") or arch),
            )
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of this config must hold, with its shape (HF names)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
            if self.attention_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.mlp_bias:
                shapes.update({p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (h,)})
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        return shapes


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A validated config and its float tensors (HF names). ``fingerprint`` identifies the weights."""

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    source: str
    fingerprint: str

    def __post_init__(self) -> None:
        validate_weights(self.config, self.weights, self.source)

    def weight(self, name: str) -> torch.Tensor:
        return self.weights[name]

    @classmethod
    def from_tensors(cls, config: "ModelConfig | Mapping[str, Any]", state_dict: Mapping[str, torch.Tensor], *,
                     source: str = "tensors") -> "Checkpoint":
        """A checkpoint from a config (a :class:`ModelConfig` or a transformers ``config.json`` dict) and a
        state dict (HF names), e.g. a model built in memory. Tensors are taken in float32 (shared, not
        copied, where they already are); the fingerprint hashes the config and every weight byte."""
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf_config(dict(config), source=source)
        expected = cfg.expected_shapes()
        weights = {k: v.detach().to(torch.float32) for k, v in state_dict.items() if k in expected}
        digest = hashlib.sha256()
        for k in sorted(weights):
            digest.update(k.encode())
            digest.update(weights[k].contiguous().view(torch.uint8).numpy().tobytes())
        return cls(cfg, weights, source, fingerprint_of(cfg, digest.hexdigest()))

    def with_config(self, config: ModelConfig) -> "Checkpoint":
        """The same weights under another config (e.g. another RoPE); the fingerprint covers both."""
        return Checkpoint(config, self.weights, self.source, fingerprint_of(config, self.fingerprint))


def validate_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise :class:`CheckpointError` naming every missing, unexpected or misshaped tensor."""
    expected = config.expected_shapes()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(k for k in set(weights) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {', '.join(missing[:5])}" + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    if extra:
        problems.append(f"unexpected tensor(s) {', '.join(extra[:5])}" + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    for name, shape in expected.items():
        t = weights.get(name)
        if t is not None and tuple(t.shape) != shape:
            problems.append(f"tensor {name} has shape {tuple(t.shape)}, config needs {shape}")
        if t is not None and not t.is_floating_point():
            problems.append(f"tensor {name} has dtype {t.dtype}, a float type is needed")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems[:8]))


def fingerprint_of(config: ModelConfig, weights_digest: str) -> str:
    """Model fingerprint: config (including RoPE) plus a digest of the weights."""
    blob = json.dumps(config.to_dict(), sort_keys=True) + weights_digest
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _architecture(config: Mapping[str, Any], source: str) -> str:
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"{source}: field 'architectures' must be a list")
    for a in archs:
        if isinstance(a, str) and a in _HF_CLASS_TO_ARCH:
            return _HF_CLASS_TO_ARCH[a]
    model_type = config.get("model_type")
    if model_type in ARCHITECTURES:
        return model_type
    named = archs[0] if archs else model_type
    if named is None:
        raise ConfigError(f"{source}: missing field 'model_type' (or 'architectures')")
    raise ConfigError(f"{source}: unsupported architecture {named!r}; supported: {', '.join(ARCHITECTURES)}")
