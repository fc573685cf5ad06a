"""Generated variants of the bug classes: faults ropekv's catalogue does not hold, to measure whether a
class is named on bugs nobody wrote as a catalogue entry.

A catalogued fault is one shape of its class (keys at ``j + 1`` on every head, every layer, every
phase). An engine's real bug is another: keys at ``j - 3`` on one KV head, at their block's first
position, turned twice only on layer 1, only in prefill chunks after the first. :class:`Misturn` is
one rotation policy that writes such bugs from parts: which tensor goes wrong (the query or the keys
written to the cache), where (:class:`Scope`: phases, layers, KV heads, positions from some point on),
and how (another position as a function of the position, another spec, a rotation done twice or not
at all, angles in a narrower dtype). :class:`Variant` pairs such a fault with cases and the class the
check must name, or with ``expect=None``: a control, a case where the fault's trigger never happens,
which must pass.

:func:`generated` lists them by class; ``scripts/forensics_confusion.py`` runs them all and prints the
record (docs/forensics.md), and ``tests/test_variants.py`` asserts a sample: each named right, each
control passing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engine.rotation import RotationPolicy, StepContext, rotate
from ..errors import ConfigError
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, Case, OpKind
from ..rope import RopeScaling, RopeSpec, apply_rotation
from .native import NativeFault

# How a turn goes wrong: (spec, x [n, H, D], positions [n], ctx) -> the wrongly turned x.
Turn = Callable[[RopeSpec, torch.Tensor, torch.Tensor, StepContext], torch.Tensor]


@dataclass(frozen=True)
class Scope:
    """Where a variant's fault acts: step phases, layers, heads (of the tensor turned: KV heads for
    keys, query heads for a query), and tokens at positions ``>= from_position``. ``None``: everywhere."""

    phases: tuple[str, ...] = ("prefill", "decode", "verify")
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    from_position: int = 0

    def __post_init__(self) -> None:
        if not self.phases or any(p not in ("prefill", "decode", "verify") for p in self.phases):
            raise ConfigError(f"variant scope phases must be prefill/decode/verify, got {self.phases!r}")
        if self.from_position < 0:
            raise ConfigError(f"variant scope from_position must be >= 0, got {self.from_position}")

    def acts(self, ctx: StepContext) -> bool:
        return ctx.phase in self.phases and (self.layers is None or ctx.layer in self.layers)


def shifted(delta: int) -> Turn:
    """Turned at ``p + delta`` (clamped at 0)."""
    return lambda rope, x, p, ctx: rotate(rope, x, (p + delta).clamp(min=0), ctx)


def mapped(f: Callable[[torch.Tensor], torch.Tensor]) -> Turn:
    """Turned at ``f(p)``: a position that is a function of the position (block start, ring slot)."""
    return lambda rope, x, p, ctx: rotate(rope, x, f(p), ctx)


def times(m: int) -> Turn:
    """Turned ``m`` times (``m = 0``: not at all)."""

    def turn(rope: RopeSpec, x: torch.Tensor, p: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        for _ in range(m):
            x = rope.rotate(x.float(), p, ctx.seq_len).to(x.dtype)
        return x

    return turn


def respec(change: Callable[[RopeSpec], RopeSpec]) -> Turn:
    """Turned by another spec (another theta, scaling, pairing layout)."""
    return lambda rope, x, p, ctx: change(rope).rotate(x.float(), p, ctx.seq_len).to(x.dtype)


def narrow_angles(dtype: torch.dtype) -> Turn:
    """Turned by angles ``p * inv_freq`` rounded to ``dtype`` (the cos/sin computed from them in float32)."""

    def turn(rope: RopeSpec, x: torch.Tensor, p: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        ang = rope.angles(p, ctx.seq_len).to(dtype).to(torch.float64)
        a = rope.attention_factor
        return _apply(rope, x, torch.cos(ang) * a, torch.sin(ang) * a)

    return turn


def _apply(rope: RopeSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rotation(x.to(torch.float64), cos, sin, rope.layout, rope.rotary_offset).to(x.dtype)


class Misturn(RotationPolicy):
    """Correct rotation except for ``target`` (``"query"``, ``"key"``: the keys a rotated cache stores,
    or ``"both"``) inside ``scope``, which ``turn`` turns instead."""

    name = "misturn"

    def __init__(self, target: str, scope: Scope, turn: Turn) -> None:
        if target not in ("query", "key", "both"):
            raise ConfigError(f"a misturn's target is 'query', 'key' or 'both', got {target!r}")
        self.target, self.scope, self.turn = target, scope, turn

    def _mix(
        self, rope: RopeSpec | None, x: torch.Tensor, right: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        if rope is None or not self.scope.acts(ctx):
            return right
        rows = positions >= self.scope.from_position  # [n]
        if not bool(rows.any()):
            return right
        wrong = self.turn(rope, x, positions, ctx).to(right.dtype)  # [n, H, D]
        out = right.clone()
        heads = torch.ones(x.shape[1], dtype=torch.bool)
        if self.scope.heads is not None:
            heads = torch.zeros(x.shape[1], dtype=torch.bool)
            heads[[h for h in self.scope.heads if h < x.shape[1]]] = True
        sel = rows[:, None] & heads[None, :]  # [n, H]
        out[sel] = wrong[sel]
        return out

    def query(self, rope: RopeSpec | None, q: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        right = super().query(rope, q, positions, ctx)
        return self._mix(rope, q, right, positions, ctx) if self.target != "key" else right

    def write_key(
        self, rope: RopeSpec | None, k: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        right = super().write_key(rope, k, positions, slots, ctx)
        return self._mix(rope, k, right, positions, ctx) if self.target != "query" else right


@dataclass(frozen=True)
class Variant:
    """A generated fault, the cases it runs on and the class the check must name there (``expect``;
    None: a control, whose cases cannot show the fault, and which must pass)."""

    fault: NativeFault
    cases: tuple[Case, ...]
    expect: BugClass | None

    def __post_init__(self) -> None:
        if not self.cases:
            raise ConfigError(f"variant {self.fault.name!r} needs at least one case")

    @property
    def name(self) -> str:
        return self.fault.name if self.expect is not None else f"{self.fault.name} (control)"


def misturn(
    name: str, kind: BugClass, description: str, target: str, scope: Scope, turn: Turn, key_form: str = "rotated"
) -> NativeFault:
    """A :class:`NativeFault` whose rotation policy is a :class:`Misturn`."""
    return NativeFault(
        name=name,
        kind=kind,
        description=description,
        key_form=key_form,  # type: ignore[arg-type]
        fixed_key_form=True,
        rotation=lambda: Misturn(target, scope, turn),
    )


# ---------------------------------------------------------------------- the generated families

# Cases sized for a tiny model (max positions >= 256) and SmolLM2 alike: D decodes past a partial
# block of 7; C prefills in chunks of 9 (so scopes "from position 9" are the chunks after the first);
# W wraps a ring of 13 with 2 sinks; L reaches position 250 (16-bit angles round there); SP verifies a
# 3-token draft.
D = Case(length=17, block_size=7, decode_steps=2)
C = Case(length=30, block_size=7, chunk=9)
W = Case(length=40, block_size=5, window=13, sink_tokens=2, chunk=9)
L = Case(length=250, chunk=64, decode_steps=2)
SP = Case(length=17, block_size=7, op=CacheOp(OpKind.SPEC, 3))

# Where a key fault acts, and the case that shows it there.
KEY_SCOPES: tuple[tuple[str, Scope, Case], ...] = (
    ("every cached phase", Scope(("prefill", "decode")), C),
    ("decode only", Scope(("decode",)), D),
    ("prefill chunks after the first", Scope(("prefill",), from_position=9), C),
    ("KV head 1 only", Scope(("prefill", "decode"), heads=(1,)), D),
    ("layer 1 only", Scope(("prefill", "decode"), layers=(1,)), C),
)
QUERY_SCOPES: tuple[tuple[str, Scope, Case], ...] = (
    ("decode", Scope(("decode",)), D),
    ("decode, layer 1 only", Scope(("decode",), layers=(1,)), D),
    ("decode, query head 2 only", Scope(("decode",), heads=(2,)), D),
)


def _ring(p: torch.Tensor) -> torch.Tensor:
    return torch.where(p < 2, p, 2 + (p - 2) % 13)  # W's ring slot: 2 sinks, 13 in view


def _other_layout(r: RopeSpec) -> RopeSpec:
    return r.replace(layout="gptj" if r.layout == "neox" else "neox")


def _family(
    kind: BugClass, target: str, turns: tuple[tuple[str, Turn], ...], scopes: tuple[tuple[str, Scope, Case], ...]
) -> list[Variant]:
    out = []
    for turn_name, turn in turns:
        for scope_name, scope, case in scopes:
            name = f"{kind.value}: {target} {turn_name}, {scope_name}"
            out.append(Variant(misturn(name, kind, name, target, scope, turn), (case,), kind))
    return out


def generated() -> tuple[Variant, ...]:
    """Every generated variant: each class's bug in other amounts and functions of position, on subsets
    of phases, heads and layers, then the controls (the fault's trigger absent from the case: it must pass)."""
    b = BugClass
    out: list[Variant] = []
    out += _family(b.DOUBLE_ROTATION, "key", (("turned twice", times(2)), ("turned 3 times", times(3))), KEY_SCOPES)
    out += _family(b.MISSING_ROTATION, "key", (("never turned", times(0)),), KEY_SCOPES)
    out += _family(b.KEY_POSITION_OFFSET, "key", tuple((f"at j{c:+d}", shifted(c)) for c in (-3, -1, 1, 2)), KEY_SCOPES)
    out += _family(
        b.QUERY_POSITION_OFFSET, "query", tuple((f"at t{c:+d}", shifted(c)) for c in (-3, -1, 2, 5)), QUERY_SCOPES
    )
    theta = (
        ("under theta x 50", respec(lambda r: r.replace(theta=r.theta * 50))),
        ("under theta / 2", respec(lambda r: r.replace(theta=r.theta / 2))),
        ("under linear scaling x 2", respec(lambda r: r.replace(scaling=RopeScaling("linear", factor=2.0)))),
    )
    out += _family(b.FREQUENCY_MISMATCH, "both", theta, (("decode", Scope(("decode",)), D),))
    out += _family(b.FREQUENCY_MISMATCH, "key", theta, (("prefill", Scope(("prefill",)), C),))
    out += _family(b.LAYOUT_MISMATCH, "key", (("under the other pairing", respec(_other_layout)),), KEY_SCOPES)
    out += _family(
        b.LOW_PRECISION_ANGLES,
        "both",
        (
            ("with bfloat16 angles", narrow_angles(torch.bfloat16)),
            ("with float16 angles", narrow_angles(torch.float16)),
        ),
        (("decode", Scope(("decode",)), L), ("prefill", Scope(("prefill",)), L)),
    )
    out += _family(
        b.BLOCK_LOCAL_POSITION,
        "key",
        (("at its block's start", mapped(lambda p: p - p % 7)), ("at j mod 7", mapped(lambda p: p % 7))),
        (
            ("every cached phase", Scope(("prefill", "decode")), D),
            ("the last partial block", Scope(("prefill",), from_position=14), D),
        ),
    )
    out += _family(
        b.SLOT_AS_POSITION,
        "key",
        (("at its ring slot", mapped(_ring)),),
        (("every cached phase", Scope(("prefill", "decode")), W),),
    )
    out += _family(
        b.SLOT_AS_POSITION, "query", (("at its ring slot", mapped(_ring)),), (("decode", Scope(("decode",)), W),)
    )
    verify = tuple((f"at j{c:+d}", shifted(c)) for c in (-2, 1, 2, 3))
    out += _family(b.SPEC_VERIFY_POSITION_OFFSET, "both", verify, (("verify", Scope(("verify",)), SP),))
    out += _family(b.SPEC_VERIFY_POSITION_OFFSET, "key", verify[:2], (("verify", Scope(("verify",)), SP),))
    out += _family(
        b.PREFILL_ROWS_DIVERGED,
        "query",
        (("at its place in its chunk", mapped(lambda p: p % 9)),),
        (("prefill chunks after the first, layer 0", Scope(("prefill",), layers=(0,), from_position=9), C),),
    )
    controls = (
        ("verify never runs", "both", Scope(("verify",)), shifted(2), D),
        (
            "no prefill chunk after the first",
            "key",
            Scope(("prefill",), from_position=9),
            times(2),
            Case(length=8, decode_steps=3),
        ),
        ("the ring never wraps", "key", Scope(("prefill", "decode")), mapped(_ring), Case(length=10, decode_steps=2)),
        (
            "every key in the first block",
            "key",
            Scope(("prefill", "decode")),
            mapped(lambda p: p % 16),
            Case(length=10, decode_steps=3),
        ),
    )
    for why, target, scope, turn, case in controls:
        name = f"control: {why}"
        out.append(Variant(misturn(name, BugClass.DOUBLE_ROTATION, name, target, scope, turn), (case,), None))
    return tuple(out)
