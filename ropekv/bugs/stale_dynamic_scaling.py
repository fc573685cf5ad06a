"""stale_dynamic_scaling: length-dependent RoPE, cached keys kept under an earlier length's frequencies.

Dynamic NTK grows its base with the sequence; a rotated cache keeps each key under the frequencies
of the length at which it was written while the query turns under the current ones, so past the
original length keys and query disagree. With raw keys rotated on read, layer 0 is exact and the
deeper layers still differ: their cached keys come from hidden states computed under earlier
frequencies, which no cache can avoid (inherent; docs/contract.md). The evidence names the lengths
the keys' frequencies belong to, or says the deeper-layer effect is inherent.
"""

from __future__ import annotations

import torch

from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..models.config import Checkpoint
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.cells import Cells, rows_of, scope_of, share, which_keys
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import rotation_match
from ..rope import RopeScaling

KIND = BugClass.STALE_DYNAMIC_SCALING


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.rope is None or not km.rope.length_dependent or km.rope.scaling.rope_type == "longrope":
        return None
    switch = km.rope.switch_length

    def text(which: str, names: list[str], query: bool) -> str:
        lengths = sorted(int(n.rsplit(" ", 1)[-1]) for n in names if n.rsplit(" ", 1)[-1].isdigit())
        span = f"{lengths[0]}" if len(lengths) == 1 else f"{lengths[0]}..{lengths[-1]}"
        return (
            f"{which} keep the frequencies of length {span} while the query uses those of length {km.seq_len}; "
            f"they differ once the sequence passes {switch} tokens"
        )

    found = rotation_match(ev, KIND, ("length",), text, query_seq_len=km.seq_len, first_position=switch)
    if found is not None:
        lengths = [int(v) for k, v in found.details.items() if k == "seq_len"]
        found.details["key_seq_len"] = lengths[0] if lengths else None
        return found
    if km.layer == 0 or ev.facts.layer is None:
        return None
    # Layer 0 matched: the rotations are right here; the cached rows' contents differ (deeper keys and
    # values computed from hidden states of an earlier length's frequencies).
    k = km.keys
    drift = km.wrong_keys() & k.ok & k.own_content & k.at_expected & (k.rotation == 0)
    if not bool(drift.any()):
        return None
    cells = Cells(drift, torch.zeros(km.query.heads, dtype=torch.bool))
    sentence = (
        f"layer 0 matches and layer {km.layer} turns keys at the current frequencies, but its cached keys and "
        f"values ({which_keys(km, drift, ev.facts)}, residual up to {float(k.residual[drift].max()):.2g}) come from "
        f"hidden states computed under an earlier length's frequencies (inherent to caching "
        f"{km.rope.scaling.rope_type} RoPE past position {switch})"
    )
    details = {"inherent": True, "first_position": switch, "query_seq_len": km.seq_len}
    return Match(KIND, share(km, cells), sentence, scope_of(km, cells), details, rows_of(drift))


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class StaleDynamicRotation(RotationPolicy):
    """Keeps rotated keys under dynamic NTK instead of refusing the contract (stale frequencies)."""

    name = "stale-dynamic-scaling"

    def check_contract(self, contract) -> None:
        return None


def dynamic_variant(ckpt: Checkpoint, original_max: int = 64, factor: float = 2.0) -> Checkpoint:
    """The same weights with dynamic NTK RoPE whose original length is ``original_max`` (attention factor
    1, as transformers' dynamic NTK has, whatever scaling the model had)."""
    rope = ckpt.config.rope.replace(
        scaling=RopeScaling("dynamic", factor=factor), max_position_embeddings=original_max, attention_factor=1.0
    )
    return ckpt.with_config(ckpt.config.replace(rope=rope))


FAULTS = (
    NativeFault(
        name="stale-dynamic-scaling",
        kind=KIND,
        description="rotated keys under dynamic NTK (original length 64, factor 2 unless the model has its own)",
        key_form="rotated",
        shows_when="decoding past the original length",
        rotation=StaleDynamicRotation,
        # dynamic NTK even on a LongRoPE model: rotated LongRoPE keys across its switch hold two rotations,
        # which is mixed_rotations (ropekv.bugs.mixed_rotations), not this class
        model=lambda c: c if c.config.rope.scaling.rope_type == "dynamic" else dynamic_variant(c),
        fixed_key_form=True,
        # a prompt inside the original length decoded past it: the cached keys keep the frequencies of
        # length 64 while the queries move on (a prefill past it turns every chunk under the prefill's
        # own length, so only the decode steps after it drift, too little for the final logits)
        exposing=(Case(length=60, decode_steps=8, block_size=7),),
    ),
)
