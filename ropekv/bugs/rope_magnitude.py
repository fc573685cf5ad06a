"""rope_magnitude: angles right, lengths wrong: the attention factor dropped or applied twice.

YaRN and LongRoPE put an attention factor ``A`` on cos and sin, so the query and every key carry it
and every score ``A^2``. An engine that leaves ``A`` out of one path, or applies it twice, turns
queries and keys to the right positions at the wrong length (vLLM #46280, SGLang #22711, exllamav3
#259): outputs stay fluent while every score is scaled. The fit measures each token's length against
the contract's ``A R(p) r``; the evidence gives each scale as a count of attention factors.
"""

from __future__ import annotations

import math

import torch

from ..faults.native import NativeFault
from ..faults.shapes import DecodeSideSpec
from ..models.config import Checkpoint
from ..models.rope_config import attention_factor_of
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.cells import Cells, rows_of, scope_of, share, span_text
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.keymap.record import SCALE_TOL
from ..rope import RopeScaling, RopeSpec

KIND = BugClass.ROPE_MAGNITUDE


def power_of(s: float, a: float) -> int | None:
    """``k`` where ``s = a^k`` for an integer ``k`` (``a`` the attention factor, not 1), else None."""
    if a == 1.0 or a <= 0 or s <= 0:
        return None
    k = math.log(s) / math.log(a)
    return round(k) if abs(k - round(k)) < 0.05 else None


def _times(s: float, a: float) -> str:
    k = power_of(s, a)
    if k is not None:
        n = k + 1
        return f"the attention factor {a:.4f} applied {n} time{'' if n == 1 else 's'} instead of once"
    return f"a factor {s:.4f} beyond the attention factor {a:.4f}"


def clean_scale(scale: torch.Tensor, residual: torch.Tensor, noise: float) -> torch.Tensor:
    """Cells whose length is off by more than the tolerance while what is left after it is noise."""
    return ((scale - 1).abs() > max(SCALE_TOL, noise / 2)) & (residual <= noise)


def _power(s: float, a: float) -> str:
    """`` (A^k)`` where ``s`` is a nonzero integer power of the attention factor ``a``, else ""."""
    k = power_of(s, a)
    return f" (A^{k})" if k not in (None, 0) else ""


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.rope is None:
        return None
    a = km.rope.attention_factor
    k, q = km.keys, km.query
    q_cells = (q.placed() & clean_scale(q.scale, q.residual, km.noise))[0]
    k_cells = k.placed() & clean_scale(k.scale, k.residual, km.noise)
    # keys alone scaled: only a power of the attention factor says it is the RoPE's length
    keys_alone = not bool(k_cells.any()) or not all(power_of(float(s), a) not in (None, 0) for s in k.scale[k_cells])
    if not bool(q_cells.any()) and keys_alone:
        return None
    cells = Cells(k_cells, q_cells)
    sq = float(q.scale[0][q_cells].mean()) if bool(q_cells.any()) else 1.0
    parts = [
        f"the query x{sq:.4f} (|c|/|r| {sq * a:.4f}: {_times(sq, a)})" if bool(q_cells.any()) else "the query right"
    ]
    rows = k_cells.any(1)
    right = k.placed().all(1) & ~rows
    groups: list[tuple[float, torch.Tensor]] = []
    if bool(right.any()):
        groups.append((1.0, right))
    row_scale = k.scale.mean(1)
    idx = torch.nonzero(rows).flatten()
    order = idx[row_scale[idx].argsort()]
    start = 0
    for i in range(1, order.numel() + 1):  # runs of sorted scales no more than SCALE_TOL apart
        if i == order.numel() or float(row_scale[order[i]] - row_scale[order[i - 1]]) > SCALE_TOL:
            sel = torch.zeros_like(rows)
            sel[order[start:i]] = True
            groups.append((float(row_scale[order[start:i]].mean()), sel))
            start = i
    scores = []
    for s, sel in groups:
        n = int(sel.sum())
        if n == 0:
            continue
        pos = k.positions[sel].tolist()
        noun, at = ("key", "position") if n == 1 else ("keys", "positions")
        if s == 1.0:
            parts.append(f"{n} {noun} right ({at} {span_text(pos)})")
        else:
            sk = float(k.scale[sel].mean())
            parts.append(f"{n} {noun} x{sk:.4f} ({at} {span_text(pos)}; |c|/|r| {sk * a:.4f}: {_times(sk, a)})")
        score = sq * (1.0 if s == 1.0 else float(k.scale[sel].mean()))
        if abs(score - 1) > SCALE_TOL:
            scores.append(f"x{score:.4f}{_power(score, a)} against the {noun} at {span_text(pos)}")
    text = (
        f"angles right at the query and every key, lengths wrong (the contract's attention factor is {a:.4f}): "
        + ", ".join(parts)
        + ("; scores " + ", ".join(scores) if scores else "")
    )
    details = {
        "attention_factor": a,
        "query_scale": sq,
        "key_scales": [1.0 if s == 1.0 else float(k.scale[sel].mean()) for s, sel in groups if bool(sel.any())],
        "scaled_keys": int(rows.sum()),
    }
    return Match(KIND, share(km, cells), text, scope_of(km, cells), details, rows_of(k_cells))


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class _DecodeSideFactor(DecodeSideSpec):
    """The decode step turns with the contract's angles but another attention factor."""

    def factor(self, rope: RopeSpec) -> float:
        raise NotImplementedError

    def spec(self, rope: RopeSpec | None, ctx) -> RopeSpec | None:
        return None if rope is None else rope.replace(attention_factor=self.factor(rope))


