"""The harness names catalogued faults (and a hand-written ring bug) on the tiny checkpoints, with
evidence that agrees with its own figures: head_dim 16, positions past bf16's integers, wrapped rings."""

from __future__ import annotations

import torch

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.registry import FAULTS
from ropekv.engine.rotation import RotationPolicy
from ropekv.models import load_checkpoint
from ropekv.parity.cases import Case


class FillCountRotation(RotationPolicy):
    """mlx-lm's ``offset-counts-kept-rows`` on ropekv's engine: a cached step starting at ``s`` turns
    its query and keys from ``min(s, capacity)``, the rows a ring of ``capacity`` keeps, instead of ``s``
    (``decode_only``: as mlx's patch, only one-token steps; else chunked prefill too)."""

    name = "fill-count-rotation"

    def __init__(self, capacity: int, *, decode_only: bool):
        self.capacity, self.decode_only = capacity, decode_only

    def _at(self, positions: torch.Tensor, ctx) -> torch.Tensor:
        if not ctx.cached or (self.decode_only and ctx.phase != "decode"):
            return positions
        start = int(positions[0])
        return positions - start + min(start, self.capacity)

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, self._at(positions, ctx), ctx)

    def write_key(self, rope, k, positions, slots, ctx):
        return super().write_key(rope, k, self._at(positions, ctx), slots, ctx)


def test_low_precision_angles_past_bf16_integers_on_head_dim_16(make_tiny_checkpoint):
    # 513 turns as 512 in bf16: before, "unknown: no single pattern ... key offsets [-1, 0, 1]".
    ckpt = load_checkpoint(make_tiny_checkpoint("llama", max_position_embeddings=2048))
    assert ckpt.config.rope.head_dim == 16
    report = check(FAULTS["low-precision-angles"].adapter(ckpt), cases=[Case(length=513, chunk=64, decode_steps=1)])
    d = report.diagnosis
    assert not report.passed and d.kind == "low_precision_angles", d
    # the query and keys sit at their positions under angles computed in bfloat16 (the rotation the fit
    # names), which turn position 513 as 512
    assert "513 -> 512" in d.evidence and "angles computed in bfloat16" in d.evidence
    assert d.details["query_effective"] == 513 and d.details["angle_dtype"] == "bfloat16"


def test_low_precision_angles_default_cases_name_no_block_bug(tiny_llama_dir):
    # L=16 B=16: the keys below the first block boundary cannot show j mod B; before, block_local_position.
    ckpt = load_checkpoint(tiny_llama_dir)
    report = check(FAULTS["low-precision-angles"].adapter(ckpt), cases=[Case(length=16, block_size=16)])
    assert report.diagnosis is not None and report.diagnosis.kind != "block_local_position", report.diagnosis


def test_fill_count_rotation_after_a_wrapped_window_names_the_new_key(tiny_llama_dir):
    ckpt = load_checkpoint(tiny_llama_dir)
    engine = NativeAdapter(ckpt, rotation=FillCountRotation(37, decode_only=True))
    report = check(engine, cases=[Case(length=48, block_size=7, window=37, decode_steps=2)])
    d = report.diagnosis
    assert not report.passed and d.kind == "query_position_offset", d
    assert d.details["query_effective"] == 37 and d.details["query_position"] == 48
    # before: "keys are right but the query sits at t -11" next to "logical 48, ..., effective 37"
    assert not d.evidence.startswith("keys are right")
    assert "and so does the key its step wrote; the 36 older keys are right" in d.evidence
    assert "logical 48, slot 11, effective 37" in d.evidence


def test_fill_count_rotation_through_a_chunked_prefill_that_wrapped(tiny_llama_dir):
    # before: "unknown: no single pattern: query offset -25, key offsets [-25, -21, -12, 0]"
    ckpt = load_checkpoint(tiny_llama_dir)
    engine = NativeAdapter(ckpt, rotation=FillCountRotation(15, decode_only=False))
    report = check(engine, cases=[Case(length=40, block_size=5, window=13, sink_tokens=2, chunk=9, decode_steps=2)])
    d = report.diagnosis
    assert not report.passed and d.kind == "query_position_offset", d
    assert "the query sits at t -25 (effective 15) and the 13 newest keys are off too" in d.evidence
    assert "the 2 older keys are right" in d.evidence and "query logical 40, effective 15" in d.evidence
