"""missing_rotation: raw keys stored and read as if rotated; every key sits at position 0.

The writer skipped RoPE (or quantized before it, or a cache holding raw keys met a reader that
assumes rotated ones): key ``j`` reaches the kernel unturned, at phase 0, while the query sits at
``t``. Position 0 hides it; any decode past it shows it from layer 0. The evidence names the keys at 0
(all of them, or the rows and heads that skipped the rotation).
"""

from __future__ import annotations

import torch

from ..cache.policy import CacheOpPolicy
from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import position_match

KIND = BugClass.MISSING_ROTATION


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None:
        return None
    j = km.keys.positions

    def text(which: str, query: bool) -> str:
        parts = [f"{which} sit at position 0 (stored raw, read as if rotated)"] if which else []
        if query:
            parts.append("the query sits at 0 too (not rotated)")
        return "; ".join(parts)

    return position_match(ev, KIND, keys=torch.zeros_like(j), query=0, informative=j != 0, text=text)


def shows(case: Case) -> bool:
    return case.prefix + case.length > 1


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class MissingRotation(RotationPolicy):
    """The writer stores raw keys in a cache whose reader assumes rotated ones (key at 0)."""

    name = "missing-rotation"

    def write_key(self, rope, k, positions, slots, ctx):
        return k if ctx.cached else super().write_key(rope, k, positions, slots, ctx)


class QuantizedBeforeRope(CacheOpPolicy):
    """A rotated-key cache whose writer quantizes the keys before the rotary kernel turned them."""

    name = "fp8-quantized-before-rope"

    def quantized_keys(self, rope, keys, positions):
        return keys if rope is None else rope.unrotate(keys.to(torch.float64), positions.cpu()).to(keys.dtype)


_DECODE = (Case(length=17, block_size=7, decode_steps=2),)


_WHERE = "an fp8 KV cache (float8_e4m3fn, per-tensor scales)"


FAULTS = (
    NativeFault(
        name="missing-rotation",
        kind=KIND,
        description="raw keys stored where rotated ones are expected",
        key_form="rotated",
        shows_when="any decode past position 0",
        rotation=MissingRotation,
    ),
    NativeFault(
        name="fp8-quantized-before-rope",
        kind=KIND,
        description=f"{_WHERE}, rotated keys: the writer quantizes keys before RoPE, no reader rotates them",
        key_form="rotated",
        fixed_key_form=True,
        shows_when="any read of cached rows past position 0",
        cache_ops=QuantizedBeforeRope,
        kv_dtype="fp8",
        exposing=_DECODE,
    ),
)
