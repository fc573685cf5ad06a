"""What a vLLM store entry's keys really are, against an independent reference.

The store carries no positions and no RoPE: a consumer injects whatever is there. :func:`check_entry`
compares each layer's stored key of token ``t`` with the reference's post-RoPE key of token ``t`` at
position ``t`` (``reference_keys``: the float64 reference model's, :func:`reference_kv`), and where they
differ recovers what the stored keys are, with the forensics' spectral method
(:func:`ropekv.parity.keymap.spectral.effective_positions`: each channel pair is a complex number, and
a key rotated at ``p`` has the phase ``p * inv_freq`` against the raw key):

- every pair keeps its magnitude but not the reference's: keys of other tokens, or of another model
  (a forged entry, or a hash collision): no rotation turns one into the other;
- integer rotations at other positions: all at 0 (stored raw, :attr:`BugClass.MISSING_ROTATION`), all
  at ``t + s`` (a shift, :attr:`BugClass.KEY_POSITION_OFFSET`), at ``2t`` (:attr:`BugClass.DOUBLE_ROTATION`),
  at ``t mod B`` (:attr:`BugClass.BLOCK_LOCAL_POSITION`);
- rotations at ``t`` under other frequencies: a base ``theta`` (or a uniform frequency scale, as linear
  position scaling) found by a 1-D search (:attr:`BugClass.FREQUENCY_MISMATCH`), or the other channel
  pairing (:attr:`BugClass.LAYOUT_MISMATCH`).

The tolerance is on the relative error ``|k_stored - k_ref| / |k_ref|`` per token and head
(:func:`key_tolerance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ...contract import CacheContract
from ...errors import PayloadError, UsageError
from ...models.config import Checkpoint
from ...models.reference import ReferenceDecoder
from ...parity.bug_class import BugClass
from ...parity.keymap.spectral import effective_positions
from ...rope import RopeScaling, RopeSpec, pair_channels
from .store import StoredKV

Verdict = Literal[
    "matches", "raw", "shifted", "double_rotation", "block_local", "other_positions", "other_frequencies",
    "other_layout", "other_keys", "unrecognized",
]  # fmt: skip
FIT_OK = 0.98  # a token's keys are an integer rotation at this spectral fit (the forensics' threshold)
MAG_TOL = 0.02  # mean relative deviation of pair magnitudes that still counts as a rotation of the same keys
MAX_SHIFT = 4096  # positions searched: -MAX_SHIFT .. num_tokens + MAX_SHIFT
_TINY = 1e-300


def key_tolerance(dtype: torch.dtype) -> float:
    """Largest relative error per key vector that counts as the reference's key: the engine computed
    it in ``dtype`` through every layer below, so the error is activation drift, not storage alone.
    float32: 1e-3 (a real vLLM float32 producer's stored keys sit at most 8.3e-6 from the float64
    reference, docs/engines/vllm.md; on the same keys a shift of one position is an error of 0.15 to
    0.42 per layer, theta 20000 for 100000 one of 0.51 to 1.0). bfloat16 and float16: 0.1 (storage
    alone rounds at 2**-9 / 2**-12 and the activations drift through every layer; not measured on a
    real bfloat16 entry here), still below the one-position shift.
    """
    if dtype == torch.float32:
        return 1e-3
    if dtype in (torch.bfloat16, torch.float16):
        return 0.1
    if dtype == torch.float64:
        return 1e-9
    raise UsageError(f"no key tolerance for {dtype}")


@dataclass(frozen=True)
class LayerFinding:
    """One layer's stored keys against the reference. ``error``: the largest relative error of a stored
    key (per token and head) against the reference's at its own position; ``detail`` states the
    figures of the recovered explanation (shift, theta, positions)."""

    layer: int
    verdict: Verdict
    bug_class: BugClass | None  # None when the keys match
    error: float
    tolerance: float
    detail: str
    shift: int | None = None  # "shifted": the keys sit at t + shift
    theta: float | None = None  # "other_frequencies": the base that fits
    values_error: float | None = None  # the same relative error for the values, when reference values were given

    @property
    def ok(self) -> bool:
        return self.verdict == "matches" and (self.values_error is None or self.values_error <= self.tolerance)

    def line(self) -> str:
        values = "" if self.values_error is None else f", values {self.values_error:.2g}"
        return f"layer {self.layer}: {self.verdict} (key error {self.error:.2g}{values}, tolerance {self.tolerance:.2g}): {self.detail}"


@dataclass(frozen=True)
class EntryCheck:
    """Every layer's finding; :meth:`summary` groups layers of the same verdict."""

    num_tokens: int
    findings: tuple[LayerFinding, ...]

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def bug_classes(self) -> tuple[BugClass, ...]:
        return tuple(sorted({f.bug_class for f in self.findings if f.bug_class is not None}))

    def summary(self) -> list[str]:
        groups: dict[str, list[LayerFinding]] = {}
        for f in self.findings:
            groups.setdefault(f.verdict if f.verdict != "matches" or f.ok else "values", []).append(f)
        out = []
        for verdict, fs in groups.items():
            worst = max(fs, key=lambda f: f.error)
            layers = _ranges([f.layer for f in fs])
            kind = f" [{worst.bug_class}]" if worst.bug_class is not None else ""
            values = max((f.values_error for f in fs if f.values_error is not None), default=None)
            vtext = "" if values is None else f", values up to {values:.2g}"
            out.append(
                f"layers {layers}: {verdict}{kind}; key error up to {worst.error:.2g}{vtext} "
                f"(tolerance {worst.tolerance:.2g}); worst layer {worst.layer}: {worst.detail}"
            )
        return out


