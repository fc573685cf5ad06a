"""Layer-by-layer comparison of one decode step with a reference row, and the tolerances.

Errors are scale-aware: ``max |cached - ref| / max(1, max |ref|)`` over the entries both sides see.
A key visible on one side and masked on the other is an infinite error (a window or mask bug).
Attention logits are never taken from an engine: both sides are computed from the probes' queries
and keys by :func:`ropekv.parity.recorder.attention_logits`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.config import ModelConfig
from ..probe import LayerProbe
from .recorder import attention_logits


@dataclass(frozen=True)
class Tolerance:
    """Largest scale-aware error that still counts as parity, per compared quantity."""

    attn: float
    hidden: float
    logits: float

    def to_dict(self) -> dict[str, float]:
        return {"attn_logits": self.attn, "hidden_in": self.hidden, "final_logits": self.logits}


# Calibrated on SmolLM2-135M and the tiny test models: clean engines stay at least 10x below these,
# every catalogued fault goes at least 10x above (docs/report.md has the measured figures).
_TOLERANCES = {
    torch.float64: Tolerance(attn=1e-6, hidden=1e-6, logits=1e-6),
    torch.float32: Tolerance(attn=2e-3, hidden=2e-3, logits=5e-3),
    torch.float16: Tolerance(attn=6e-2, hidden=6e-2, logits=1e-1),
    torch.bfloat16: Tolerance(attn=1.5e-1, hidden=1.5e-1, logits=2.5e-1),
}


# An 8-bit KV cache (float8_e4m3fn codes, per-layer scales, float32 compute): its noise is e4m3's rounding
# of every cached key and value (3 mantissa bits, a relative step of 2^-3), not the compute dtype's.
# Measured against float64 (docs/faults.md, "Quantized KV"): the correct engine's worst attention-logit
# error 0.079 and max |dlogit| 0.11 on the tiny models (the default matrix); the tolerance leaves a
# margin of about 3x above them, and every fp8 fault goes above it. SmolLM2-135M (per tensor): 0.199 and
# a scale-aware final-logit error of 0.096, 1.5x and 4x below.
KV_TOLERANCES = {"fp8": Tolerance(attn=0.3, hidden=0.3, logits=0.4)}


def kv_tolerance(kv_dtype: str) -> Tolerance:
    """The tolerance of an engine whose KV cache is stored in ``kv_dtype`` (``"fp8"``)."""
    return KV_TOLERANCES[kv_dtype]


def tolerance_for(engine_dtype: torch.dtype, reference_dtype: torch.dtype = torch.float64) -> Tolerance:
    """The tolerance set by the coarser of the two dtypes in play."""
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    coarser = max(engine_dtype, reference_dtype, key=order.index)
    return _TOLERANCES[coarser]


def scaled_error(cached: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |cached - ref| / max(1, max |ref|)`` over finite entries; inf if the masks differ."""
    cached = cached.double()
    ref = ref.double()
    fin_c, fin_r = torch.isfinite(cached), torch.isfinite(ref)
    if not torch.equal(fin_c, fin_r):
        return math.inf
    if not fin_r.any():
        return 0.0
    diff = (cached[fin_r] - ref[fin_r]).abs().max().item()
    return diff / max(1.0, ref[fin_r].abs().max().item())


@dataclass(frozen=True, eq=False)
class NextToken:
    """Next-token scores of one row: full logits ``[V]`` (``token_ids`` None) or top-k
    log-probabilities ``[K]`` at ``token_ids [K]``."""

    values: torch.Tensor
    token_ids: torch.Tensor | None = None

    def on_common_ids(self, other: NextToken) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sides on the same footing: raw logits where both are full, else log-probabilities on
        the ids both know (a full side is turned into log-probabilities first)."""
        if self.token_ids is None and other.token_ids is None:
            return self.values, other.values
        a_ids, a = _as_logprobs(self)
        b_ids, b = _as_logprobs(other)
        if a_ids is None:
            return a[b_ids], b
        if b_ids is None:
            return a, b[a_ids]
        common, ia, ib = _intersect(a_ids, b_ids)
        if common.numel() == 0:
            return torch.tensor([0.0]), torch.tensor([math.inf])  # disjoint top-k sets: diverged
        return a[ia], b[ib]


def _as_logprobs(x: NextToken) -> tuple[torch.Tensor | None, torch.Tensor]:
    if x.token_ids is None:
        return None, torch.log_softmax(x.values.double(), dim=-1)
    return x.token_ids, x.values.double()


def _intersect(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    where_b = {int(t): i for i, t in enumerate(b.tolist())}
    pairs = [(int(t), i, where_b[int(t)]) for i, t in enumerate(a.tolist()) if int(t) in where_b]
    if not pairs:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, empty
    ids, ia, ib = zip(*pairs)
    return torch.tensor(ids), torch.tensor(ia), torch.tensor(ib)


def logits_error(cached: NextToken, ref: NextToken) -> tuple[float, float]:
    """``(scale-aware error, max absolute difference)`` of next-token scores (see :class:`NextToken`)."""
    a, b = cached.on_common_ids(ref)
    if not torch.isfinite(b).all() or not torch.isfinite(a).all():
        return math.inf, math.inf
    return scaled_error(a, b), float((a.double() - b.double()).abs().max())


@dataclass(frozen=True, eq=False)
class RefRow:
    """One row ``t`` of a full forward as the comparison needs it: per layer its input and its
    attention logits over every key (empty at the logits tier), and the next-token scores."""

    hidden_in: tuple[torch.Tensor | None, ...]  # per layer [hidden]
    attn_logits: tuple[torch.Tensor, ...]  # per layer [H, T]: column c is the key at position origin + c
    logits: NextToken
    # The position of column 0: a shifted case's keys all sit at or past its shift, so its rows start
    # there (a shift by 2**31 would otherwise be 2**31 columns of -inf per head); 0 for every other case.
    origin: int = 0

    def at(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """``[H, N]`` the reference's logits of ``layer`` at key ``positions [N]``; ``-inf`` where the row
        holds no key (a position before its origin or past its last column)."""
        return columns(self.attn_logits[layer], self.origin, positions)

    def visible(self, layer: int) -> torch.Tensor:
        """``[K]`` the positions of the keys the reference's query sees at ``layer``, ascending."""
        return torch.isfinite(self.attn_logits[layer][0]).nonzero().flatten() + self.origin


