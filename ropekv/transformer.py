"""The engine's transformer math: fused weights and the per-layer pieces around attention.

Deliberately separate from ``ropekv.models.reference`` (the float64 reference decoder): the engine is
the code under test and the reference must not share its layers. Only the config, the checkpoint and
the pure RoPE functions are common.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .models.config import Checkpoint, ModelConfig


@dataclass(frozen=True, eq=False)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 * KVH) * D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 * KVH) * D]
    q_norm: torch.Tensor | None  # [D]
    k_norm: torch.Tensor | None  # [D]
    o: torch.Tensor  # [hidden, H * D]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class DecoderWeights:
    """All weights in the engine's dtype, q/k/v and gate/up fused for fewer matmuls."""

    config: ModelConfig
    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype, device: str | torch.device = "cpu") -> "DecoderWeights":
        cfg = ckpt.config
        w = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in ckpt.weights.items()}

        def opt(name: str) -> torch.Tensor | None:
            return w.get(name)

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_bias = None
            if cfg.attention_bias:
                qkv_bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
            gate_up_bias = None
            if cfg.mlp_bias:
                gate_up_bias = torch.cat([w[p + "mlp.gate_proj.bias"], w[p + "mlp.up_proj.bias"]])
            layers.append(LayerWeights(
                input_norm=w[p + "input_layernorm.weight"],
                post_norm=w[p + "post_attention_layernorm.weight"],
                qkv=torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
                qkv_bias=qkv_bias,
                q_norm=opt(a + "q_norm.weight"),
                k_norm=opt(a + "k_norm.weight"),
                o=w[a + "o_proj.weight"],
                o_bias=opt(a + "o_proj.bias"),
                gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                gate_up_bias=gate_up_bias,
                down=w[p + "mlp.down_proj.weight"],
                down_bias=opt(p + "mlp.down_proj.bias"),
            ))
        embed = w["model.embed_tokens.weight"]
        lm_head = embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        return cls(cfg, embed, w["model.norm.weight"], lm_head, tuple(layers))

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.final_norm, self.lm_head]
        for lw in self.layers:
            tensors += [t for t in vars(lw).values() if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (or float64), returned in x's dtype."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    if x.dtype == work and weight.dtype == work:
        # torch's rms_norm does the same pow, mean, add, rsqrt and products in one call (bit for bit
        # the same in float32/float64; checked in tests/test_bench.py), where a decode step spends
        # about as long dispatching the six separate ops below as computing them, 61 times a step.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.to(work)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def project_qkv(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw (pre-RoPE) q ``[n, H, D]``, k ``[n, KVH, D]``, v ``[n, KVH, D]`` from hidden ``h [n, hidden]``."""
    x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
    qkv = F.linear(x, lw.qkv, lw.qkv_bias)
    n, d = h.shape[0], cfg.head_dim
    q_end = cfg.num_heads * d
    k_end = q_end + cfg.num_kv_heads * d
    q = qkv[:, :q_end].reshape(n, cfg.num_heads, d)
    k = qkv[:, q_end:k_end].reshape(n, cfg.num_kv_heads, d)
    v = qkv[:, k_end:].reshape(n, cfg.num_kv_heads, d)
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
    return q, k, v


def finish_layer(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Residual around attention (``attn_out [n, H, D]``) and the gated MLP; returns the next hidden state."""
    h = h + F.linear(attn_out.reshape(h.shape[0], -1), lw.o, lw.o_bias)
    x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
    gate, up = F.linear(x, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, lw.down, lw.down_bias)


def final_logits(cfg: ModelConfig, weights: DecoderWeights, h: torch.Tensor) -> torch.Tensor:
    """Logits ``[n, vocab]`` in float32 from the last hidden state ``h [n, hidden]``."""
    return F.linear(rms_norm(h, weights.final_norm, cfg.rms_norm_eps), weights.lm_head).float()
