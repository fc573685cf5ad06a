"""Catalogued faults of speculative decoding (``spec:K`` cases, docs/ops.md), each a policy handed to
ropekv's engine.

- ``spec-draft-positions-off-by-one``: the verify pass rotates its ``K`` draft tokens (queries and
  the keys it writes) at ``t+1..t+K`` instead of ``t..t+K-1``; prefill, decode and the drafter's own
  steps are right. The accepted keys stay in the cache turned one position late.
- ``spec-rejected-kv-kept``: the rollback after the verify is a no-op on a wrapped ring's contents:
  the stored positions move back (the offset is the accepted length) but the rejected draft's keys
  and values stay in the ring slots they overwrote, labelled as the older tokens those slots held.
  On a full cache a rollback that keeps the keys would also keep the offset (every later token
  rotated ``K - M`` positions late: ``rollback-offset``'s class); the ring version is the one where
  positions are right and only the keys are stale, so it is the one catalogued.
"""

from __future__ import annotations

from ..cache.policy import CacheOpPolicy
from ..engine.rotation import RotationPolicy
from ..parity.cases import CacheOp
from .ops import OpFault


class SpecVerifyOffByOne(RotationPolicy):
    """The verify forward's positions start one past the last cached token's successor."""

    name = "spec-draft-positions-off-by-one"

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, positions + 1 if ctx.phase == "verify" else positions, ctx)

    def write_key(self, rope, k, positions, slots, ctx):
        return super().write_key(rope, k, positions + 1 if ctx.phase == "verify" else positions, slots, ctx)


class SpecRejectedKeptRing(CacheOpPolicy):
    """A wrapped ring's rollback after the verify gives back positions but not contents: the rejected
    draft tokens' keys and values stay in the slots they overwrote."""

    name = "spec-rejected-kv-kept"

    def ring_restore(self, journal, current, *, age):
        return current


CATALOGUE: tuple[OpFault, ...] = (
    OpFault(
        name="spec-draft-positions-off-by-one",
        kind="spec_verify_position_offset",
        description="the verify pass rotates its K draft tokens at t+1..t+K",
        key_form="rotated",
        shows_when="a speculative step (spec:K)",
        op=CacheOp("spec", 3),
        rotation=SpecVerifyOffByOne,
    ),
    OpFault(
        name="spec-rejected-kv-kept",
        kind="rollback_stale_keys",
        description="rollback after the verify leaves the rejected draft's keys in the ring",
        key_form="rotated",
        shows_when="a speculative step whose verify overwrote ring slots (a wrapped window)",
        op=CacheOp("spec", 3),
        cache_ops=SpecRejectedKeptRing,
        needs_window=True,
    ),
)
