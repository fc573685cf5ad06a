"""The engine's transformer math: fused weights and the per-layer pieces around attention.

Deliberately separate from ``ropekv.models.reference`` (the float64 reference decoder): the engine is
the code under test and the reference must not share its layers. Only the config (and the decoder
description it names, ``ropekv.models.families``), the checkpoint and the pure RoPE functions are
common. Norm offsets (gemma's ``1 + w``) are folded into the weights once, here; q/k/v and gate/up
are fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .models.config import Checkpoint, ModelConfig


@dataclass(frozen=True, eq=False)
class Norm:
    """One norm: ``kind`` "rms" or "layer" (mean-centred), weight (offset folded in) and optional bias."""

    kind: str
    weight: torch.Tensor  # [n]
    bias: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class MoeWeights:
    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E, 2 * I, hidden]
    down: torch.Tensor  # [E, hidden, I]
    shared_gate_up: torch.Tensor | None  # [2 * S, hidden]
    shared_down: torch.Tensor | None  # [hidden, S]
    shared_gate: torch.Tensor | None  # [1, hidden]
    router_bias: torch.Tensor | None = None  # [E] (gpt_oss)
    gate_up_bias: torch.Tensor | None = None  # [E, 2 * I]
    down_bias: torch.Tensor | None = None  # [E, hidden]


@dataclass(frozen=True, eq=False)
class LayerWeights:
    attn_in: Norm | None
    attn_out: Norm | None
    mlp_in: Norm | None
    mlp_out: Norm | None
    qkv: torch.Tensor  # [(H + 2 * KVH) * D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 * KVH) * D]
    q_norm: Norm | None  # [D] per head, or [H * D] over the projection (family.qk_norm)
    k_norm: Norm | None
    o: torch.Tensor  # [hidden, H * D]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 * intermediate, hidden] (gated), [intermediate, hidden] (plain)
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None
    moe: MoeWeights | None = None
    sinks: torch.Tensor | None = None  # [H] learned sink logits (gpt_oss), in the softmax denominator


@dataclass(frozen=True, eq=False)
class DecoderWeights:
    """All weights in the engine's dtype, q/k/v and gate/up fused for fewer matmuls."""

    config: ModelConfig
    embed: torch.Tensor  # [vocab, hidden]
    final_norm: Norm
    lm_head: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype, device: str | torch.device = "cpu") -> "DecoderWeights":
        cfg = ckpt.config
        fam = cfg.family
        w = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in ckpt.weights.items()}

        def opt(name: str) -> torch.Tensor | None:
            return w.get(name)

        def norm(name: str | None) -> Norm | None:
            if name is None:
                return None
            weight = w[name + ".weight"]
            if fam.norm in ("rms_offset", "layer_offset"):
                weight = (weight.float() + 1.0).to(dtype)
            return Norm("layer" if fam.norm.startswith("layer") else "rms", weight, opt(name + ".bias"))

        def cat(names: list[str]) -> torch.Tensor | None:
            parts = [w.get(n) for n in names]
            return None if any(t is None for t in parts) else torch.cat(parts)

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            mlp = ["gate_proj", "up_proj"] if fam.mlp == "gated" else ["up_proj"]
            spec = cfg.layer_moe(i)
            moe = None
            if spec is not None:
                shared = spec.shared_expert_size is not None
                moe = MoeWeights(
                    router=w[p + "mlp.gate.weight"], gate_up=w[p + "mlp.experts.gate_up_proj"],
                    down=w[p + "mlp.experts.down_proj"],
                    shared_gate_up=cat([p + "mlp.shared_expert.gate_proj.weight", p + "mlp.shared_expert.up_proj.weight"])
                    if shared else None,
                    shared_down=w[p + "mlp.shared_expert.down_proj.weight"] if shared else None,
                    shared_gate=w[p + "mlp.shared_expert_gate.weight"] if shared else None,
                    router_bias=opt(p + "mlp.gate.bias"), gate_up_bias=opt(p + "mlp.experts.gate_up_proj_bias"),
                    down_bias=opt(p + "mlp.experts.down_proj_bias"))
            layers.append(LayerWeights(
                attn_in=norm(p + fam.attn_in if fam.attn_in else None),
                attn_out=norm(p + fam.attn_out if fam.attn_out else None),
                mlp_in=norm(p + fam.mlp_in if fam.mlp_in else None),
                mlp_out=norm(p + fam.mlp_out if fam.mlp_out else None),
                qkv=torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
                qkv_bias=cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]) if cfg.attention_bias else None,
                q_norm=norm(a + "q_norm") if cfg.qk_norm else None,
                k_norm=norm(a + "k_norm") if cfg.qk_norm else None,
                o=w[a + "o_proj.weight"],
                o_bias=opt(a + "o_proj.bias"),
                gate_up=moe.gate_up.reshape(-1, cfg.hidden_size) if moe else cat([p + f"mlp.{m}.weight" for m in mlp]),
                gate_up_bias=cat([p + f"mlp.{m}.bias" for m in mlp]) if cfg.mlp_bias and moe is None else None,
                down=moe.down.reshape(cfg.hidden_size, -1) if moe else w[p + "mlp.down_proj.weight"],
                down_bias=opt(p + "mlp.down_proj.bias") if moe is None else None,
                moe=moe,
                sinks=w[a + "sinks"] if cfg.attention_sinks else None,
            ))
        embed = w["model.embed_tokens.weight"]
        lm_head = embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        return cls(cfg, embed, norm(fam.final_norm), lm_head, tuple(layers))

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.final_norm.weight, self.lm_head]
        for lw in self.layers:
            for t in vars(lw).values():
                if isinstance(t, Norm):
                    tensors += [x for x in (t.weight, t.bias) if x is not None]
                elif isinstance(t, MoeWeights):
                    tensors += [x for x in vars(t).values() if x is not None]
                elif isinstance(t, torch.Tensor):
                    tensors.append(t)
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