def reference_kv(
    checkpoint: Checkpoint, token_ids: Sequence[int] | torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The float64 reference model's per-layer keys (post-RoPE, at positions ``0..T-1``) and values,
    each ``[T, KVH, D]``, for ``token_ids [T]``: one full forward, no cache."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
    out = ReferenceDecoder(checkpoint).forward(ids, probe_rows=[ids.numel() - 1], logits_for="probed")
    values = tuple(p.v for p in out.layers)
    if any(v is None for v in values):
        raise UsageError("the reference recorded no values")
    return tuple(p.k for p in out.layers), tuple(v for v in values if v is not None)


def check_entry(
    stored: StoredKV,
    *,
    token_ids: Sequence[int] | torch.Tensor,
    contract: CacheContract,
    reference_keys: Sequence[torch.Tensor],
    reference_values: Sequence[torch.Tensor] | None = None,
    block_size: int | None = None,
) -> EntryCheck:
    """Judge ``stored`` (an entry read by ``read_entry``) as the KV of ``token_ids`` (at least
    ``stored.num_tokens`` of them) under ``contract`` (the RoPE the keys should carry) against
    ``reference_keys[i] [>= T, KVH, D]`` (and ``reference_values``), rows = positions ``0..``.
    ``block_size`` (default the contract's) names block-local positions."""
    T = stored.num_tokens
    ids = torch.as_tensor(token_ids).reshape(-1)
    if ids.numel() < T:
        raise UsageError(f"check_entry: the entry holds {T} tokens, {ids.numel()} token ids given")
    if len(reference_keys) != stored.num_layers or (
        reference_values is not None and len(reference_values) != stored.num_layers
    ):
        raise UsageError(f"check_entry: {stored.num_layers} stored layers, {len(reference_keys)} reference layers")
    if contract.num_layers != stored.num_layers:
        raise PayloadError(
            f"vLLM store entry: {stored.num_layers} layers, the contract's model has {contract.num_layers}"
        )
    B = contract.block_size if block_size is None else block_size
    tol = key_tolerance(stored.dtype)
    findings = []
    for i in range(stored.num_layers):
        ref = reference_keys[i][:T].to(torch.float64)
        if tuple(ref.shape) != tuple(stored.keys[i].shape):
            raise UsageError(
                f"check_entry: layer {i}: reference keys {tuple(ref.shape)}, stored {tuple(stored.keys[i].shape)}"
            )
        rope = contract.layer_rope(i)
        values_error = None
        if reference_values is not None:
            values_error = relative_error(stored.values[i], reference_values[i][:T])
        findings.append(_layer(i, stored.keys[i].to(torch.float64), ref, rope, tol, B, values_error))
    return EntryCheck(T, tuple(findings))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest ``|got - want| / |want|`` over vectors ``[..., D]`` (per token and head)."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(_TINY)).max())


def _layer(
    i: int, stored: torch.Tensor, ref: torch.Tensor, rope: RopeSpec | None, tol: float, B: int, values_error
) -> LayerFinding:
    """One layer: ``stored``, ``ref [T, KVH, D]`` float64."""
    T = stored.shape[0]
    error = relative_error(stored, ref)

    def finding(verdict: Verdict, kind: BugClass | None, detail: str, **extra) -> LayerFinding:
        return LayerFinding(i, verdict, kind, error, tol, detail, values_error=values_error, **extra)

    if error <= tol:
        return finding("matches", None, f"token t's key is the reference's at position t for all {T} tokens")
    if rope is None:  # a layer without position embedding: nothing to recover
        return finding("unrecognized", BugClass.UNKNOWN, "a NoPE layer whose keys are not the reference's")
    t = torch.arange(T)
    raw = rope.unrotate(ref, t)  # [T, KVH, D] the reference's keys before RoPE
    pas = slice(rope.rotary_offset + rope.rotary_dim, None)
    if rope.rotary_dim < rope.head_dim and relative_error(stored[..., pas], raw[..., pas]) > tol:
        return finding("other_keys", BugClass.UNKNOWN, "the channels RoPE leaves alone differ: keys of other tokens")
    rot = slice(rope.rotary_offset, rope.rotary_offset + rope.rotary_dim)
    mag = _magnitude_deviation(raw[..., rot], stored[..., rot], rope.layout, rope.rotary_dim)
    if mag > MAG_TOL:
        return finding(
            "other_keys",
            BugClass.UNKNOWN,
            f"pair magnitudes (which any rotation keeps) differ by {mag:.2g} on average: the keys of other tokens "
            "or of another model (a forged or colliding entry)",
        )
    candidates = torch.arange(-MAX_SHIFT, T + MAX_SHIFT)
    pos, fit = effective_positions(
        raw[..., rot], stored[..., rot], rope.inv_freq(), rope.layout, rope.rotary_dim, candidates
    )
    if bool((fit >= FIT_OK).all()):
        return _positions(finding, pos, t, B, rope, raw, stored, tol)
    return _frequencies(finding, rope, raw, stored, tol)


def _positions(finding, pos: torch.Tensor, t: torch.Tensor, B: int, rope, raw, stored, tol) -> LayerFinding:
    T = t.numel()
    d = pos - t
    at = f"recovered positions {_sample(pos)} for tokens {_sample(t)}"
    if bool((pos == t).all()):
        return finding("unrecognized", BugClass.UNKNOWN, f"positions right ({at}) but values beyond tolerance")
    if bool((pos == 0).all()):
        return finding("raw", BugClass.MISSING_ROTATION, f"keys stored unrotated: every token at position 0 ({at})")
    if bool((d == d[0]).all()):
        s = int(d[0])
        err = relative_error(stored, rope.rotate(raw, t + s))
        return finding(
            "shifted", BugClass.KEY_POSITION_OFFSET, f"every key sits at t {s:+d} (error {err:.2g} there)", shift=s
        )
    if T > 1 and bool((pos == 2 * t).all()):
        return finding("double_rotation", BugClass.DOUBLE_ROTATION, f"keys rotated twice: at 2t ({at})")
    if T > B and bool((pos == t % B).all()):
        return finding("block_local", BugClass.BLOCK_LOCAL_POSITION, f"keys at their offset in a block of {B} ({at})")
    return finding("other_positions", BugClass.UNKNOWN, f"integer rotations at other positions: {at}")


def _frequencies(finding, rope: RopeSpec, raw: torch.Tensor, stored: torch.Tensor, tol: float) -> LayerFinding:
    """Rotations at ``t`` under another base, a uniform frequency scale, or the other pairing."""
    T = raw.shape[0]
    t = torch.arange(T)
    other = "gptj" if rope.layout == "neox" else "neox"
    err = relative_error(stored, rope.replace(layout=other).rotate(raw, t))
    if err <= tol:
        return finding("other_layout", BugClass.LAYOUT_MISMATCH, f"rotated at t with the {other} channel pairing")
    if rope.length_dependent:
        return finding("unrecognized", BugClass.UNKNOWN, "not integer rotations of the reference's keys")
    best = (float("inf"), 1.0)
    for grid in (2.0 ** (torch.arange(-320, 321) / 64), 2.0 ** (torch.arange(-64, 65) / 4096)):
        for x in (best[1] * grid.double()).tolist():
            e = relative_error(stored, rope.replace(theta=rope.theta * x).rotate(raw, t))
            best = min(best, (e, x))
    err, x = best
    theta = rope.theta * x
    if err <= tol:
        return finding(
            "other_frequencies",
            BugClass.FREQUENCY_MISMATCH,
            f"rotated at t with base theta {theta:.6g}, not {rope.theta:.6g} (error {err:.2g} there)",
            theta=theta,
        )
    scale = _scale(rope, raw, stored, t)
    if scale is not None and scale[0] <= tol:
        return finding(
            "other_frequencies",
            BugClass.FREQUENCY_MISMATCH,
            f"rotated at t with every frequency times {scale[1]:.6g} (linear position scaling by "
            f"{1 / scale[1]:.6g}; error {scale[0]:.2g} there)",
        )
    return finding(
        "unrecognized",
        BugClass.UNKNOWN,
        f"rotations of the reference's keys, but at no integer positions and no single base (best theta "
        f"{theta:.6g}: error {err:.2g})",
    )


def _scale(rope: RopeSpec, raw, stored, t) -> tuple[float, float] | None:
    if rope.scaling.rope_type not in ("default", "linear"):
        return None
    factor = rope.scaling.factor or 1.0
    best = (float("inf"), 1.0)
    for grid in (2.0 ** (torch.arange(-320, 321) / 64), 2.0 ** (torch.arange(-64, 65) / 4096)):
        for x in (best[1] * grid.double()).tolist():
            spec = rope.replace(scaling=RopeScaling(rope_type="linear", factor=factor / x))
            best = min(best, (relative_error(stored, spec.rotate(raw, t)), x))
    return best


def _magnitude_deviation(raw: torch.Tensor, eff: torch.Tensor, layout: str, rotary_dim: int) -> float:
    """Mean relative deviation of the stored pairs' magnitudes from the raw ones' (0 for any rotation)."""
    a, b = pair_channels(rotary_dim, layout)
    r = torch.complex(raw[..., a], raw[..., b]).abs().flatten(1)  # [T, KVH * n]
    c = torch.complex(eff[..., a], eff[..., b]).abs().flatten(1)
    return float(((c - r).abs().sum(1) / r.sum(1).clamp_min(_TINY)).max())


def _sample(x: torch.Tensor, k: int = 4) -> str:
    if x.numel() <= 2 * k:
        return str(x.tolist())
    return f"[{', '.join(map(str, x[:k].tolist()))}, ..., {', '.join(map(str, x[-2:].tolist()))}]"


def _ranges(layers: list[int]) -> str:
    out, start = [], None
    for j, n in enumerate(layers):
        if start is None:
            start = n
        if j + 1 == len(layers) or layers[j + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


__all__ = ["EntryCheck", "LayerFinding", "check_entry", "key_tolerance", "reference_kv", "relative_error"]
