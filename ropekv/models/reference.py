"""The independent reference: a cache-free full forward of a llama-family checkpoint.

Everything else in ropekv (the engine, its caches, the attention backends, an adapted foreign engine)
is judged against this file, so it is written to be obviously right rather than fast: one token
sequence, no KV cache, no fused kernels, every step spelled out, all arithmetic in one ``dtype``
(float64 by default). It shares only the pure RoPE functions (:mod:`ropekv.rope`) and the model
config with the engine.

Architecture (transformers' ``LlamaForCausalLM`` and its mistral / qwen2 / qwen3 relatives): token
embedding; per layer ``x += o_proj(attention(rms_norm(x)))`` then
``x += down_proj(silu(gate_proj(h)) * up_proj(h))`` with ``h = rms_norm(x)``; final norm; lm_head.
qwen3 applies an RMSNorm over ``head_dim`` to each query and key head before RoPE. Query head ``h``
reads key/value head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).

Differences from transformers that are deliberate: RMSNorm is computed in ``dtype`` (HF upcasts to
float32 and casts back), and RoPE angles come from float64 (HF uses float32), so a float64 run is a
better reference than HF itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..probe import LayerProbe
from .config import Checkpoint, ModelConfig

_QUERY_BLOCK = 256  # queries per attention block: bounds memory at [H, block, T] scores


@dataclass(frozen=True, eq=False)
class ReferenceOutput:
    logits: torch.Tensor  # [T, vocab] in the decoder's dtype
    rows: torch.Tensor | None = None  # [R] the probed positions, when probe_rows was given
    layers: tuple[LayerProbe, ...] = ()  # one per layer when probe_rows was given, else empty


class ReferenceDecoder:
    """Full forward of ``checkpoint`` in ``dtype``; weights are converted once, here."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype = torch.float64):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise UsageError(f"reference dtype must be a floating torch dtype, got {dtype!r}")
        self.checkpoint = checkpoint
        self.config: ModelConfig = checkpoint.config
        self.dtype = dtype
        self._w = {name: t.detach().to(dtype=dtype, copy=True) for name, t in checkpoint.weights.items()}

    # ------------------------------------------------------------------ public

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor | Sequence[int],
        *,
        probe_rows: torch.Tensor | Sequence[int] | None = None,
        window: int | None | str = "model",
        sink_tokens: int = 0,
        positions: torch.Tensor | Sequence[int] | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> ReferenceOutput:
        """Logits ``[T, vocab]`` for ``tokens [T]`` at positions ``0..T-1``, plus per-layer probes.

        ``window="model"`` gives each layer its configured window; an int applies that window to
        every layer; None means full causal attention. Key ``j`` is visible to query ``i`` iff
        ``j <= i`` and (no window, or ``i - W < j``, or ``j < sink_tokens``). Length-dependent RoPE
        (dynamic NTK, LongRoPE) uses ``seq_len = T``, as transformers does for a full forward.

        Cache operations (docs/ops.md) need two more things, both optional: ``positions [T]`` (strictly
        increasing logical positions to rotate at instead of ``0..T-1``, e.g. a shifted sequence; the
        mask stays by token order, and ``rows`` in the output are then the probed tokens' positions)
        and ``key_mask [T, T]`` (bool, False hides key ``j`` from query ``i`` on top of the causal and
        window mask: evicted keys for the rows after an eviction).
        """
        cfg = self.config
        tokens = self._check_tokens(tokens)
        T = tokens.shape[0]
        rows = None if probe_rows is None else self._check_rows(probe_rows, T)
        windows = self._layer_windows(window)
        if not isinstance(sink_tokens, int) or isinstance(sink_tokens, bool) or sink_tokens < 0:
            raise UsageError(f"sink_tokens must be a non-negative integer, got {sink_tokens!r}")

        positions = torch.arange(T) if positions is None else self._check_positions(positions, T)
        if key_mask is not None and (not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool
                                     or tuple(key_mask.shape) != (T, T)):
            raise UsageError(f"key_mask must be a bool tensor [{T}, {T}]")
        x = self._w["model.embed_tokens.weight"][tokens]  # [T, hidden]
        probes = []
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}."
            hidden_in = x
            h = self._rms_norm(x, p + "input_layernorm.weight")
            q = self._linear(h, p + "self_attn.q_proj").view(T, cfg.num_heads, cfg.head_dim)
            k = self._linear(h, p + "self_attn.k_proj").view(T, cfg.num_kv_heads, cfg.head_dim)
            v = self._linear(h, p + "self_attn.v_proj").view(T, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = self._rms_norm(q, p + "self_attn.q_norm.weight")
                k = self._rms_norm(k, p + "self_attn.k_norm.weight")
            q_rot = cfg.rope.rotate(q, positions, seq_len=T)  # [T, H, D]
            k_rot = cfg.rope.rotate(k, positions, seq_len=T)  # [T, KVH, D]

            attn = torch.empty(T, cfg.num_heads, cfg.head_dim, dtype=self.dtype)
            for start in range(0, T, _QUERY_BLOCK):
                block = slice(start, start + _QUERY_BLOCK)
                scores = self._attn_logits(q_rot[block], torch.arange(T)[block], k_rot, windows[layer], sink_tokens)
                if key_mask is not None:
                    scores = scores.masked_fill(~key_mask[block][None], float("-inf"))
                attn[block] = self._attend(scores, v)
            x = x + self._linear(attn.reshape(T, -1), p + "self_attn.o_proj")

            h = self._rms_norm(x, p + "post_attention_layernorm.weight")
            gate = self._linear(h, p + "mlp.gate_proj")
            up = self._linear(h, p + "mlp.up_proj")
            x = x + self._linear(F.silu(gate) * up, p + "mlp.down_proj")

            if rows is not None:
                probes.append(LayerProbe(
                    q=q_rot[rows].clone(), k=k_rot, key_positions=positions, hidden_in=hidden_in[rows].clone(),
                    q_raw=q[rows].clone(), k_raw=k, v=v))

        x = self._rms_norm(x, "model.norm.weight")
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        logits = x @ self._w[head].T  # [T, vocab]
        return ReferenceOutput(logits=logits, rows=None if rows is None else positions[rows], layers=tuple(probes))

    def next_token(self, tokens: torch.Tensor | Sequence[int]) -> int:
        """Greedy next token after ``tokens`` (argmax of the last row of the logits)."""
        return int(self.forward(tokens).logits[-1].argmax())

    # ------------------------------------------------------------------ pieces

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x @ W.T (+ b)`` for the module ``name``; the bias exists iff the checkpoint has it
        (the checkpoint was validated against the config, so this follows the config's bias flags)."""
        out = x @ self._w[name + ".weight"].T
        bias = self._w.get(name + ".bias")
        return out + bias if bias is not None else out

    def _rms_norm(self, x: torch.Tensor, weight_name: str) -> torch.Tensor:
        """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * weight``."""
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.rms_norm_eps) * self._w[weight_name]

    def _attn_logits(
        self, q_rot: torch.Tensor, rows: torch.Tensor, k_rot: torch.Tensor, window: int | None, sinks: int
    ) -> torch.Tensor:
        """Scaled, masked scores ``[H, R, T]`` of queries ``q_rot [R, H, D]`` at ``rows`` against
        every key ``k_rot [T, KVH, D]``."""
        cfg = self.config
        kv_head = torch.arange(cfg.num_heads) // (cfg.num_heads // cfg.num_kv_heads)  # [H]
        k_per_head = k_rot[:, kv_head]  # [T, H, D]
        scores = torch.einsum("rhd,thd->hrt", q_rot, k_per_head) * cfg.head_dim**-0.5
        return scores.masked_fill(~visible(rows, k_rot.shape[0], window, sinks), float("-inf"))

    def _attend(self, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Softmax ``scores [H, R, T]`` over keys and mix ``v [T, KVH, D]`` -> ``[R, H, D]``."""
        cfg = self.config
        kv_head = torch.arange(cfg.num_heads) // (cfg.num_heads // cfg.num_kv_heads)
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hrt,thd->rhd", probs, v[:, kv_head])

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

    def _layer_windows(self, window: int | None | str) -> list[int | None]:
        n = self.config.num_layers
        if isinstance(window, str):
            if window != "model":
                raise UsageError(f"window must be 'model', None or a positive integer, got {window!r}")
            return [self.config.layer_window(i) for i in range(n)]
        if window is None:
            return [None] * n
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise UsageError(f"window must be 'model', None or a positive integer, got {window!r}")
        return [window] * n


def visible(rows: torch.Tensor, num_keys: int, window: int | None, sink_tokens: int = 0) -> torch.Tensor:
    """Boolean mask ``[R, num_keys]``: key ``j`` visible to the query at position ``i = rows[r]`` iff
    ``j <= i`` and (``window`` is None, or ``i - window < j``, or ``j < sink_tokens``)."""
    i = rows[:, None]
    j = torch.arange(num_keys)[None, :]
    mask = j <= i
    if window is not None:
        mask &= (j > i - window) | (j < sink_tokens)
    return mask