def apply_norm(x: torch.Tensor, norm: Norm | None, eps: float) -> torch.Tensor:
    """``norm`` over the last dim of ``x`` (identity for None), computed in float32 or wider."""
    if norm is None:
        return x
    if norm.kind == "rms":
        out = rms_norm(x, norm.weight, eps)
        return out + norm.bias if norm.bias is not None else out
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = norm.weight.to(work)
    b = norm.bias.to(work) if norm.bias is not None else None
    return F.layer_norm(x.to(work), (x.shape[-1],), w, b, eps).to(x.dtype)


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """transformers' ``ACT2FN[name]`` through torch's own kernels."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    if name == "relu2":
        return F.relu(x).square()
    raise ValueError(f"activation {name!r} is not implemented")


def embed(cfg: ModelConfig, weights: DecoderWeights, tokens: torch.Tensor) -> torch.Tensor:
    """Hidden states ``[n, hidden]`` of ``tokens [n]``: the embedding rows times ``embedding_scale``."""
    h = weights.embed[tokens]
    return h * cfg.embedding_scale if cfg.embedding_scale != 1.0 else h


def project_qkv(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw (pre-RoPE) q ``[n, H, D]``, k ``[n, KVH, D]``, v ``[n, KVH, D]`` from hidden ``h [n, hidden]``."""
    x = apply_norm(h, lw.attn_in, cfg.rms_norm_eps)
    qkv = F.linear(x, lw.qkv, lw.qkv_bias)
    n, d = h.shape[0], cfg.head_dim
    q_end = cfg.num_heads * d
    k_end = q_end + cfg.num_kv_heads * d
    q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
    if lw.q_norm is not None and cfg.family.qk_norm == "projection":
        q = apply_norm(q, lw.q_norm, cfg.rms_norm_eps)
        k = apply_norm(k, lw.k_norm, cfg.rms_norm_eps)
    q = q.reshape(n, cfg.num_heads, d)
    k = k.reshape(n, cfg.num_kv_heads, d)
    v = v.reshape(n, cfg.num_kv_heads, d)
    if lw.q_norm is not None and cfg.family.qk_norm == "head":
        q = apply_norm(q, lw.q_norm, cfg.rms_norm_eps)
        k = apply_norm(k, lw.k_norm, cfg.rms_norm_eps)
    return q, k, v


