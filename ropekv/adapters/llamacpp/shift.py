"""llama.cpp's position shift (context shift) checked against explicit positions and the float64 reference.

A shift run prefills ``n`` tokens at positions ``0..n-1``, calls ``llama_memory_seq_add(seq 0, 0, n,
delta)`` (llama.cpp moves every cell's position and, at the next decode, re-rotates the cached keys
by ``R(delta)`` in its K-shift graph), then decodes token ``n`` at position ``n + delta``. Its
references:

- *explicit*: the same tokens prefilled at positions ``delta..delta+n-1`` through ``llama_batch_init``
  (no shift involved), then the same decode: the engine against itself;
- *float64*: RoPE scores depend only on ``j - i``, so the decode at ``n + delta`` over keys at
  ``delta + j`` must equal row ``n`` of ropekv's reference over ``tokens[:n+1]`` at ``0..n``.

The attention tier separates the shift from weight-quantization noise: the layer-0 scores see only
the embedding (exact) and the projections, so a shift error shows there at full size while
quantization noise there is ~1e-4 and grows only layer by layer. Forensics reads where each key
really sits: the effective positions are compared with the logical ones (correct), the pre-shift
ones (``logical - delta``: shifted without re-rotation) and ``logical + delta`` (rotated twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.reference import ReferenceDecoder
from ...parity.explain.pattern import describe
from ...parity.keymap.fit import fit_row
from ...parity.keymap.record import KeyMap
from ...parity.protocol import StepRecord
from ...parity.recorder import attention_logits
from .engine import LlamaCppEngine
from .tap import ShiftFault, ShiftFaultKind

SHIFT_NAMES = {0: "correct shift", -1: "shift_not_rerotated", 1: "shift_rerotated_twice"}


@dataclass(frozen=True)
class ShiftCheck:
    delta: int
    n: int
    logits_vs_explicit: float  # max |dlogit|, shifted vs explicit positions (engine vs itself)
    logits_vs_reference: float  # max |dlogit|, shifted vs the float64 reference
    explicit_vs_reference: float  # max |dlogit|, explicit positions vs the float64 reference
    layer0_scores_vs_explicit: float
    layer0_scores_vs_reference: float
    explicit_layer0_vs_reference: float
    scores_vs_reference: tuple[float, ...]  # per layer, shifted run vs reference (max |d score|)
    shifts_seen: int  # K-shift graphs llama.cpp ran (1 for one applied seq_add)
    verdict: str  # one of SHIFT_NAMES' values, from the effective key positions
    keymap: KeyMap  # the fit of the first divergent layer's query and keys (ropekv.parity.keymap)

    @property
    def key_effective(self) -> list[int | None]:
        """Each key's effective position (every head agreeing), None where it fits none."""
        return self.keymap.keys.agreed()

    @property
    def query_effective(self) -> int | None:
        return self.keymap.query.agreed()[0]

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "keymap"}
        d["keymap"] = describe(self.keymap)
        return d


def shifted_step(
    engine: LlamaCppEngine,
    tokens: list[int],
    n: int,
    delta: int,
    *,
    fault: ShiftFaultKind | None = None,
    explicit: bool = False,
) -> StepRecord:
    """Decode ``tokens[n]`` at ``n + delta`` after the prompt ``tokens[:n]`` was shifted by ``delta``
    (``explicit=True``: prefilled at the shifted positions instead). ``fault`` corrupts the K-shift."""
    ctx = engine._cached
    if ctx is None:
        raise ValueError("shift runs need an engine at the attention tier or above")
    ctx.clear()
    if explicit:
        ctx.prefill(tokens[:n], delta)
    else:
        ctx.prefill(tokens[:n], 0)
        ctx.shift(0, n, delta)
    ctx.tap.fault = (
        ShiftFault(fault, engine.config.rope.theta, engine.config.rope.rotary_dim) if fault is not None else None
    )
    seen = ctx.tap.shifts_seen
    try:
        step = engine.decode_step(ctx, tokens[n], n + delta)
    finally:
        ctx.tap.fault = None
    engine.last_shifts_seen = ctx.tap.shifts_seen - seen
    return step


