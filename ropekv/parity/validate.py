"""Validation of every adapter result against its case, before anything is compared.

A correctness tool that passes a broken adapter is worse than none: an adapter that returns fewer
steps or layers than the case asks for, tensors of other shapes, positions outside what the case and
window allow, or non-finite values is refused with :class:`~ropekv.errors.AdapterError` naming the
adapter, the field, what was expected and what came. Nothing here trusts the adapter's own
description of itself beyond its declared tier.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AdapterError, UsageError
from ..models.config import Checkpoint, ModelConfig
from ..probe import LayerProbe
from .cases import Case
from .protocol import REQUIRED_MEMBERS, CaseRun, EngineDescription, FullRun, Ignored, StepRecord, Tier

MIN_TOP_K = 5  # fewest top-k log-probabilities per row an engine must expose for the logits comparison


def check_adapter(adapter: object) -> Tier:
    """The adapter's declared tier, after checking that every protocol member is there."""
    name = _name(adapter)
    missing = [m for m in REQUIRED_MEMBERS if not hasattr(adapter, m)]
    if missing:
        raise AdapterError(
            name,
            "protocol",
            "the members " + ", ".join(REQUIRED_MEMBERS),
            "an object of type " + type(adapter).__name__ + " lacking " + ", ".join(missing),
        )
    for m in ("describe", "ignored", "run_case", "full_forward"):
        if not callable(getattr(adapter, m)):
            raise AdapterError(name, m, "a method", type(getattr(adapter, m)).__name__)
    members: Any = adapter  # any object, whose members were found above; their values are checked here
    declared, dtype = members.tier, members.dtype
    try:
        tier = Tier(declared)
    except ValueError:
        raise AdapterError(name, "tier", "one of " + ", ".join(t.value for t in Tier), repr(declared)) from None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise AdapterError(name, "dtype", "a floating torch.dtype", repr(dtype))
    checkpoint = members.checkpoint
    if not isinstance(checkpoint, Checkpoint):
        raise AdapterError(
            name, "checkpoint", "a ropekv Checkpoint (ropekv.models.load_checkpoint)", type(checkpoint).__name__
        )
    return tier


def check_ignored(adapter: object, case: Case, ignored: object) -> tuple[Ignored, ...]:
    """``ignored`` as the case parameters the adapter cannot honour, or AdapterError."""
    if not isinstance(ignored, (tuple, list)) or not all(isinstance(x, Ignored) for x in ignored):
        raise AdapterError(
            _name(adapter),
            f"ignored({case.label()})",
            "a tuple of Ignored(param, text) records (not a bare string, nor a tuple of strings)",
            repr(ignored),
        )
    return tuple(ignored)


def check_description(adapter: object, description: object) -> EngineDescription:
    """``description`` (what ``adapter.describe()`` returned) as an :class:`EngineDescription`, or AdapterError."""
    if not isinstance(description, EngineDescription):
        raise AdapterError(_name(adapter), "describe()", "an EngineDescription", type(description).__name__)
    return description


def check_case_run(adapter: object, tier: Tier, cfg: ModelConfig, case: Case, run: object) -> CaseRun:
    """``run`` as :class:`CaseRun` for ``case`` at ``tier``, or AdapterError."""
    name = _name(adapter)
    where = f"run_case({case.label()})"
    if not isinstance(run, CaseRun):
        raise AdapterError(name, where, "a CaseRun", type(run).__name__)
    want_steps = len(case.decode_positions)  # decode_steps, times the rows of a batch case
    if not isinstance(run.steps, tuple) or len(run.steps) != want_steps:
        got = len(run.steps) if isinstance(run.steps, (tuple, list)) else type(run.steps).__name__
        raise AdapterError(name, f"{where}.steps", f"{want_steps} decode steps", f"{got}")
    if not isinstance(run.handoff_len, int) or not 0 <= run.handoff_len <= case.total:
        raise AdapterError(name, f"{where}.handoff_len", f"an int in [0, {case.total}]", repr(run.handoff_len))
    if not isinstance(run.notes, tuple) or not all(isinstance(n, str) for n in run.notes):
        raise AdapterError(name, f"{where}.notes", "a tuple of strings", repr(run.notes))
    for s, (step, t) in enumerate(zip(run.steps, case.decode_positions)):
        field = f"{where} step {s}"
        if not isinstance(step, StepRecord):
            raise AdapterError(name, field, "a StepRecord", type(step).__name__)
        if step.position != t:
            raise AdapterError(name, f"{field}.position", f"position {t}", repr(step.position))
        _check_scores(name, f"{field}.logits", cfg, step.logits, step.token_ids, rows=None)
        _check_layers(name, field, tier, cfg, step.layers, rows=torch.tensor([t]), case=case, full=False)
    return run