def after_rope(cfg: ModelConfig, norm: Norm | None, x: torch.Tensor) -> torch.Tensor:
    """The per-head q/k norm of families that apply it after RoPE (hunyuan: the kernel multiplies
    ``norm(R(p) q)`` by ``norm(R(j) k)``, and the cache holds the latter); identity for every other."""
    if norm is None or cfg.family.qk_norm != "head_after_rope":
        return x
    return apply_norm(x, norm, cfg.rms_norm_eps)


def finish_layer(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Residual around attention (``attn_out [n, H, D]``) and the MLP; returns the next hidden state."""
    fam, eps, scale = cfg.family, cfg.rms_norm_eps, cfg.residual_scale
    a = apply_norm(F.linear(attn_out.reshape(h.shape[0], -1), lw.o, lw.o_bias), lw.attn_out, eps)
    if fam.parallel:  # attention and MLP both read the block's input norm
        m = _mlp(cfg, lw, apply_norm(h, lw.attn_in, eps))
        return h + (a + m) * scale if scale != 1.0 else h + a + m
    h = h + a * scale if scale != 1.0 else h + a
    m = apply_norm(_mlp(cfg, lw, apply_norm(h, lw.mlp_in, eps)), lw.mlp_out, eps)
    return h + m * scale if scale != 1.0 else h + m


def _mlp(cfg: ModelConfig, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    if lw.moe is not None:
        return _moe(cfg, lw.moe, x)
    if cfg.family.mlp == "gated":
        gate, up = F.linear(x, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
        return F.linear(activation(gate, cfg.hidden_act) * up, lw.down, lw.down_bias)
    return F.linear(activation(F.linear(x, lw.gate_up, lw.gate_up_bias), cfg.hidden_act), lw.down, lw.down_bias)


def _moe(cfg: ModelConfig, mw: MoeWeights, x: torch.Tensor) -> torch.Tensor:
    """Top-k routing of ``x [n, hidden]``; each expert runs once on the tokens routed to it."""
    spec = cfg.moe
    logits = F.linear(x, mw.router, mw.router_bias).float()  # [n, E]
    if spec.router == "softmax_topk":
        weights, experts = torch.softmax(logits, dim=-1).topk(spec.top_k, dim=-1)
        if spec.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
    else:
        top, experts = logits.topk(spec.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        token, slot = torch.where(experts == e)
        bias = None if mw.gate_up_bias is None else mw.gate_up_bias[e]
        gate, up = F.linear(x[token], mw.gate_up[e], bias).chunk(2, dim=-1)
        y = F.linear(_expert_act(spec, cfg.hidden_act, gate, up), mw.down[e],
                     None if mw.down_bias is None else mw.down_bias[e])
        out.index_add_(0, token, y * weights[token, slot, None].to(x.dtype))
    if mw.shared_gate_up is not None:
        gate, up = F.linear(x, mw.shared_gate_up).chunk(2, dim=-1)
        shared = F.linear(activation(gate, cfg.hidden_act) * up, mw.shared_down)
        out = out + torch.sigmoid(F.linear(x, mw.shared_gate)) * shared
    return out


def _expert_act(spec, act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up``, or gpt_oss's clamped SwiGLU where the spec has a limit (models/moe.py)."""
    if spec.swiglu_limit is None:
        return activation(gate, act) * up
    gate = gate.clamp(max=spec.swiglu_limit)
    up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))


def final_logits(cfg: ModelConfig, weights: DecoderWeights, h: torch.Tensor) -> torch.Tensor:
    """Logits ``[n, vocab]`` in float32 from the last hidden state ``h [n, hidden]``."""
    logits = F.linear(apply_norm(h, weights.final_norm, cfg.rms_norm_eps), weights.lm_head).float()
    if cfg.logits_scale != 1.0:
        logits = logits * cfg.logits_scale
    if cfg.final_softcap is not None:
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits
