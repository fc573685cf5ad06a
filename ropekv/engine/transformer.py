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

from ..models.config import Checkpoint, ModelConfig
from ..models.mla import LATENT_NORM_EPS
from ..models.moe import MoeSpec


@dataclass(frozen=True, eq=False)
class Norm:
    """One norm: ``kind`` "rms" or "layer" (mean-centred), weight (offset folded in) and optional bias."""

    kind: str
    weight: torch.Tensor  # [n]
    bias: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class MlaWeights:
    """Multi-head latent attention (models/mla.py): the query path (``q`` alone, or ``q_a`` + norm +
    ``q_b``) and the latent path (``kv_a`` -> latent + shared rope part, norm, ``kv_b``)."""

    q: torch.Tensor | None  # [H * (nope + rope), hidden] (q_lora_rank None)
    q_a: torch.Tensor | None  # [q_lora_rank, hidden]
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: torch.Tensor | None  # [H * (nope + rope), q_lora_rank]
    kv_a: torch.Tensor  # [kv_lora_rank + rope, hidden]
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [H * (nope + v_head_dim), kv_lora_rank]


@dataclass(frozen=True, eq=False)
class MoeWeights:
    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E, 2 * I, hidden]
    down: torch.Tensor  # [E, hidden, I]
    shared_gate_up: torch.Tensor | None  # [2 * S, hidden]
    shared_down: torch.Tensor | None  # [hidden, S]
    shared_gate: torch.Tensor | None  # [1, hidden]; None: the shared expert is added ungated (llama4)
    correction_bias: torch.Tensor | None = None  # [E] (sigmoid_group routers)
    experts_gate_up: torch.Tensor | None = None  # [2 * S, hidden]: ungated shared experts (deepseek, glm4_moe)
    experts_gate_up_bias: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None  # [hidden, S]
    experts_down_bias: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None  # [E] (gpt_oss)
    gate_up_bias: torch.Tensor | None = None  # [E, 2 * I] of the routed experts (gpt_oss)
    down_bias: torch.Tensor | None = None  # [E, hidden]


@dataclass(frozen=True, eq=False)
class LayerWeights:
    attn_in: Norm | None
    attn_out: Norm | None
    mlp_in: Norm | None
    mlp_out: Norm | None
    qkv: torch.Tensor | None  # [(H + 2 * KVH) * D, hidden]; None for MLA
    qkv_bias: torch.Tensor | None  # [(H + 2 * KVH) * D]
    q_norm: Norm | None  # [D] per head, or [H * D] over the projection (family.block.qk_norm)
    k_norm: Norm | None
    o: torch.Tensor  # [hidden, H * D]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden] (gated), [intermediate, hidden] (plain); None: missing
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None
    moe: MoeWeights | None = None
    mla: MlaWeights | None = None
    xielu: tuple[torch.Tensor, ...] | None = None  # (alpha_p [1], alpha_n [1], beta [], eps []) of an xIELU MLP
    temperature: bool = False  # llama4 NoPE layers: queries scaled by position (query_temperature)
    sinks: torch.Tensor | None = None  # [H] learned sink logits (gpt_oss), in the softmax denominator