def check_full_run(
    adapter: object, tier: Tier, cfg: ModelConfig, case: Case, rows: list[int], T: int, run: object
) -> FullRun:
    """``run`` as the :class:`FullRun` over ``T`` tokens probed at ``rows``, or AdapterError."""
    name = _name(adapter)
    where = f"full_forward({T} tokens)"
    if not isinstance(run, FullRun):
        raise AdapterError(name, where, "a FullRun", type(run).__name__)
    want = torch.as_tensor(rows, dtype=torch.int64)
    got = run.rows
    if (
        not torch.is_tensor(got)
        or got.dim() != 1
        or got.dtype.is_floating_point
        or not torch.equal(got.to(torch.int64).cpu(), want)
    ):
        raise AdapterError(name, f"{where}.rows", f"rows {rows}", _describe(got))
    _check_scores(name, f"{where}.logits", cfg, run.logits, run.token_ids, rows=len(rows))
    _check_layers(name, where, tier, cfg, run.layers, rows=want, case=case, full=True, num_tokens=T)
    return run


# ---------------------------------------------------------------------- pieces


def _check_scores(name: str, field: str, cfg: ModelConfig, values: object, token_ids: object, rows: int | None) -> None:
    lead = () if rows is None else (rows,)
    if not torch.is_tensor(values) or not values.dtype.is_floating_point:
        raise AdapterError(name, field, "a floating tensor", _describe(values))
    if token_ids is None:
        if tuple(values.shape) != lead + (cfg.vocab_size,):
            raise AdapterError(
                name, field, f"shape {list(lead + (cfg.vocab_size,))} (the vocabulary)", f"shape {list(values.shape)}"
            )
    else:
        if not torch.is_tensor(token_ids) or token_ids.dtype.is_floating_point or token_ids.dim() != len(lead) + 1:
            raise AdapterError(
                name,
                field.replace("logits", "token_ids"),
                f"an integer tensor of {len(lead) + 1} dims",
                _describe(token_ids),
            )
        if tuple(values.shape) != tuple(token_ids.shape):
            raise AdapterError(
                name,
                field,
                f"one log-probability per token id (shape {list(token_ids.shape)})",
                f"shape {list(values.shape)}",
            )
        need = min(MIN_TOP_K, cfg.vocab_size)
        if token_ids.shape[-1] < need:
            raise AdapterError(
                name,
                field.replace("logits", "token_ids"),
                f"at least {need} token ids per row (a top-{token_ids.shape[-1]} comparison proves too little)",
                f"{token_ids.shape[-1]}",
            )
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= cfg.vocab_size:
            raise AdapterError(
                name,
                field.replace("logits", "token_ids"),
                f"ids in [0, {cfg.vocab_size})",
                f"{int(token_ids.min())}..{int(token_ids.max())}",
            )
        flat = token_ids.reshape(-1, token_ids.shape[-1])
        if any(len(set(r.tolist())) != len(r) for r in flat):
            raise AdapterError(name, field.replace("logits", "token_ids"), "distinct ids per row", "repeated ids")
        if bool((values > 1e-4).any()):
            raise AdapterError(name, field, "log-probabilities (<= 0) with token_ids", f"max {float(values.max()):.4g}")
    if not bool(torch.isfinite(values).all()):
        raise AdapterError(name, field, "finite values", f"{int((~torch.isfinite(values)).sum())} non-finite")


