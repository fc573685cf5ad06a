"""The independent reference: a cache-free full forward of any described checkpoint.

Everything else in ropekv (the engine, its caches, the attention backends, an adapted foreign engine)
is judged against this file, so it is written to be obviously right rather than fast: one token
sequence, no KV cache, no fused kernels, every step spelled out, all arithmetic in one ``dtype``
(float64 by default). It shares only the pure RoPE functions (:mod:`ropekv.rope`) and the model
config -- with the decoder description it names (:mod:`ropekv.models.families`) -- with the engine.

Architecture (transformers' ``LlamaForCausalLM`` as the template; the description says where a
family differs): token embedding times ``embedding_scale``; per layer
``x += s * norm_out(o_proj(attention(norm_in(x))))`` then ``x += s * norm_out(mlp(norm_in(x)))``
(``s`` = ``residual_scale``; absent norm slots are the identity; ``parallel`` families add attention
and MLP of the same input norm); the MLP is gated (``down(act(gate(h)) * up(h))``), plain
(``down(act(up(h)))``) or a mixture of experts (:mod:`ropekv.models.moe`); q/k norms per head or
over the whole projection, before RoPE (hunyuan: per head, after it); each layer turns with its own
RoPE or none (NoPE); scores times ``attn_scale``, soft-capped where the family caps; learned sink logits in the softmax
denominator where the model has them (gpt_oss); final norm; lm_head, times
``logits_scale``, soft-capped. Query head ``h`` reads key/value head ``h // (num_heads //
num_kv_heads)`` (grouped-query attention).

Differences from transformers that are deliberate: norms are computed in ``dtype`` (HF upcasts to
float32 and casts back), and RoPE angles come from float64 (HF uses float32), so a float64 run is a
better reference than HF itself.

Memory: the weights are never held in ``dtype`` all at once. A forward streams them: each layer's
tensors are converted from the checkpoint when that layer runs over every row and dropped after it,
the embedding is converted at the looked-up rows only and the LM head in blocks of vocabulary rows
(:data:`HEAD_BLOCK_BYTES`). Beyond the checkpoint itself (which the engine under test shares) a
float64 forward holds its hidden states plus one layer's weights, whatever the model's size (a 3B
model is 25.7 GB in float64; one of its layers 0.8 GB).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ..attention_kind import MODEL_WINDOWS, ModelWindows
from ..errors import UsageError
from ..probe import LayerProbe
from ..rope import PositionStreams
from .config import Checkpoint, ModelConfig
from .mla import LATENT_NORM_EPS, MlaSpec

_QUERY_BLOCK = 256  # queries per attention block: bounds memory at [H, block, T] scores
HEAD_BLOCK_BYTES = 64 << 20  # LM head rows converted to the reference dtype at once (a block of the vocabulary)
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True, eq=False)
class ReferenceOutput:
    logits: torch.Tensor  # [T, vocab] in the decoder's dtype; [R, vocab] of the probed rows under logits="probed"
    rows: torch.Tensor | None = None  # [R] the probed positions, when probe_rows was given
    probed_logits: bool = False  # logits holds the probed rows only, in probe_rows order
    layers: tuple[LayerProbe, ...] = ()  # one per layer when probe_rows was given, else empty


class ReferenceDecoder:
    """Full forward of ``checkpoint`` in ``dtype``; weights are converted as they are used, one layer at
    a time (module docstring), so the decoder itself holds no weights between forwards."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype = torch.float64):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise UsageError(f"reference dtype must be a floating torch dtype, got {dtype!r}")
        self.checkpoint = checkpoint
        self.config: ModelConfig = checkpoint.config
        self.dtype = dtype
        # The tensor names of each layer, and of the rest but the embedding and head (final norm, head bias).
        layers: list[list[str]] = [[] for _ in range(self.config.num_layers)]
        rest = []
        for name in checkpoint.weights:
            layer = _layer_of(name)
            if layer is not None and layer < len(layers):
                layers[layer].append(name)
            elif name not in (_EMBED, _HEAD):
                rest.append(name)
        self._layer_names, self._rest_names = layers, rest
        # The weights of the part of the forward being computed, in ``dtype``: one layer's, or the final
        # ones; empty between forwards. The pieces below (_linear, _norm, ...) read them by name.
        self._w: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ public

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor | Sequence[int],
        *,
        probe_rows: torch.Tensor | Sequence[int] | None = None,
        window: int | ModelWindows | None = MODEL_WINDOWS,
        sink_tokens: int = 0,
        positions: torch.Tensor | Sequence[int] | None = None,
        key_mask: torch.Tensor | None = None,
        logits_for: Literal["all", "probed"] = "all",
        streams: PositionStreams | None = None,
        num_layers: int | None = None,
    ) -> ReferenceOutput:
        """Logits ``[T, vocab]`` for ``tokens [T]`` at positions ``0..T-1``, plus per-layer probes.

        ``window=MODEL_WINDOWS`` gives each layer its configured window; an int applies that window to
        every layer (and no chunks); None means full causal attention. Key ``j`` is visible to query
        ``i`` iff ``j <= i`` and (no window, or ``i - W < j``, or ``j < sink_tokens``); on a chunked
        layer (``MODEL_WINDOWS`` only) also ``j >= floor(i / C) * C``, by position. Length-dependent RoPE
        (dynamic NTK, LongRoPE) uses ``seq_len = T``, as transformers does for a full forward.

        Cache operations (docs/ops.md) need two more things, both optional: ``positions [T]`` (strictly
        increasing logical positions to rotate at instead of ``0..T-1``, e.g. a shifted sequence; the
        mask stays by token order, and ``rows`` in the output are then the probed tokens' positions)
        and ``key_mask [T, T]`` (bool, False hides key ``j`` from query ``i`` on top of the causal and
        window mask: evicted keys for the rows after an eviction).

        ``streams`` (an mRoPE model): the tokens' three position streams by index (image-like positions,
        as Qwen2-VL's ``get_rope_index`` gives them); the rotation of an mRoPE layer turns each section
        by its stream of each token's position, everything else (mask, rows) stays by position.

        ``logits_for="probed"`` (with ``probe_rows``) computes the logits of the probed rows only: a check
        compares a few rows, and all rows of an 8,190-token forward are 3.2 GB of float64 logits.

        ``num_layers`` (1 to the model's count) runs only the first layers and no head: the probes of those
        layers, and ``logits`` empty ``[0, vocab]``. The reference cache recomputes layer 0 of every row
        it reads this way, at a fraction of a forward's cost (:mod:`ropekv.parity.reference_cache`).
        """
        cfg = self.config
        tokens = self._check_tokens(tokens)
        T = tokens.shape[0]
        if num_layers is not None and (
            isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= cfg.num_layers
        ):
            raise UsageError(f"num_layers must be an integer from 1 to {cfg.num_layers}, got {num_layers!r}")
        rows = None if probe_rows is None else self._check_rows(probe_rows, T)
        if logits_for not in ("all", "probed") or (logits_for == "probed" and rows is None):  # before any work
            raise UsageError(f"logits_for must be 'all', or 'probed' with probe_rows; got {logits_for!r}")
        windows = self._layer_windows(window)
        chunks = [self.config.layer_chunk(i) if window == MODEL_WINDOWS else None for i in range(cfg.num_layers)]
        if not isinstance(sink_tokens, int) or isinstance(sink_tokens, bool) or sink_tokens < 0:
            raise UsageError(f"sink_tokens must be a non-negative integer, got {sink_tokens!r}")

        positions = torch.arange(T) if positions is None else self._check_positions(positions, T)
        if key_mask is not None and (
            not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool or tuple(key_mask.shape) != (T, T)
        ):
            raise UsageError(f"key_mask must be a bool tensor [{T}, {T}]")
        if streams is not None and not isinstance(streams, PositionStreams):
            raise UsageError(f"streams must be PositionStreams, got {type(streams).__name__}")
        ropes = [cfg.layer_rope(i) for i in range(cfg.num_layers)]
        if streams is not None and all(r is None or r.mrope_section is None for r in ropes):
            raise UsageError("mRoPE position streams need an mRoPE model (rope mrope_section); this one has none")
        rotate_at = positions if streams is None else streams.at(positions)  # [T] or [3, T]
        try:
            return self._stream(
                tokens, rows, windows, chunks, sink_tokens, positions, key_mask, logits_for, rotate_at, num_layers
            )
        finally:
            self._w = {}  # drop the last part's converted weights, also when a forward fails

    def _stream(
        self,
        tokens: torch.Tensor,
        rows: torch.Tensor | None,
        windows: list[int | None],
        chunks: list[int | None],
        sink_tokens: int,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        logits_for: str,
        rotate_at: torch.Tensor,
        num_layers: int | None,
    ) -> ReferenceOutput:
        """The forward of :meth:`forward` on checked arguments, one layer's weights converted at a time."""
        cfg, T = self.config, tokens.shape[0]
        index = torch.arange(T)  # visibility is by index (positions only rotate; they increase with it)
        fam = cfg.family
        attn_in, attn_out_norm, mlp_in, mlp_out_norm = cfg.norm_slots
        # Row lookup then conversion: the same values as converting the whole table, for T rows' bytes.
        x = _convert(self.checkpoint.weights[_EMBED][tokens], self.dtype) * cfg.embedding_scale  # [T, hidden]
        probes = []
        for layer in range(cfg.num_layers if num_layers is None else num_layers):
            p = f"model.layers.{layer}."
            self._w = {}  # the previous layer's weights go before this layer's are converted
            self._w = self._take(self._layer_names[layer])
            hidden_in = x
            h = self._norm(x, p, attn_in)
            if cfg.mla is not None:
                q, k, v = self._mla_qkv(cfg.mla, h, p)  # [T, H, D], [T, H, D], [T, H, v_head_dim]
            else:
                q, k, v = self._qkv(h, p)  # [T, H, D], [T, KVH, D], [T, KVH, D]
            rope = cfg.layer_rope(layer)  # None: a NoPE layer
            floor_scale = cfg.temperature_floor_scale  # set wherever layer_temperature is true
            if cfg.layer_temperature(layer) and floor_scale is not None:
                # llama4 NoPE layers: q * (log1p(floor((p + 1) / f)) * s + 1)
                temp = torch.log1p(torch.floor((positions.to(self.dtype) + 1) / floor_scale))
                q = q * (temp * cfg.temperature_attn_scale + 1)[:, None, None]
            at = rotate_at if rope is not None and rope.mrope_section is not None else positions
            q_rot = rope.rotate(q, at, seq_len=T) if rope is not None else q  # [T, H, D]
            k_rot = rope.rotate(k, at, seq_len=T) if rope is not None else k  # [T, KVH, D]
            if fam.block.qk_norm == "l2" and cfg.layer_qk_norm(layer):
                # llama4 normalizes after RoPE, as here; the probes' raw q/k are the normalized ones before
                # RoPE (what a raw-key cache holds), equal to these turned back since a rotation keeps norms.
                q_rot, k_rot, q, k = _l2(q_rot, cfg), _l2(k_rot, cfg), _l2(q, cfg), _l2(k, cfg)
            if cfg.qk_norm and fam.block.qk_norm == "head_after_rope":  # hunyuan: the kernel sees norm(R(p) x)
                q_rot = self._norm(q_rot, p, "self_attn.q_norm")
                k_rot = self._norm(k_rot, p, "self_attn.k_norm")

            attn = torch.empty(T, cfg.num_heads, v.shape[-1], dtype=self.dtype)
            kv_head = torch.arange(cfg.num_heads) // (cfg.num_heads // cfg.num_kv_heads)  # [H]
            k_heads, v_heads = k_rot[:, kv_head], v[:, kv_head]  # [T, H, D]: query head h reads KV head kv_head[h]
            sinks = self._w[p + "self_attn.sinks"] if cfg.attention_sinks else None  # [H] learned logits
            window, chunk = windows[layer], chunks[layer]
            block = self._query_block(_band_width(T, window, chunk, sink_tokens))
            for start in range(0, T, block):
                stop = min(T, start + block)  # causal: no query of the block sees a key at or past `stop`
                # A sliding or chunked layer reads only its band of keys: its cost grows with T x window.
                keys = band(start, stop, window, sink_tokens, chunk, positions)  # [K] ascending key indices
                scores = self._attn_logits(
                    q_rot[start:stop],
                    index[start:stop],
                    _take_rows(k_heads, keys),
                    window,
                    sink_tokens,
                    chunk,
                    positions,
                    keys,
                )
                if key_mask is not None:  # [block, K] extra visibility (evicted keys)
                    scores = scores.masked_fill(~_take_cols(key_mask[start:stop], keys)[None], float("-inf"))
                attn[start:stop] = self._attend(scores, _take_rows(v_heads, keys), sinks)
            attn_out = self._norm(self._linear(attn.reshape(T, -1), p + "self_attn.o_proj"), p, attn_out_norm)
            if cfg.parallel:  # attention and MLP both read the block input (through one norm, or each its own)
                mlp_h = self._norm(hidden_in, p, mlp_in) if mlp_in is not None else h
                x = x + (attn_out + self._mlp(mlp_h, p, layer)) * cfg.residual_scale
            else:
                x = x + attn_out * cfg.residual_scale
                mlp_out = self._mlp(self._norm(x, p, mlp_in), p, layer)
                x = x + self._norm(mlp_out, p, mlp_out_norm) * cfg.residual_scale

            if rows is not None:
                probes.append(
                    LayerProbe(
                        q=q_rot[rows].clone(),
                        k=k_rot,
                        key_positions=positions,
                        hidden_in=hidden_in[rows].clone(),
                        q_raw=q[rows].clone(),
                        k_raw=k,
                        v=v,
                    )
                )

        self._w = {}
        logits_of_rows = logits_for == "probed"
        if num_layers is not None and num_layers < cfg.num_layers:  # the first layers only: no head
            return ReferenceOutput(
                logits=torch.empty(0, cfg.vocab_size, dtype=self.dtype),
                rows=None if rows is None else positions[rows],
                layers=tuple(probes),
                probed_logits=logits_of_rows,
            )
        self._w = self._take(self._rest_names)  # final norm, head bias
        if logits_of_rows:
            x = x[rows]  # [R, hidden]
        x = self._norm(x, "", fam.block.final_norm)
        logits = self._head(x, _EMBED if cfg.tie_word_embeddings else _HEAD)  # [T or R, vocab]
        if "lm_head.bias" in self._w:  # phi, gptj
            logits = logits + self._w["lm_head.bias"]
        logits = logits * cfg.logits_scale
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return ReferenceOutput(
            logits=logits,
            rows=None if rows is None else positions[rows],
            layers=tuple(probes),
            probed_logits=logits_of_rows,
        )

    def next_token(self, tokens: torch.Tensor | Sequence[int]) -> int:
        """Greedy next token after ``tokens`` (argmax of the last row of the logits)."""
        return int(self.forward(tokens).logits[-1].argmax())

    # ------------------------------------------------------------------ pieces

    def _take(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors ``names`` in the reference dtype (copies: nothing aliases the
        checkpoint's, which the engine under test shares)."""
        weights = self.checkpoint.weights
        return {name: _convert(weights[name], self.dtype) for name in names}

    def _head(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x [N, hidden] @ W.T`` for the LM head ``name``, converting a block of its vocabulary rows
        at a time (a 128k-token head is 3.2 GB in float64); one block when the head is small."""
        weight = self.checkpoint.weights[name]
        vocab, hidden = weight.shape
        block = max(1, HEAD_BLOCK_BYTES // (hidden * torch.finfo(self.dtype).bits // 8))
        if block >= vocab:
            return x @ _convert(weight, self.dtype).T
        out = torch.empty(x.shape[0], vocab, dtype=self.dtype)
        for start in range(0, vocab, block):
            stop = min(vocab, start + block)
            out[:, start:stop] = x @ _convert(weight[start:stop], self.dtype).T
        return out

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x @ W.T (+ b)`` for the module ``name``; the bias exists iff the checkpoint has it
        (the checkpoint was validated against the config, so this follows the config's bias flags)."""
        out = x @ self._w[name + ".weight"].T
        bias = self._w.get(name + ".bias")
        return out + bias if bias is not None else out

    def _qkv(self, h: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw q ``[T, H, D]``, k ``[T, KVH, D]``, v ``[T, KVH, D]`` of separate q/k/v projections, with the
        family's q/k norms (over the whole projection, or per head)."""
        cfg, fam, T = self.config, self.config.family, h.shape[0]
        q = self._linear(h, p + "self_attn.q_proj")  # [T, H * D]
        k = self._linear(h, p + "self_attn.k_proj")  # [T, KVH * D]
        v = self._linear(h, p + "self_attn.v_proj")  # [T, KVH * D]
        if cfg.clip_qkv is not None:  # olmo: a model feature, clamped before anything else
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm and fam.block.qk_norm == "projection":  # olmo2: over the whole projection
            q = self._norm(q, p, "self_attn.q_norm")
            k = self._norm(k, p, "self_attn.k_norm")
        q = q.view(T, cfg.num_heads, cfg.head_dim)
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm and fam.block.qk_norm in ("head", "per_head"):  # per_head: weights [H, D] / [KVH, D]
            q = self._norm(q, p, "self_attn.q_norm")
            k = self._norm(k, p, "self_attn.k_norm")
        return q, k, v

    def _mla_qkv(self, m: MlaSpec, h: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Multi-head latent attention (models/mla.py): raw q ``[T, H, nope + rope]``, the expanded raw
        key ``[T, H, nope + rope]`` (per-head ``k_nope``, then the one shared ``k_pe``, not yet rotated)
        and v ``[T, H, v_head_dim]``, from the compressed latent as transformers computes them."""
        T, H, a = h.shape[0], self.config.num_heads, p + "self_attn."
        if m.q_lora_rank is None:
            q = self._linear(h, a + "q_proj")
        else:
            q = self._linear(self._rms(self._linear(h, a + "q_a_proj"), a + "q_a_layernorm.weight"), a + "q_b_proj")
        q = q.view(T, H, m.qk_head_dim)
        latent, k_pe = self._linear(h, a + "kv_a_proj_with_mqa").split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self._linear(self._rms(latent, a + "kv_a_layernorm.weight"), a + "kv_b_proj")  # [T, H * (nope + v)]
        k_nope, v = kv.view(T, H, m.qk_nope_head_dim + m.v_head_dim).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(T, H, m.qk_rope_head_dim)), dim=-1)
        return q, k, v

    def _rms(self, x: torch.Tensor, weight: str) -> torch.Tensor:
        """MLA's latent RMSNorms: ``x / sqrt(mean(x^2) + 1e-6) * w`` (their eps is the class default)."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + LATENT_NORM_EPS) * self._w[weight]

    def _norm(self, x: torch.Tensor, prefix: str, name: str | None) -> torch.Tensor:
        """The family's norm over the last dim with the tensors ``prefix + name`` (.weight, .bias);
        ``name`` None: no norm in this slot (identity).

        - ``rms``: ``x / sqrt(mean(x^2) + eps) * w``; ``rms_offset`` (gemma): times ``1 + w``;
        - ``layer``: ``(x - mean) / sqrt(var + eps) * w (+ b)``; ``layer_offset`` (nemotron): ``1 + w``;
          ``layer_plain`` (olmo): no weight, no bias.
        """
        if name is None:
            return x
        kind, eps = self.config.family.block.norm, self.config.rms_norm_eps
        weight = 1.0 if kind == "layer_plain" else self._w[prefix + name + ".weight"]
        if kind in ("rms_offset", "layer_offset"):
            weight = 1.0 + weight
        if kind in ("layer", "layer_offset", "layer_plain"):
            x = x - x.mean(-1, keepdim=True)
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
        bias = self._w.get(prefix + name + ".bias")
        return out + bias if bias is not None else out

    def _mlp(self, h: torch.Tensor, p: str, layer: int) -> torch.Tensor:
        """``down(act(gate(h)) * up(h))`` (gated) or ``down(act(up(h)))`` (plain); the MoE where
        the layer has one."""
        moe = self.config.layer_moe(layer)
        if moe is not None:
            return self._moe(h, p, moe)
        return self._dense_mlp(h, p + "mlp.")

    def _dense_mlp(self, h: torch.Tensor, p: str) -> torch.Tensor:
        up = self._linear(h, p + "up_proj")
        if self.config.family.block.mlp == "gated":
            up = _activation(self._linear(h, p + "gate_proj"), self.config.hidden_act) * up
        elif self.config.hidden_act == "xielu":
            up = self._xielu(up, p + "act_fn.")
        else:
            up = _activation(up, self.config.hidden_act)
        return self._linear(up, p + "down_proj")

    def _xielu(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """xIELU (arXiv 2411.13010) with the layer's learned parameters: ``a_p = softplus(alpha_p)``,
        ``a_n = beta + softplus(alpha_n)``; ``a_p x^2 + beta x`` for ``x > 0``, else
        ``a_n (exp(min(x, eps)) - 1 - x) + beta x``."""
        w = {n: self._w[p + n] for n in ("alpha_p", "alpha_n", "beta", "eps")}
        alpha_p = torch.log1p(torch.exp(w["alpha_p"]))
        alpha_n = w["beta"] + torch.log1p(torch.exp(w["alpha_n"]))
        negative = alpha_n * (torch.expm1(torch.minimum(x, w["eps"])) - x)
        return torch.where(x > 0, alpha_p * x * x, negative) + w["beta"] * x

    def _moe(self, h: torch.Tensor, p: str, moe) -> torch.Tensor:
        """Route each token ``h [T, hidden]`` to its top-k experts and sum their gated MLPs by weight
        (models/moe.py); token by token, expert by expert."""
        router_logits = h @ self._w[p + "mlp.gate.weight"].T  # [T, E]
        if moe.bias:  # gpt_oss
            router_logits = router_logits + self._w[p + "mlp.gate.bias"]
        weights, experts = self._route(router_logits, p, moe)  # [T, k] each
        gate_up, down = self._w[p + "mlp.experts.gate_up_proj"], self._w[p + "mlp.experts.down_proj"]
        gate_up_b = self._w.get(p + "mlp.experts.gate_up_proj_bias")  # [E, 2I] (gpt_oss) or None
        down_b = self._w.get(p + "mlp.experts.down_proj_bias")  # [E, hidden] or None
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            for e, w in zip(experts[t].tolist(), weights[t]):
                scale_input = moe.router == "topk_sigmoid_input"  # llama4: the score scales the expert's input
                gu = gate_up[e] @ (w * h[t] if scale_input else h[t])
                if gate_up_b is not None:
                    gu = gu + gate_up_b[e]
                gate, up = gu.chunk(2)
                if moe.swiglu_limit is not None:  # gpt_oss: clamp, then (up + 1) * gate * sigmoid(alpha * gate)
                    gate = gate.clamp(max=moe.swiglu_limit)
                    up = up.clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
                    mixed = (up + 1) * gate * torch.sigmoid(moe.swiglu_alpha * gate)
                else:
                    mixed = _activation(gate, self.config.hidden_act) * up
                y = down[e] @ mixed
                if down_b is not None:
                    y = y + down_b[e]
                out[t] += y if scale_input else w * y
        if moe.shared_expert_size is not None:
            shared = self._dense_mlp(h, p + "mlp.shared_expert.")
            if moe.shared_expert_gated:
                shared = torch.sigmoid(h @ self._w[p + "mlp.shared_expert_gate.weight"].T) * shared
            out = out + shared
        if moe.shared_experts_size is not None:  # deepseek / glm4_moe: ungated shared experts
            out = out + self._dense_mlp(h, p + "mlp.shared_experts.")
        return out

    def _route(self, logits: torch.Tensor, p: str, moe) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing weights and experts ``[T, k]`` of router ``logits [T, E]`` (models/moe.py)."""
        if moe.router == "topk_softmax":
            top, experts = logits.topk(moe.top_k, dim=-1)
            return torch.softmax(top, dim=-1), experts
        if moe.router == "topk_sigmoid_input":  # llama4: sigmoid of the top-k logits (they scale the input)
            top, experts = logits.topk(moe.top_k, dim=-1)
            return torch.sigmoid(top), experts
        T, E, G = logits.shape[0], logits.shape[1], moe.num_groups
        if moe.router == "sigmoid_group":
            scores = torch.sigmoid(logits)
            choice = scores + self._w[p + "mlp.gate.e_score_correction_bias"]
            group_rank = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)  # [T, G]
        else:
            scores = choice = torch.softmax(logits, dim=-1)
            group_rank = choice.view(T, G, E // G).max(-1).values
        if moe.router in ("sigmoid_group", "softmax_group_limited"):
            kept = torch.zeros(T, G, dtype=torch.bool)
            kept.scatter_(1, group_rank.topk(moe.top_groups, dim=-1).indices, True)
            hidden = ~kept[:, :, None].expand(T, G, E // G).reshape(T, E)
            fill = float("-inf") if moe.router == "sigmoid_group" else 0.0
            choice = choice.masked_fill(hidden, fill)
        experts = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if moe.router == "softmax_topk":
            if moe.normalize:
                weights = weights / weights.sum(-1, keepdim=True)
            return weights, experts
        if moe.router == "sigmoid_group" and moe.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scale, experts

    def _query_block(self, num_keys: int) -> int:
        """Queries per attention block: their ``[H, block, T]`` scores stay near 16 MiB, so a long
        context never holds scores for every query at once and each block's temporaries are reused
        (large fresh tensors are mapped and faulted in afresh on every allocation)."""
        per_query = self.config.num_heads * num_keys * torch.finfo(self.dtype).bits // 8
        return max(1, min(_QUERY_BLOCK, (16 << 20) // per_query))

    def _attn_logits(
        self,
        q_rot: torch.Tensor,
        rows: torch.Tensor,
        k_heads: torch.Tensor,
        window: int | None,
        sinks: int,
        chunk: int | None = None,
        positions: torch.Tensor | None = None,
        keys: Band | None = None,
    ) -> torch.Tensor:
        """Scaled, masked scores ``[H, R, K]`` of queries ``q_rot [R, H, D]`` at ``rows`` against the
        keys ``k_heads [K, H, D]`` (already repeated per query head), the keys at indices ``keys`` (None:
        ``0..K-1``); ``chunk``: a chunked layer, whose chunks are cut by the tokens' ``positions``."""
        cfg = self.config
        scores = torch.einsum("rhd,thd->hrt", q_rot, k_heads) * cfg.attn_scale
        if cfg.attn_softcap is not None:  # gemma2: cap * tanh(scores / cap), before the mask
            scores = torch.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
        mask = visible(
            rows, k_heads.shape[0], window, sinks, chunk, positions, None if keys is None else keys.indices()
        )
        return scores.masked_fill(~mask, float("-inf"))

    def _attend(self, scores: torch.Tensor, v_heads: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """Softmax ``scores [H, R, T]`` over keys and mix ``v_heads [T, H, D]`` -> ``[R, H, D]``.

        ``sinks [H]`` (gpt_oss): head ``h``'s learned logit is one more column of the softmax, dropped
        after it, so the weights on the keys sum to ``1 - p_sink``."""
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks[:, None, None].expand(scores.shape[0], scores.shape[1], 1)  # [H, R, 1]
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("hrt,thd->rhd", probs, v_heads)

    # ------------------------------------------------------------------ argument checks

    def _check_tokens(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        t = torch.as_tensor(tokens)
        if t.dim() != 1 or t.numel() == 0 or t.is_floating_point() or t.dtype == torch.bool:
            raise UsageError(f"tokens must be a non-empty 1-D integer tensor [T], got shape {tuple(t.shape)} {t.dtype}")
        t = t.to(torch.int64).cpu()
        if int(t.min()) < 0 or int(t.max()) >= self.config.vocab_size:
            raise UsageError(f"token ids must be in [0, {self.config.vocab_size}), got {int(t.min())}..{int(t.max())}")
        return t

    @staticmethod
    def _check_positions(positions: torch.Tensor | Sequence[int], T: int) -> torch.Tensor:
        p = torch.as_tensor(positions)
        if p.dim() != 1 or p.numel() != T or p.is_floating_point() or p.dtype == torch.bool:
            raise UsageError(f"positions must be a 1-D integer tensor [{T}], got shape {tuple(p.shape)} {p.dtype}")
        p = p.to(torch.int64).cpu()
        if int(p.min()) < 0 or (T > 1 and not bool((p[1:] > p[:-1]).all())):
            raise UsageError("positions must be >= 0 and strictly increasing")
        return p

    @staticmethod
    def _check_rows(probe_rows: torch.Tensor | Sequence[int], T: int) -> torch.Tensor:
        r = torch.as_tensor(probe_rows)
        if r.dim() != 1 or r.is_floating_point() or r.dtype == torch.bool:
            raise UsageError(f"probe_rows must be a 1-D integer tensor [R], got shape {tuple(r.shape)} {r.dtype}")
        r = r.to(torch.int64).cpu()
        if r.numel() and (int(r.min()) < 0 or int(r.max()) >= T):
            raise UsageError(f"probe_rows must be in [0, {T}), got {r.tolist()}")
        return r

    def _layer_windows(self, window: int | ModelWindows | None) -> list[int | None]:
        n = self.config.num_layers
        if isinstance(window, str):  # MODEL_WINDOWS (a str enum: "model" reads the same)
            if window != MODEL_WINDOWS:
                raise UsageError(f"window must be 'model', None or a positive integer, got {window!r}")
            return [self.config.layer_window(i) for i in range(n)]
        if window is None:
            return [None] * n
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise UsageError(f"window must be 'model', None or a positive integer, got {window!r}")
        return [window] * n


def _convert(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of a checkpoint tensor in ``dtype``: every weight the reference computes with is made
    here, and lives only as long as the part of the forward that reads it."""
    return tensor.detach().to(dtype=dtype, copy=True)


def _layer_of(name: str) -> int | None:
    """The layer index of ``model.layers.{i}.*``, else None."""
    head, _, rest = name.partition("model.layers.")
    index = rest.split(".", 1)[0]
    return int(index) if head == "" and index.isdigit() and "." in rest else None


def _l2(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """llama4's ``Llama4TextL2Norm`` over the last dim: ``x / sqrt(mean(x^2) + eps)``, no weights."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)


def _activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """transformers' ``ACT2FN[name]``, written out: ``gelu_pytorch_tanh`` and ``gelu_new`` are the
    tanh approximation, ``gelu`` the exact erf form, ``relu2`` is ``relu(x) ** 2``."""
    if name == "silu":
        return x * torch.sigmoid(x)
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    if name == "relu":
        return torch.clamp(x, min=0)
    if name == "relu2":
        return torch.clamp(x, min=0).pow(2)
    raise UsageError(f"activation {name!r} is not implemented")


def visible(
    rows: torch.Tensor,
    num_keys: int,
    window: int | None,
    sink_tokens: int = 0,
    chunk: int | None = None,
    positions: torch.Tensor | None = None,
    key_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask ``[R, num_keys]``: key ``j`` visible to the query at position ``i = rows[r]`` iff
    ``j <= i`` and (``window`` is None, or ``i - window < j``, or ``j < sink_tokens``), and on a
    chunked layer the key's position is in the query's chunk: ``pos(j) >= (pos(i) // chunk) * chunk``
    (``positions [T]``: the tokens' positions; None: positions are the indices). ``key_index
    [num_keys]``: the keys' indices (a band); None: ``0..num_keys-1``."""
    i = rows[:, None]
    keys = torch.arange(num_keys) if key_index is None else key_index
    j = keys[None, :]
    mask = j <= i
    if window is not None:
        mask &= (j > i - window) | (j < sink_tokens)
    if chunk is not None:
        top = max(int(keys.max()) + 1 if keys.numel() else 0, int(rows.max()) + 1 if rows.numel() else 0)
        pos = torch.arange(top) if positions is None else positions
        qpos, kpos = pos[rows][:, None], pos[keys][None, :]
        mask &= kpos >= (qpos // chunk) * chunk
    return mask


@dataclass(frozen=True)
class Band:
    """The keys a block of queries can see, as two index ranges: ``head_lo..head_hi-1`` (a sliding
    layer's sink tokens below its band; empty elsewhere) then ``lo..stop-1``."""

    head_lo: int
    head_hi: int
    lo: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.head_lo <= self.head_hi <= self.lo <= self.stop:
            raise ValueError(f"band needs 0 <= head_lo <= head_hi <= lo <= stop, got {self}")

    def indices(self) -> torch.Tensor:
        return torch.cat([torch.arange(self.head_lo, self.head_hi), torch.arange(self.lo, self.stop)])  # [K]


def band(
    start: int, stop: int, window: int | None, sink_tokens: int, chunk: int | None, positions: torch.Tensor
) -> Band:
    """The keys the queries at indices ``start..stop-1`` may see: every key below ``stop`` on a global
    layer; on a sliding layer ``start - window + 1 .. stop - 1`` and the sink tokens; on a chunked layer
    the keys from the first query's chunk on (``positions [T]`` ascending with the index, as the
    reference's tokens are). A superset of what :func:`visible` lets through, never a subset."""
    chunk_lo = 0
    if chunk is not None:
        first = (int(positions[start]) // chunk) * chunk
        chunk_lo = int(torch.searchsorted(positions[:stop].contiguous(), first))
    lo = max(chunk_lo, start - window + 1) if window is not None else chunk_lo
    head_hi = max(chunk_lo, min(sink_tokens, lo)) if window is not None else chunk_lo
    return Band(chunk_lo, head_hi, lo, stop)


def _band_width(T: int, window: int | None, chunk: int | None, sink_tokens: int) -> int:
    """The most keys one query of a layer reads: what sizes its query blocks."""
    width = T
    if window is not None:
        width = min(width, window + sink_tokens + _QUERY_BLOCK)
    if chunk is not None:
        width = min(width, chunk + _QUERY_BLOCK)
    return width


def _take_rows(x: torch.Tensor, keys: Band) -> torch.Tensor:
    """Rows ``keys`` of ``x [T, ...]``: a view of the range, the sinks joined in front when there are any."""
    body = x[keys.lo : keys.stop]
    return body if keys.head_hi == keys.head_lo else torch.cat([x[keys.head_lo : keys.head_hi], body])


def _take_cols(x: torch.Tensor, keys: Band) -> torch.Tensor:
    """Columns ``keys`` of ``x [R, T]``."""
    body = x[:, keys.lo : keys.stop]
    return body if keys.head_hi == keys.head_lo else torch.cat([x[:, keys.head_lo : keys.head_hi], body], dim=1)
