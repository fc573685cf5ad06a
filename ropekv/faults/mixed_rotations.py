"""Mixed rotations in one cache: LongRoPE's short or long factors chosen per forward.

LongRoPE (Phi-3, Phi-4) turns a sequence with its ``short_factor`` while it fits in
``original_max_position_embeddings`` and with its ``long_factor`` past it
(:meth:`~ropekv.rope.RopeSpec.inv_freq`; transformers' ``longrope_frequency_update`` picks per forward
from ``max(position_ids) + 1``). That rule is right for one unchunked forward. An engine that applies it
to every forward of a chunked prefill gives the chunks that end inside the original length the short
factors and the later ones the long factors, and keeps both in one rotated cache: uzu #604 (a
5511-token prompt in 6 chunks, the first 4 short), vLLM #27414 (the choice made per batch, so
concurrent requests flip it), llama.cpp #24875 (chosen per sequence length, cached keys not turned
again when the length crosses). ropekv's engine turns every chunk of a prefill under the factors of
the length the whole prefill reaches (:meth:`~ropekv.engine.Engine.prefill`), as one unchunked
forward does; the fault here chooses from each chunk's end instead, and keeps rotated keys (as those
engines do) where the correct engine refuses them for length-dependent RoPE. It needs a LongRoPE model
whose switch a chunked case crosses: :func:`longrope_variant`.
"""

from __future__ import annotations

import dataclasses

from ..engine.rotation import RotationPolicy, StepContext
from ..models.config import Checkpoint
from ..models.rope_config import attention_factor_of
from ..parity.cases import Case
from ..rope import RopeScaling
from .native import NativeFault

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


CATALOGUE: tuple[NativeFault, ...] = (
    NativeFault(
        name="longrope-factor-per-chunk",
        kind="mixed_rotations",
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
