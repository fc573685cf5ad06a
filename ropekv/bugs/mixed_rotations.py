"""mixed_rotations: one cache holding keys rotated under two specs, each over its own range of rows.

LongRoPE turns a sequence with its short factors while it fits in ``original_max_position_embeddings``
and with its long factors past it. An engine that picks per forward (a prefill chunk's end, a batch's
longest row, each decode step's length) and never turns cached keys again keeps early rows under one
set and later rows under the other, while the query turns under the set the contract says for it.
The evidence gives the ranges and the factor set of each (uzu #604, vLLM #27414, llama.cpp #24875).
"""

from __future__ import annotations

import dataclasses

import torch

from ..engine.rotation import RotationPolicy, StepContext
from ..faults.native import NativeFault
from ..models.config import Checkpoint
from ..models.rope_config import attention_factor_of
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.cells import Cells, rows_of, scope_of, share
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..rope import RopeScaling

KIND = BugClass.MIXED_ROTATIONS
MAX_RUNS = 4  # contiguous ranges a mixed cache may hold


def _run_text(i: int, a: int, b: int, factors: str) -> str:
    span = f"{a}..{b}" if b > a else f"{a}"
    if i == 0:
        return f"keys at positions {span} rotated under LongRoPE's {factors} factors"
    return f"{span} under its {factors} factors"


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.rope is None or km.rope.scaling.rope_type != "longrope":
        return None
    other = [i for i, r in enumerate(km.rotations) if r.kind == "length"]
    if not other:
        return None
    k = km.keys
    fits = k.ok & k.own_content & k.at_expected
    at_other = (fits & torch.isin(k.rotation, torch.tensor(other))).all(1)
    at_contract = (fits & (k.rotation == 0)).all(1)
    if not bool(at_other.any()) or not bool(at_contract.any()):
        return None
    q = km.query
    q_fits = q.ok & q.own_content & q.at_expected
    q_contract, q_other = (
        bool((q_fits & (q.rotation == 0)).all()),
        bool((q_fits & torch.isin(q.rotation, torch.tensor(other))).all()),
    )
    if not (q_contract or q_other):
        return None  # the query turned under neither factor set: something else is wrong with it
    label = torch.where(at_other, 1, torch.where(at_contract, 0, -1))
    # a key where both factor sets turn alike (position 0, where every rotation is the identity) takes
    # the label of its nearest decidable neighbour (the earlier one on a tie)
    orig0 = km.rope.scaling.original_max_position_embeddings or 0
    apart = (km.rope.inv_freq(orig0) - km.rope.inv_freq(orig0 + 1)).abs().max()
    alike = (k.positions.double() * apart < 1e-3) & (label >= 0)
    decided = torch.nonzero((label >= 0) & ~alike).flatten()
    for i in torch.nonzero(alike).flatten().tolist():
        if decided.numel():
            d = (k.positions[decided] - k.positions[i]).abs()
            label[i] = label[decided[int(d.argmin())]]
    order = k.positions.argsort()
    runs: list[list[int]] = []
    for i in order.tolist():
        v = int(label[i])
        if v < 0:
            continue
        p = int(k.positions[i])
        if runs and runs[-1][2] == v:
            runs[-1][1] = p
        else:
            runs.append([p, p, v])
    if len(runs) > MAX_RUNS:
        return None
    orig = km.rope.scaling.original_max_position_embeddings or 0
    contract_set = "long" if km.seq_len > orig else "short"
    other_set = "short" if contract_set == "long" else "long"
    names = {0: contract_set, 1: other_set}
    text = ", ".join(_run_text(i, a, b, names[v]) for i, (a, b, v) in enumerate(runs))
    q_ok = q_contract
    text += (
        f"; the contract says {contract_set} for all (sequence length {km.seq_len} "
        f"{'>' if contract_set == 'long' else '<='} original_max_position_embeddings {orig}); the query at "
        f"{km.query_position} under the {contract_set if q_ok else other_set} factors: one cache holds two "
        "rotations (the factors chosen per forward, and cached keys never turned again)"
    )
    cells = Cells(at_other[:, None].expand_as(fits) & fits, torch.zeros(km.query.heads, dtype=torch.bool))
    count = {name: int(((label == v) & (label >= 0)).sum()) for v, name in names.items()}
    details = {
        "runs": [[a, b, names[v]] for a, b, v in runs],
        "contract_factors": contract_set,
        "switch_length": orig,
        "short_keys": count["short"],
        "long_keys": count["long"],
        "misfit_keys": int((label < 0).sum()),
        "query_factors": contract_set if q_contract else other_set,
    }
    return Match(KIND, share(km, cells), text, scope_of(km, cells), details, rows_of(cells.keys))


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