@dataclass(frozen=True)
class StepErrors:
    """Errors of one decode step against one reference, per layer (empty at the logits tier)."""

    position: int
    attn: tuple[float, ...]  # per layer
    hidden: tuple[float, ...]  # per layer (the layer's input; 0 where the engine does not expose it)
    logits: float  # final logits, scale-aware
    max_abs_logit_diff: float  # final logits, absolute


class LogitsOf:
    """Attention logits of probes under one model's scale, windows and sinks (the case's window, if
    set, on every layer; else each layer's own)."""

    def __init__(self, cfg: ModelConfig, window: int | None, sink_tokens: int):
        self.cfg, self.window, self.sink_tokens = cfg, window, sink_tokens
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_softcap

    def layer_window(self, layer: int) -> int | None:
        return self.window if self.window is not None else self.cfg.layer_window(layer)

    def layer_chunk(self, layer: int) -> int | None:
        """The layer's chunk size; a case window replaces every layer's kind, chunks included."""
        return None if self.window is not None else self.cfg.layer_chunk(layer)

    def step(self, layer: int, probe: LayerProbe, position: int) -> torch.Tensor:
        """``[H, N]`` over exactly the keys the kernel read (nothing hidden: a key it should not have
        read shows up against the reference's ``-inf``)."""
        q_pos = torch.tensor([position])
        return attention_logits(probe, q_pos, scale=self.scale, softcap=self.softcap, mask_by_position=False)[:, 0]

    def rows(self, layer: int, probe: LayerProbe, rows: torch.Tensor) -> torch.Tensor:
        """``[H, R, T]`` over every key, masked by position (causal, window, sinks, chunk)."""
        return attention_logits(
            probe,
            rows,
            scale=self.scale,
            softcap=self.softcap,
            window=self.layer_window(layer),
            sink_tokens=self.sink_tokens,
            chunk=self.layer_chunk(layer),
        )


def columns(attn: torch.Tensor, origin: int, positions: torch.Tensor) -> torch.Tensor:
    """``[H, N]`` of a row by position ``attn [H, T]`` (column c: position ``origin + c``) at key
    ``positions [N]``; ``-inf`` at a position the row does not cover."""
    cols = positions.long() - origin
    inside = (cols >= 0) & (cols < attn.shape[1])
    out = torch.full((attn.shape[0], cols.numel()), -math.inf, dtype=attn.dtype)
    out[:, inside] = attn[:, cols[inside]]
    return out


def compare_step(
    step_layers: tuple[LayerProbe, ...], step_logits: NextToken, position: int, ref: RefRow, logits_of: LogitsOf
) -> StepErrors:
    attn, hidden = [], []
    for layer, probe in enumerate(step_layers):
        cached = logits_of.step(layer, probe, position)  # [H, N]
        ref_attn = ref.at(layer, probe.key_positions)  # [H, N]
        err = scaled_error(cached, ref_attn)
        if _mask_misses_keys(ref.visible(layer), probe.key_positions):
            err = math.inf
        attn.append(err)
        mine, theirs = probe.hidden_in, ref.hidden_in[layer]
        hidden.append(0.0 if mine is None or theirs is None else scaled_error(mine[0], theirs))
    logits_err, abs_diff = logits_error(step_logits, ref.logits)
    return StepErrors(position, tuple(attn), tuple(hidden), logits_err, abs_diff)


def _mask_misses_keys(visible: torch.Tensor, key_positions: torch.Tensor) -> bool:
    """True if the reference sees a key (``visible [K]`` positions) the engine did not read at all."""
    return not bool(torch.isin(visible, key_positions.long()).all())


def first_failure(errors: list[StepErrors], tol: Tolerance) -> tuple[int, int | None] | None:
    """``(step index, layer)`` of the first diverging attention logits (or input), in decode order;
    the layer is None where only the final logits diverged (the logits tier sees nothing else)."""
    for s, e in enumerate(errors):
        for layer, (a, h) in enumerate(zip(e.attn, e.hidden)):
            if a > tol.attn or h > tol.hidden:
                return s, layer
        if e.logits > tol.logits:
            return s, (len(e.attn) - 1 if e.attn else None)
    return None


def worst_entry(cached: torch.Tensor, ref: torch.Tensor) -> tuple[int, int, float, float]:
    """``(head, key index, cached value, reference value)`` of the largest logit difference ``[H, N]``."""
    c, r = cached.double(), ref.double()
    diff = (c - r).abs()
    both_inf = ~torch.isfinite(c) & ~torch.isfinite(r)
    diff = torch.where(both_inf, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)
    flat = int(torch.argmax(diff))
    head, key = divmod(flat, diff.shape[1])
    return head, key, float(c[head, key]), float(r[head, key])