class AttentionFactorDropped(_DecodeSideFactor):
    """The decode side builds cos/sin from the frequencies alone: the attention factor is left out."""

    name = "yarn-attention-factor-dropped"

    def factor(self, rope):
        return 1.0


class AttentionFactorTwice(_DecodeSideFactor):
    """The decode side applies the attention factor twice (its cos/sin cache and its kernel both scale)."""

    name = "yarn-attention-factor-twice"

    def factor(self, rope):
        return rope.attention_factor**2


def _has_attention_factor(ckpt: Checkpoint) -> bool:
    cfg = ckpt.config
    return any(r is not None and r.attention_factor != 1.0 for r in (cfg.layer_rope(i) for i in range(cfg.num_layers)))


def yarn_variant(ckpt: Checkpoint, original_max: int = 64, factor: float = 4.0) -> Checkpoint:
    """The same weights under YaRN RoPE (``factor``, original length ``original_max``), with
    transformers' default attention factor for it (``0.1 ln(factor) + 1``: 1.1386 for factor 4)."""
    rope = ckpt.config.rope
    scaling = RopeScaling("yarn", factor=factor, original_max_position_embeddings=original_max)
    yarn = rope.replace(
        scaling=scaling, attention_factor=attention_factor_of(scaling, None, rope.max_position_embeddings)
    )
    return ckpt.with_config(ckpt.config.replace(rope=yarn))


def _yarn_unless_scaled(ckpt: Checkpoint) -> Checkpoint:
    return ckpt if _has_attention_factor(ckpt) else yarn_variant(ckpt)


# A decode past position 0 with a few cached keys and two decode steps (the second reads a key the
# first decode step wrote under the faulty factor); raw keys are covered by ``--key-form raw``.
_EXPOSING = (Case(length=17, block_size=7, decode_steps=2), Case(length=40, block_size=16, decode_steps=2))


FAULTS = (
    NativeFault(
        name="yarn-attention-factor-dropped",
        kind=KIND,
        description="decode side leaves out YaRN's attention factor (YaRN factor 4 unless the model scales)",
        key_form="rotated",
        shows_when="any decode (a model whose attention factor is not 1)",
        rotation=AttentionFactorDropped,
        model=_yarn_unless_scaled,
        exposing=_EXPOSING,
    ),
    NativeFault(
        name="yarn-attention-factor-twice",
        kind=KIND,
        description="decode side applies YaRN's attention factor twice (YaRN factor 4 unless the model scales)",
        key_form="rotated",
        shows_when="any decode (a model whose attention factor is not 1)",
        rotation=AttentionFactorTwice,
        model=_yarn_unless_scaled,
        exposing=_EXPOSING,
    ),
)