ORIGINAL_MAX = (
    64  # the variant's switch length: past the first chunk (40) of the exposing case, inside its prompt (100)
)


class LongRopeFactorPerChunk(RotationPolicy):
    """Rotated keys under LongRoPE, its factors chosen per forward from the forward's own last position
    + 1 (a prefill chunk's end) instead of the length the whole prefill reaches."""

    name = "longrope-factor-per-chunk"

    def check_contract(self, contract) -> None:
        return None  # rotated keys kept under a length-dependent RoPE, as the engines that showed it do

    @staticmethod
    def _per_forward(ctx: StepContext, positions) -> StepContext:
        return dataclasses.replace(ctx, seq_len=int(positions.max()) + 1)

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, positions, self._per_forward(ctx, positions))

    def write_key(self, rope, k, positions, slots, ctx):
        return super().write_key(rope, k, positions, slots, self._per_forward(ctx, positions))


def _factors(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Short and long factors for ``n`` pairs, shaped like Phi-3.5's: the short ones from 1 to 2, the
    long ones from 1.5 to 16, growing towards the low frequencies; they differ on every pair."""
    x = [m / (n - 1) for m in range(n)] if n > 1 else [0.0]
    return tuple(1.0 + v for v in x), tuple(1.5 + 14.5 * v**2 for v in x)


def longrope_variant(ckpt: Checkpoint, original_max: int = ORIGINAL_MAX) -> Checkpoint:
    """The same weights under LongRoPE switching past ``original_max`` tokens: the model's own short
    and long factors where it has them, else :func:`_factors` (``rotary_dim / 2`` each); the factor
    ``max_position_embeddings / original_max`` and its attention factor
    (``sqrt(1 + ln(factor) / ln(original_max))``), as transformers derives them from such a config."""
    rope = ckpt.config.rope
    own = rope.scaling if rope.scaling.rope_type == "longrope" else None
    short, long = (own.short_factor, own.long_factor) if own is not None else _factors(rope.rotary_dim // 2)
    scaling = RopeScaling(
        "longrope",
        factor=rope.max_position_embeddings / original_max,
        short_factor=short,
        long_factor=long,
        original_max_position_embeddings=original_max,
    )
    longrope = rope.replace(
        scaling=scaling, attention_factor=attention_factor_of(scaling, None, rope.max_position_embeddings)
    )
    return ckpt.with_config(ckpt.config.replace(rope=longrope))


# A prompt of 100 tokens in chunks of 40: the first chunk ends at 40 <= 64 (short factors), the others
# at 80 and 100 (long), and every decode from 100 on is long; an odd block size.
_EXPOSING = (Case(length=100, chunk=40, block_size=7),)


def _switch_in_case(ckpt: Checkpoint) -> bool:
    """A LongRoPE model whose switch the exposing case crosses between its first chunk and its end."""
    rope = ckpt.config.rope
    orig = rope.scaling.original_max_position_embeddings
    return rope.scaling.rope_type == "longrope" and orig is not None and 40 <= orig < 100


def _longrope_unless_crossed(ckpt: Checkpoint) -> Checkpoint:
    return ckpt if _switch_in_case(ckpt) else longrope_variant(ckpt)


FAULTS = (
    NativeFault(
        name="longrope-factor-per-chunk",
        kind=KIND,
        description="rotated keys, LongRoPE's short/long factors chosen per prefill chunk "
        "(LongRoPE with original length 64 unless the model's switch lies in the case)",
        key_form="rotated",
        shows_when="a chunked prefill whose first chunk ends inside the original length and whose prompt ends past it",
        rotation=LongRopeFactorPerChunk,
        model=_longrope_unless_crossed,
        fixed_key_form=True,
        exposing=_EXPOSING,
    ),
)
