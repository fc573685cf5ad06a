"""The CPU side of the FlashInfer GPU check's inputs: the truncated model and the bundle built from it.

The default model's float32 weights (538 MB) do not travel to the GPU machine (64 MiB per call). What
travels is the first few layers with every weight rounded to float16 (or bfloat16), and the embedding
rows of the tokens the check feeds. The float64 reference judges the same model:
:func:`truncated_checkpoint` keeps those layers, rounds every weight the same way (embeddings, norms
and the tied head included) and takes them back in float32, so the engine and the reference compute
one model, whose fingerprint the recordings carry.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError, UsageError
from ...models.config import Checkpoint, ModelConfig
from ...parity.cases import Case, token_stream
from .bundle import DTYPE_NAMES, Bundle, BundleCase
from .model import Shapes

MAX_LAYERS = 8  # a layer of SmolLM2 is 7 MB in float16: 8 fill most of what one device call carries


def unsupported(cfg: ModelConfig) -> str | None:
    """Why the GPU check's llama block (:mod:`~ropekv.adapters.flashinfer.model`) cannot run ``cfg``; None if it can."""
    rope = cfg.rope
    problems = [
        (cfg.architecture != "llama", f"architecture {cfg.architecture!r} (the block is llama's)"),
        (cfg.attention_bias or cfg.o_bias or cfg.mlp_bias, "biases"),
        (cfg.qk_norm, "q/k norms"),
        (not cfg.uniform_rope, "per-layer RoPE"),
        (rope.scaling.rope_type != "default", f"RoPE scaling {rope.scaling.rope_type!r} (ROPE_LLAMA has theta only)"),
        (rope.rotary_dim != cfg.head_dim, "partial rotary"),
        (rope.layout != "neox", f"the {rope.layout!r} pairing (ROPE_LLAMA rotates halves)"),
        (rope.attention_factor != 1.0, "an attention factor"),
        (any(a.kind != "full" for a in cfg.layer_attentions), "windowed or chunked layers"),
        (cfg.hidden_act != "silu", f"activation {cfg.hidden_act!r}"),
        (cfg.moe is not None or cfg.mla is not None, "MoE or MLA"),
        (
            (cfg.embedding_scale, cfg.residual_scale, cfg.logits_scale) != (1.0, 1.0, 1.0),
            "scaled embeddings or residuals",
        ),
        (cfg.query_scale is not None or cfg.attn_softcap is not None or cfg.final_softcap is not None, "custom scores"),
    ]
    found = [why for bad, why in problems if bad]
    return ", ".join(found) if found else None


def truncated_checkpoint(checkpoint: Checkpoint, num_layers: int, weight_dtype: str) -> Checkpoint:
    """``checkpoint``'s first ``num_layers`` layers, every weight rounded to ``weight_dtype`` and held in float32."""
    cfg = checkpoint.config
    why = unsupported(cfg)
    if why is not None:
        raise ConfigError(f"the FlashInfer check runs llama blocks only; this model has {why}")
    if weight_dtype not in DTYPE_NAMES:
        raise UsageError(f"weight dtype must be one of {', '.join(DTYPE_NAMES)}, got {weight_dtype!r}")
    if not isinstance(num_layers, int) or not 1 <= num_layers <= min(MAX_LAYERS, cfg.num_layers):
        raise UsageError(f"num_layers must be in 1..{min(MAX_LAYERS, cfg.num_layers)}, got {num_layers!r}")
    kept = cfg.replace(
        num_layers=num_layers,
        layer_types=cfg.layer_types[:num_layers],
        name=f"{cfg.name or 'model'} (first {num_layers} of {cfg.num_layers} layers, {weight_dtype} weights)",
    )
    expected = kept.expected_shapes()
    dtype = DTYPE_NAMES[weight_dtype]
    weights = {k: v.to(dtype).to(torch.float32) for k, v in checkpoint.weights.items() if k in expected}
    source = f"{checkpoint.source} (first {num_layers} layers, weights rounded to {weight_dtype})"
    return Checkpoint.from_tensors(kept, weights, source=source)


def shapes_of(cfg: ModelConfig) -> Shapes:
    return Shapes(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope_theta=float(cfg.rope.theta),
    )


def make_bundle(truncated: Checkpoint, cases: list[BundleCase], weight_dtype: str, seed: int = 0) -> Bundle:
    """The bundle for ``truncated`` (from :func:`truncated_checkpoint` with the same ``weight_dtype``): the
    token stream ``ropekv.check`` feeds with ``seed``, its embedding rows and the layers' weights."""
    cfg = truncated.config
    dtype = DTYPE_NAMES[weight_dtype]
    tokens = token_stream(cfg.vocab_size, max(c.total for c in cases), seed)
    embed = truncated.weight("model.embed_tokens.weight")
    layers = {k: v.to(dtype) for k, v in truncated.weights.items() if k.startswith("model.layers.")}
    meta = {
        "fingerprint": truncated.fingerprint,
        "model": cfg.name,
        "source": truncated.source,
        "seed": seed,
        "weight_dtype": weight_dtype,
    }
    return Bundle(shapes_of(cfg), layers, embed[tokens].to(dtype), tokens, tuple(cases), meta)


def as_case(c: BundleCase) -> Case:
    """The parity case a bundle case runs."""
    return Case(length=c.length, block_size=c.block_size, decode_steps=c.decode_steps)
