"""double_rotation: keys rotated when written and again when read; they sit at ``2j``.

A rotated cache read by a kernel that rotates on read (or a writer that turns keys twice) puts key
``j`` at ``2j`` (``k`` rotations: ``k j``) while the query sits at ``t``. ``R(0) = I`` hides it at
``j = 0``; every decode past position 0 shows it, from layer 0. The evidence names the keys at ``k j``
(a subset of heads, rows or phases where only those were turned twice) and the multiple.
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

KIND = BugClass.DOUBLE_ROTATION


def _sentence(m: int, t: int):
    times = "twice" if m == 2 else f"{m} times"

    def text(which: str, query: bool) -> str:
        parts = [f"{which} sit at {m}j: rotated {times} (when written and again when read)"] if which else []
        if query:
            parts.append(f"the query sits at {m} x {t} = {m * t}")
        return "; ".join(parts)

    return text


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None:
        return None
    j, t = km.keys.positions, ev.facts.query_position
    exp = km.keys.expected  # [N, S]: under M-RoPE each section turns by its own stream
    # turned again by the streams (m x each) or, under M-RoPE, by the plain position (streams + (m-1) j)
    shapes = [(m, m * exp) for m in (2, 3, 4)]
    if exp.shape[1] > 1:
        shapes += [(m, exp + (m - 1) * j[:, None]) for m in (2, 3, 4)]
    found = [
        position_match(
            ev,
            KIND,
            keys=pred if pred.shape[1] > 1 else pred[:, 0],
            query=m * t,
            informative=j != 0,
            text=_sentence(m, t),
            details={"rotations": m},
        )
        for m, pred in shapes
    ]
    return max((f for f in found if f is not None), key=lambda f: f.score, default=None)


def shows(case: Case) -> bool:
    return case.prefix + case.length > 1


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class DoubleRotation(RotationPolicy):
    """Decode reads rotated keys and rotates them again (key at 2j)."""

    name = "double-rotation"

    def read_keys(self, rope, stored, rotation_index, slots, ctx, *, backend_rotates):
        if ctx.phase == "decode" and rope is not None:  # NoPE layers have nothing to rotate twice
            return rope.rotate(stored.float(), rotation_index, ctx.seq_len)
        return super().read_keys(rope, stored, rotation_index, slots, ctx, backend_rotates=backend_rotates)


class QuantizedAfterRope(CacheOpPolicy):
    """A raw-key cache whose writer turns the keys to their positions before quantizing them."""

    name = "fp8-quantized-after-rope"

    def quantized_keys(self, rope, keys, positions):
        return keys if rope is None else rope.rotate(keys.to(torch.float64), positions.cpu()).to(keys.dtype)


_DECODE = (Case(length=17, block_size=7, decode_steps=2),)


_WHERE = "an fp8 KV cache (float8_e4m3fn, per-tensor scales)"


FAULTS = (
    NativeFault(
        name="double-rotation",
        kind=KIND,
        description="decode rotates already-rotated keys again",
        key_form="rotated",
        shows_when="any decode past position 0",
        rotation=DoubleRotation,
    ),
    NativeFault(
        name="fp8-quantized-after-rope",
        kind=KIND,
        description=f"{_WHERE}, raw keys: the writer rotates keys before quantizing, the reader rotates again",
        key_form="raw",
        fixed_key_form=True,
        shows_when="any read of cached rows past position 0",
        cache_ops=QuantizedAfterRope,
        kv_dtype="fp8",
        exposing=_DECODE,
    ),
)