def check_shift(
    engine: LlamaCppEngine,
    reference: ReferenceDecoder,
    tokens: list[int],
    n: int,
    delta: int,
    *,
    fault: ShiftFaultKind | None = None,
) -> ShiftCheck:
    """One shift of ``delta`` after ``n`` tokens against explicit positions and the float64 reference."""
    cfg = engine.config
    shifted = shifted_step(engine, tokens, n, delta, fault=fault)
    seen = engine.last_shifts_seen
    explicit = shifted_step(engine, tokens, n, delta, explicit=True)
    ref = reference.forward(torch.tensor(tokens[: n + 1]), probe_rows=[n])
    scale = cfg.head_dim**-0.5

    def scores(step: StepRecord, layer: int) -> torch.Tensor:  # [H, n + 1] ordered by position
        lp = step.layers[layer]
        order = torch.argsort(lp.key_positions)
        return attention_logits(lp, torch.tensor([n + delta]), scale=scale)[:, 0][:, order]

    def ref_scores(layer: int) -> torch.Tensor:
        return reference_row(ref, layer)

    per_layer = tuple(float((scores(shifted, i) - ref_scores(i)).abs().max()) for i in range(cfg.num_layers))
    first = _first_bad_layer(per_layer)
    lay = shifted.layers[first]
    probe = ref.layers[first]
    assert probe.q_raw is not None and probe.k_raw is not None  # the reference probes its raw q/k
    assert lay.key_slots is not None  # the tap records every key's cell
    order = torch.argsort(lay.key_positions)
    # the reference's rows are by token index 0..n; the shifted keys sit at delta + index
    km = fit_row(
        cfg.rope,
        q_raw=probe.q_raw[0],
        q_eff=lay.q[0].double(),
        k_raw=probe.k_raw,
        k_eff=lay.k[order].double(),
        query_position=n + delta,
        key_positions=lay.key_positions[order],
        key_slots=lay.key_slots[order],
        shift=delta,
    )
    return ShiftCheck(
        delta=delta,
        n=n,
        logits_vs_explicit=float((shifted.logits - explicit.logits).abs().max()),
        logits_vs_reference=float((shifted.logits.double() - ref.logits[n]).abs().max()),
        explicit_vs_reference=float((explicit.logits.double() - ref.logits[n]).abs().max()),
        layer0_scores_vs_explicit=float((scores(shifted, 0) - scores(explicit, 0)).abs().max()),
        layer0_scores_vs_reference=per_layer[0],
        explicit_layer0_vs_reference=float((scores(explicit, 0) - ref_scores(0)).abs().max()),
        scores_vs_reference=per_layer,
        shifts_seen=seen,
        verdict=_verdict(km, delta),
        keymap=km,
    )


def reference_row(ref, layer: int) -> torch.Tensor:
    """The reference's scores ``[H, n + 1]`` of its one probed row ``n`` (keys ``0..n``, itself included)."""
    probe = ref.layers[layer]
    return attention_logits(probe, ref.rows, scale=probe.q.shape[-1] ** -0.5)[:, 0]


def _first_bad_layer(per_layer: tuple[float, ...], tol: float = 1e-2) -> int:
    return next((i for i, e in enumerate(per_layer) if e > tol), 0)


def _verdict(km: KeyMap, delta: int) -> str:
    """Which hypothesis the keys' effective positions fit: logical, logical - delta, logical + delta."""
    effective = km.keys.agreed()
    eff = [p for p in effective if p is not None]
    if not eff:
        return "unknown"
    logical = km.keys.positions.tolist()
    votes = {k: sum(1 for e, p in zip(effective, logical) if e is not None and e == p + k * delta) for k in SHIFT_NAMES}
    best = max(votes, key=lambda k: votes[k])
    return SHIFT_NAMES[best] if votes[best] >= 0.9 * len(eff) else "unknown"