@dataclass(frozen=True, eq=False)
class DecoderWeights:
    """All weights in the engine's dtype, q/k/v and gate/up fused for fewer matmuls."""

    config: ModelConfig
    embed: torch.Tensor  # [vocab, hidden]
    final_norm: Norm
    lm_head: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    lm_head_bias: torch.Tensor | None = None  # [vocab] (phi, gptj)

    @classmethod
    def from_checkpoint(
        cls, ckpt: Checkpoint, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> DecoderWeights:
        cfg = ckpt.config
        fam = cfg.family
        w = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in ckpt.weights.items()}

        def opt(name: str) -> torch.Tensor | None:
            return w.get(name)

        def norm(name: str | None) -> Norm | None:
            if name is None:
                return None
            if fam.block.norm == "layer_plain":  # no tensors: weight one, no bias
                return Norm("layer", torch.ones(cfg.hidden_size, device=device, dtype=dtype), None)
            weight = w[name + ".weight"]
            if fam.block.norm in ("rms_offset", "layer_offset"):
                weight = (weight.float() + 1.0).to(dtype)
            return Norm("layer" if fam.block.norm.startswith("layer") else "rms", weight, opt(name + ".bias"))

        def cat(names: list[str]) -> torch.Tensor | None:
            parts = [w[n] for n in names if n in w]
            if len(parts) != len(names):
                return None
            fused = torch.cat(parts)
            _share_fused(ckpt, w, names, fused)
            return fused

        def qk_norm(layer: int, name: str) -> Norm | None:
            if not cfg.layer_qk_norm(layer):
                return None
            if fam.block.qk_norm == "l2":  # llama4: RMS over the head without weights, as an RMSNorm of ones
                return Norm("rms", torch.ones(cfg.head_dim, dtype=dtype, device=device), None)
            return norm(name)

        attn_in, attn_out, mlp_in, mlp_out = cfg.norm_slots
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            mlp = ["gate_proj", "up_proj"] if fam.block.mlp == "gated" else ["up_proj"]
            spec = cfg.layer_moe(i)
            moe = None
            if spec is not None:
                shared = spec.shared_expert_size is not None
                s = p + "mlp.shared_experts."
                moe = MoeWeights(
                    router=w[p + "mlp.gate.weight"],
                    gate_up=w[p + "mlp.experts.gate_up_proj"],
                    down=w[p + "mlp.experts.down_proj"],
                    shared_gate_up=cat(
                        [p + "mlp.shared_expert.gate_proj.weight", p + "mlp.shared_expert.up_proj.weight"]
                    )
                    if shared
                    else None,
                    shared_down=w[p + "mlp.shared_expert.down_proj.weight"] if shared else None,
                    shared_gate=w[p + "mlp.shared_expert_gate.weight"] if shared and spec.shared_expert_gated else None,
                    correction_bias=opt(p + "mlp.gate.e_score_correction_bias"),
                    experts_gate_up=cat([s + "gate_proj.weight", s + "up_proj.weight"]),
                    experts_gate_up_bias=cat([s + "gate_proj.bias", s + "up_proj.bias"]),
                    experts_down=opt(s + "down_proj.weight"),
                    experts_down_bias=opt(s + "down_proj.bias"),
                    router_bias=opt(p + "mlp.gate.bias"),
                    gate_up_bias=opt(p + "mlp.experts.gate_up_proj_bias"),
                    down_bias=opt(p + "mlp.experts.down_proj_bias"),
                )
            mla = None
            if cfg.mla is not None:
                mla = MlaWeights(
                    q=opt(a + "q_proj.weight"),
                    q_a=opt(a + "q_a_proj.weight"),
                    q_a_bias=opt(a + "q_a_proj.bias"),
                    q_a_norm=opt(a + "q_a_layernorm.weight"),
                    q_b=opt(a + "q_b_proj.weight"),
                    kv_a=w[a + "kv_a_proj_with_mqa.weight"],
                    kv_a_bias=opt(a + "kv_a_proj_with_mqa.bias"),
                    kv_a_norm=w[a + "kv_a_layernorm.weight"],
                    kv_b=w[a + "kv_b_proj.weight"],
                )
            layers.append(
                LayerWeights(
                    attn_in=norm(p + attn_in if attn_in else None),
                    attn_out=norm(p + attn_out if attn_out else None),
                    mlp_in=norm(p + mlp_in if mlp_in else None),
                    mlp_out=norm(p + mlp_out if mlp_out else None),
                    qkv=None if mla else cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                    qkv_bias=cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
                    if cfg.attention_bias and not mla
                    else None,
                    q_norm=qk_norm(i, a + "q_norm"),
                    k_norm=qk_norm(i, a + "k_norm"),
                    o=w[a + "o_proj.weight"],
                    o_bias=opt(a + "o_proj.bias"),
                    gate_up=moe.gate_up.reshape(-1, cfg.hidden_size)
                    if moe
                    else cat([p + f"mlp.{m}.weight" for m in mlp]),
                    gate_up_bias=cat([p + f"mlp.{m}.bias" for m in mlp]) if cfg.mlp_bias and moe is None else None,
                    down=moe.down.reshape(cfg.hidden_size, -1) if moe else w[p + "mlp.down_proj.weight"],
                    down_bias=opt(p + "mlp.down_proj.bias") if moe is None else None,
                    moe=moe,
                    mla=mla,
                    xielu=tuple(w[p + "mlp.act_fn." + n] for n in ("alpha_p", "alpha_n", "beta", "eps"))
                    if cfg.hidden_act == "xielu"
                    else None,
                    temperature=cfg.layer_temperature(i),
                    sinks=w[a + "sinks"] if cfg.attention_sinks else None,
                )
            )
        embed = w["model.embed_tokens.weight"]
        lm_head = embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        final_norm = norm(fam.block.final_norm)
        assert final_norm is not None  # every family names its final norm
        return cls(cfg, embed, final_norm, lm_head, tuple(layers), opt("lm_head.bias"))

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.final_norm.weight, self.lm_head]
        if self.lm_head_bias is not None:
            tensors.append(self.lm_head_bias)
        for lw in self.layers:
            for t in vars(lw).values():
                if isinstance(t, Norm):
                    tensors += [x for x in (t.weight, t.bias) if x is not None]
                elif isinstance(t, (MoeWeights, MlaWeights)):
                    tensors += [x for x in vars(t).values() if x is not None]
                elif isinstance(t, torch.Tensor):
                    tensors.append(t)
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def _share_fused(ckpt: Checkpoint, w: dict[str, torch.Tensor], names: list[str], fused: torch.Tensor) -> None:
    """Hold the weights once: where the parts just concatenated into ``fused`` are the checkpoint's own
    tensors (the engine runs in the checkpoint's dtype and device, so ``w`` holds them unconverted),
    the checkpoint's entries become views of their rows of ``fused``. The values are the same bit for
    bit; the separate copies are freed, so q/k/v and gate/up (two thirds of a model) are not held
    twice, once by the checkpoint and once fused by the engine. A checkpoint whose weights are not a
    plain dict is left as it is."""
    weights = ckpt.weights
    if not isinstance(weights, dict) or any(weights.get(n) is not w[n] for n in names):
        return
    start = 0
    for n in names:
        rows = w[n].shape[0]
        weights[n] = w[n] = fused[start : start + rows]
        start += rows


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
    """``norm`` over the last dim of ``x`` (identity for None), computed in float32 or wider. A weight
    of more than one dim (``[H, D]``: a norm weight per head) multiplies after normalizing."""
    if norm is None:
        return x
    if norm.weight.dim() > 1:
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(work)
        if norm.kind == "layer":
            xf = F.layer_norm(xf, (x.shape[-1],), None, None, eps)
        else:
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = xf * norm.weight.to(work)
        return (out + norm.bias.to(work) if norm.bias is not None else out).to(x.dtype)
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


