"""RoPE magnitude faults: the angles are right, the length is not.

YaRN (and LongRoPE) scale cos and sin by an attention factor ``A`` (YaRN's ``mscale``:
``0.1 ln(factor) + 1``), so the query and every key carry ``A`` and every attention logit ``A**2``
(:attr:`~ropekv.rope.RopeSpec.attention_factor`). An engine that leaves ``A`` out of one path, or
applies it twice (once in its cos/sin cache and once in its kernel), turns queries and keys to the
right positions at the wrong length: outputs stay fluent while every score is scaled. Each fault
here changes only the decode side's attention factor, so prefill (and the engine's own cache-free
forward) stay right. They need a model whose attention factor is not 1: :func:`yarn_variant`.
"""

from __future__ import annotations

from ..models.config import Checkpoint
from ..models.rope_config import attention_factor_of
from ..parity.cases import Case
from ..rope import RopeScaling, RopeSpec
from .decode_side import DecodeSideSpec
from .native import NativeFault


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

CATALOGUE: tuple[NativeFault, ...] = (
    NativeFault(
        name="yarn-attention-factor-dropped",
        kind="rope_magnitude",
        description="decode side leaves out YaRN's attention factor (YaRN factor 4 unless the model scales)",
        key_form="rotated",
        shows_when="any decode (a model whose attention factor is not 1)",
        rotation=AttentionFactorDropped,
        model=_yarn_unless_scaled,
        exposing=_EXPOSING,
    ),
    NativeFault(
        name="yarn-attention-factor-twice",
        kind="rope_magnitude",
        description="decode side applies YaRN's attention factor twice (YaRN factor 4 unless the model scales)",
        key_form="rotated",
        shows_when="any decode (a model whose attention factor is not 1)",
        rotation=AttentionFactorTwice,
        model=_yarn_unless_scaled,
        exposing=_EXPOSING,
    ),
)