def _check_layers(
    name: str,
    field: str,
    tier: Tier,
    cfg: ModelConfig,
    layers: object,
    *,
    rows: torch.Tensor,
    case: Case,
    full: bool,
    num_tokens: int | None = None,
) -> None:
    if tier < Tier.ATTENTION:
        return
    if full and num_tokens is None:
        raise UsageError(f"{field}: a full forward's layers are checked against its number of tokens")
    T = num_tokens or 0
    if not isinstance(layers, tuple) or len(layers) != cfg.num_layers:
        got = len(layers) if isinstance(layers, (tuple, list)) else type(layers).__name__
        raise AdapterError(
            name, f"{field}.layers", f"{cfg.num_layers} layers (the model has {cfg.num_layers})", f"{got}"
        )
    R = rows.numel()
    for i, p in enumerate(layers):
        f = f"{field} layer {i}"
        if not isinstance(p, LayerProbe):
            raise AdapterError(name, f, "a LayerProbe", type(p).__name__)
        q, k = p.q, p.k
        _float(name, f"{f}.q", q)
        _float(name, f"{f}.k", k)
        if q.dim() != 3 or q.shape[0] != R or q.shape[1] != cfg.num_heads:
            raise AdapterError(
                name, f"{f}.q", f"shape [{R}, {cfg.num_heads}, D] (rows, heads, head dim)", f"shape {list(q.shape)}"
            )
        if k.dim() != 3 or k.shape[1] < 1 or cfg.num_heads % k.shape[1] or k.shape[2] != q.shape[2]:
            raise AdapterError(
                name,
                f"{f}.k",
                f"shape [N, KVH, {q.shape[2]}] with KVH dividing {cfg.num_heads}",
                f"shape {list(k.shape)}",
            )
        if k.shape[1] != cfg.num_kv_heads and k.shape[1] != cfg.num_heads:
            raise AdapterError(name, f"{f}.k", f"{cfg.num_kv_heads} key heads", f"{k.shape[1]}")
        if q.shape[2] != cfg.head_dim:
            raise AdapterError(name, f"{f}.q", f"head dim {cfg.head_dim}", f"{q.shape[2]}")
        pos = p.key_positions
        if (
            not torch.is_tensor(pos)
            or pos.dim() != 1
            or pos.dtype.is_floating_point
            or pos.dtype == torch.bool
            or pos.numel() != k.shape[0]
        ):
            raise AdapterError(
                name, f"{f}.key_positions", f"an integer tensor [{k.shape[0]}] (one per key)", _describe(pos)
            )
        if p.key_slots is not None and (
            not torch.is_tensor(p.key_slots)
            or p.key_slots.dim() != 1
            or p.key_slots.dtype.is_floating_point
            or p.key_slots.numel() != k.shape[0]
        ):
            raise AdapterError(
                name, f"{f}.key_slots", f"None or an integer tensor [{k.shape[0]}]", _describe(p.key_slots)
            )
        if pos.numel() == 0:
            raise AdapterError(name, f"{f}.key_positions", "at least one key", "none")
        if len(set(pos.tolist())) != pos.numel():
            raise AdapterError(name, f"{f}.key_positions", "distinct positions", "repeated positions")
        if full:
            if pos.numel() > T or int(pos.min()) < 0 or int(pos.max()) >= T:
                raise AdapterError(
                    name,
                    f"{f}.key_positions",
                    f"positions in [0, {num_tokens})",
                    f"{int(pos.min())}..{int(pos.max())} ({pos.numel()} keys)",
                )
            if not bool(torch.isin(rows, pos).all()):
                raise AdapterError(
                    name, f"{f}.key_positions", f"the probed rows {rows.tolist()} among the keys", "some missing"
                )
        else:
            # Causal: a key past the query is no key of this step (the adapter mislabels positions). A key
            # inside [0, t] that the case's window hides is the engine's error, not the adapter's: it is
            # compared (an infinite error against the reference's -inf) and named window_mismatch.
            t = int(rows[0])
            if int(pos.max()) > t or int(pos.min()) < 0:
                raise AdapterError(
                    name,
                    f"{f}.key_positions",
                    f"positions in [0, {t}] (causal, query at {t})",
                    f"{int(pos.min())}..{int(pos.max())}",
                )
        if p.hidden_in is not None:
            _float(name, f"{f}.hidden_in", p.hidden_in)
            if tuple(p.hidden_in.shape) != (R, cfg.hidden_size):
                raise AdapterError(
                    name, f"{f}.hidden_in", f"shape [{R}, {cfg.hidden_size}]", f"shape {list(p.hidden_in.shape)}"
                )
        for extra, want in (("q_raw", q.shape), ("k_raw", k.shape), ("v", None)):
            t_ = getattr(p, extra)
            if t_ is None:
                continue
            _float(name, f"{f}.{extra}", t_)
            if want is not None and tuple(t_.shape) != tuple(want):
                raise AdapterError(name, f"{f}.{extra}", f"shape {list(want)}", f"shape {list(t_.shape)}")


def _float(name: str, field: str, t: object) -> None:
    if not torch.is_tensor(t) or not t.dtype.is_floating_point:
        raise AdapterError(name, field, "a floating tensor", _describe(t))
    if not bool(torch.isfinite(t).all()):
        raise AdapterError(name, field, "finite values", f"{int((~torch.isfinite(t)).sum())} non-finite")


def _describe(x: object) -> str:
    if torch.is_tensor(x):
        return f"{x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__ if x is not None else "None"


def _name(adapter: object) -> str:
    n = getattr(adapter, "name", None)
    return n if isinstance(n, str) and n else type(adapter).__name__