def project_qkv(
    cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw (pre-RoPE) q ``[n, H, D]``, k ``[n, KVH, D]``, v ``[n, KVH, D]`` from hidden ``h [n, hidden]``
    at ``positions [n]`` (needed where the layer scales its queries by position: llama4's temperature).

    llama4's L2 q/k norm runs here, before RoPE, although transformers runs it after: a rotation keeps
    each head's norm, so both give the same keys (the config refuses RoPE with an attention factor there)."""
    x = apply_norm(h, lw.attn_in, cfg.rms_norm_eps)
    if lw.mla is not None:
        return _mla_qkv(cfg, lw.mla, x)
    assert lw.qkv is not None  # every layer but MLA's has a fused qkv
    qkv = F.linear(x, lw.qkv, lw.qkv_bias)
    if cfg.clip_qkv is not None:
        qkv = qkv.clamp(-cfg.clip_qkv, cfg.clip_qkv)
    n, d = h.shape[0], cfg.head_dim
    q_end = cfg.num_heads * d
    k_end = q_end + cfg.num_kv_heads * d
    q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
    if lw.q_norm is not None and cfg.family.block.qk_norm == "projection":
        q = apply_norm(q, lw.q_norm, cfg.rms_norm_eps)
        k = apply_norm(k, lw.k_norm, cfg.rms_norm_eps)
    q = q.reshape(n, cfg.num_heads, d)
    k = k.reshape(n, cfg.num_kv_heads, d)
    v = v.reshape(n, cfg.num_kv_heads, d)
    if lw.q_norm is not None and cfg.family.block.qk_norm in ("head", "per_head", "l2"):
        q = apply_norm(q, lw.q_norm, cfg.rms_norm_eps)
        k = apply_norm(k, lw.k_norm, cfg.rms_norm_eps)
    if lw.temperature:
        if positions is None:
            raise ValueError("a layer with attention temperature tuning needs the query positions")
        q = q * query_temperature(cfg, positions).to(q.device, q.dtype)[:, None, None]
    return q, k, v


def _mla_qkv(cfg: ModelConfig, mw: MlaWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's raw q ``[n, H, D]``, expanded raw key ``[n, H, D]`` (per-head ``k_nope``, then the shared
    unrotated ``k_pe``: the contract's rope part, the last ``qk_rope_head_dim`` channels) and v
    ``[n, H, D]``: ``v_head_dim`` channels, zero-padded to ``D`` so that values share the keys' cache
    rows (the padding's attention output is zero and :func:`finish_layer` drops it)."""
    m, n, H = cfg.mla, x.shape[0], cfg.num_heads
    assert m is not None  # MLA weights come with an MLA config
    if mw.q is not None:
        q = F.linear(x, mw.q)
    else:
        assert mw.q_a is not None and mw.q_a_norm is not None and mw.q_b is not None  # the q_lora path
        q = F.linear(rms_norm(F.linear(x, mw.q_a, mw.q_a_bias), mw.q_a_norm, LATENT_NORM_EPS), mw.q_b)
    kv_a = F.linear(x, mw.kv_a, mw.kv_a_bias)  # [n, kv_lora_rank + rope]
    latent, k_pe = kv_a[:, : m.kv_lora_rank], kv_a[:, m.kv_lora_rank :]
    kv = F.linear(rms_norm(latent, mw.kv_a_norm, LATENT_NORM_EPS), mw.kv_b).view(n, H, -1)  # [n, H, nope + v]
    k = torch.cat((kv[..., : m.qk_nope_head_dim], k_pe[:, None, :].expand(n, H, m.qk_rope_head_dim)), dim=-1)
    v = F.pad(kv[..., m.qk_nope_head_dim :], (0, m.qk_head_dim - m.v_head_dim))
    return q.view(n, H, m.qk_head_dim), k, v


def query_temperature(cfg: ModelConfig, positions: torch.Tensor) -> torch.Tensor:
    """llama4's attention temperature ``[n]`` at ``positions [n]`` (arXiv 2501.19399), in float32 as
    transformers computes it: ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``."""
    p = positions.to(torch.float32)
    assert cfg.temperature_floor_scale is not None  # set wherever a layer tunes its temperature
    return torch.log1p(torch.floor((p + 1.0) / cfg.temperature_floor_scale)) * cfg.temperature_attn_scale + 1.0


def after_rope(cfg: ModelConfig, norm: Norm | None, x: torch.Tensor) -> torch.Tensor:
    """The per-head q/k norm of families that apply it after RoPE (hunyuan: the kernel multiplies
    ``norm(R(p) q)`` by ``norm(R(j) k)``, and the cache holds the latter); identity for every other."""
    if norm is None or cfg.family.block.qk_norm != "head_after_rope":
        return x
    return apply_norm(x, norm, cfg.rms_norm_eps)


def finish_layer(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Residual around attention (``attn_out [n, H, D]``) and the MLP; returns the next hidden state."""
    eps, scale = cfg.rms_norm_eps, cfg.residual_scale
    if cfg.mla is not None:  # the values' zero padding (see _mla_qkv)
        attn_out = attn_out[..., : cfg.mla.v_head_dim]
    a = apply_norm(F.linear(attn_out.reshape(h.shape[0], -1), lw.o, lw.o_bias), lw.attn_out, eps)
    if cfg.parallel:  # attention and MLP both read the block input: through attn_in, or the MLP's own norm
        m = _mlp(cfg, lw, apply_norm(h, lw.mlp_in if lw.mlp_in is not None else lw.attn_in, eps))
        return h + (a + m) * scale if scale != 1.0 else h + a + m
    h = h + a * scale if scale != 1.0 else h + a
    m = apply_norm(_mlp(cfg, lw, apply_norm(h, lw.mlp_in, eps)), lw.mlp_out, eps)
    return h + m * scale if scale != 1.0 else h + m


def _mlp(cfg: ModelConfig, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    if lw.moe is not None:
        return _moe(cfg, lw.moe, x)
    assert lw.gate_up is not None  # a dense MLP has its gate/up weights
    if cfg.family.block.mlp == "gated":
        gate, up = F.linear(x, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
        return F.linear(activation(gate, cfg.hidden_act) * up, lw.down, lw.down_bias)
    up = F.linear(x, lw.gate_up, lw.gate_up_bias)
    act = _xielu(up, *lw.xielu) if lw.xielu is not None else activation(up, cfg.hidden_act)
    return F.linear(act, lw.down, lw.down_bias)


def _xielu(
    x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: torch.Tensor, eps: torch.Tensor
) -> torch.Tensor:
    """xIELU with learned ``alpha_p``, ``alpha_n`` (through softplus) and fixed ``beta``, ``eps``."""
    a_n = beta + F.softplus(alpha_n)
    return torch.where(
        x > 0, F.softplus(alpha_p) * x * x + beta * x, (torch.expm1(torch.minimum(x, eps)) - x) * a_n + beta * x
    )


def _moe(cfg: ModelConfig, mw: MoeWeights, x: torch.Tensor) -> torch.Tensor:
    """Top-k routing of ``x [n, hidden]``; each expert runs once on the tokens routed to it."""
    spec = cfg.moe
    assert spec is not None  # MoE weights come with an MoE config
    logits = F.linear(x, mw.router, mw.router_bias).float()  # [n, E]
    weights, experts = _route(spec, mw, logits)
    scale_input = spec.router == "topk_sigmoid_input"  # llama4: the scores scale each expert's input
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        token, slot = torch.where(experts == e)
        w = weights[token, slot, None].to(x.dtype)
        xe = x[token] * w if scale_input else x[token]
        bias = None if mw.gate_up_bias is None else mw.gate_up_bias[e]
        gate, up = F.linear(xe, mw.gate_up[e], bias).chunk(2, dim=-1)
        y = F.linear(
            _expert_act(spec, cfg.hidden_act, gate, up), mw.down[e], None if mw.down_bias is None else mw.down_bias[e]
        )
        out.index_add_(0, token, y if scale_input else y * w)
    if mw.shared_gate_up is not None:
        assert mw.shared_down is not None  # a shared expert has both projections
        gate, up = F.linear(x, mw.shared_gate_up).chunk(2, dim=-1)
        shared = F.linear(activation(gate, cfg.hidden_act) * up, mw.shared_down)
        out = out + (shared if mw.shared_gate is None else torch.sigmoid(F.linear(x, mw.shared_gate)) * shared)
    if mw.experts_gate_up is not None:  # ungated shared experts
        assert mw.experts_down is not None
        gate, up = F.linear(x, mw.experts_gate_up, mw.experts_gate_up_bias).chunk(2, dim=-1)
        out = out + F.linear(activation(gate, cfg.hidden_act) * up, mw.experts_down, mw.experts_down_bias)
    return out


def _route(spec: MoeSpec, mw: MoeWeights, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights and experts ``[n, k]`` from float32 router ``logits [n, E]`` (models/moe.py)."""
    if spec.router == "topk_softmax":
        top, experts = logits.topk(spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    if spec.router == "topk_sigmoid_input":  # llama4: sigmoid of the top-k logits
        top, experts = logits.topk(spec.top_k, dim=-1)
        return torch.sigmoid(top), experts
    if spec.router == "softmax_topk":
        weights, experts = torch.softmax(logits, dim=-1).topk(spec.top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True) if spec.normalize else weights), experts
    n, E = logits.shape
    groups = (n, spec.num_groups, E // spec.num_groups)
    if spec.router == "softmax_greedy":
        weights, experts = torch.softmax(logits, dim=-1).topk(spec.top_k, dim=-1)
        return weights * spec.routed_scale, experts
    if spec.router == "softmax_group_limited":
        scores = torch.softmax(logits, dim=-1)
        best = scores.view(groups).amax(-1).topk(spec.top_groups, dim=-1).indices  # [n, topk_group]
        keep = torch.zeros(groups[:2], dtype=torch.bool, device=logits.device).scatter_(1, best, True)
        weights, experts = scores.masked_fill(~keep.repeat_interleave(groups[2], dim=1), 0.0).topk(spec.top_k, dim=-1)
        return weights * spec.routed_scale, experts
    scores = torch.sigmoid(logits)  # sigmoid_group
    assert mw.correction_bias is not None  # a sigmoid_group router has its correction bias
    choice = scores + mw.correction_bias.float()
    best = choice.view(groups).topk(2, dim=-1).values.sum(-1).topk(spec.top_groups, dim=-1).indices
    keep = torch.zeros(groups[:2], dtype=torch.bool, device=logits.device).scatter_(1, best, True)
    experts = (
        choice.masked_fill(~keep.repeat_interleave(groups[2], dim=1), float("-inf")).topk(spec.top_k, dim=-1).indices
    )
    weights = scores.gather(1, experts)
    if spec.normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scale, experts


def _expert_act(spec: MoeSpec, act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up``, or gpt_oss's clamped SwiGLU where the spec has a limit (models/moe.py)."""
    if spec.swiglu_limit is None or spec.swiglu_alpha is None:  # both or neither (MoeSpec)
        return activation(gate, act) * up
    gate = gate.clamp(max=spec.swiglu_limit)
    up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))


def final_logits(cfg: ModelConfig, weights: DecoderWeights, h: torch.Tensor) -> torch.Tensor:
    """Logits ``[n, vocab]`` in float32 from the last hidden state ``h [n, hidden]``."""
    logits = F.linear(
        apply_norm(h, weights.final_norm, cfg.rms_norm_eps), weights.lm_head, weights.lm_head_bias
    ).float()
    if cfg.logits_scale != 1.0:
        logits = logits * cfg.logits_scale
    if cfg.final_softcap is not None:
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits
