"""Forensics on bugs the catalogue does not hold: generated variants of the classes (other amounts,
functions of position, subsets of phases, heads and layers) must be named by their class, and the
controls, whose cases cannot show their fault, must pass. The full record is
``scripts/forensics_confusion.py`` (docs/forensics.md); here every fourth variant of each class and every control."""

from __future__ import annotations

import pytest
import torch

from ropekv import check
from ropekv.engine.rotation import StepContext
from ropekv.faults.variants import Misturn, Scope, generated, shifted, times
from ropekv.rope import RopeSpec
from ropekv.testing.tiny import tiny_checkpoint

VARIANTS = generated()
SAMPLE = [
    v
    for kind in dict.fromkeys(v.expect for v in VARIANTS if v.expect)
    for v in [x for x in VARIANTS if x.expect == kind][::4]
]
CONTROLS = [v for v in VARIANTS if v.expect is None]
ROPE = RopeSpec(head_dim=8, rotary_dim=8, theta=10000.0)


@pytest.fixture(scope="module")
def llama():
    return tiny_checkpoint("llama")


def test_the_sample_covers_every_generated_class():
    assert {v.expect for v in SAMPLE} == {v.expect for v in VARIANTS if v.expect is not None}
    assert len(CONTROLS) >= 4


@pytest.mark.parametrize("variant", SAMPLE, ids=lambda v: v.name)
def test_a_generated_variant_is_named_by_its_class(llama, variant):
    report = check(variant.fault.adapter(llama), cases=list(variant.cases))
    assert not report.passed
    assert report.diagnosis is not None and report.diagnosis.kind == variant.expect, report.diagnosis


@pytest.mark.parametrize("variant", CONTROLS, ids=lambda v: v.name)
def test_a_control_whose_case_cannot_show_the_fault_passes(llama, variant):
    assert check(variant.fault.adapter(llama), cases=list(variant.cases)).passed


def test_a_misturn_turns_only_its_scope():
    torch.manual_seed(0)
    k = torch.randn(5, 3, 8)  # [n, KV heads, D]
    pos = torch.arange(7, 12)
    policy = Misturn("key", Scope(("prefill",), heads=(1,), from_position=9), shifted(2))
    got = policy.write_key(ROPE, k, pos, pos, StepContext(phase="prefill", seq_len=12))
    right = ROPE.rotate(k, pos)
    off = ROPE.rotate(k, pos + 2)
    # head 1 of the rows at positions >= 9 at j + 2; every other cell at its position
    assert torch.allclose(got[2:, 1], off[2:, 1], atol=1e-6)
    assert torch.allclose(got[:2], right[:2], atol=1e-6) and torch.allclose(got[:, [0, 2]], right[:, [0, 2]], atol=1e-6)
    # outside its phases and for the query, nothing changes
    decode = policy.write_key(ROPE, k, pos, pos, StepContext(phase="decode", seq_len=12))
    assert torch.allclose(decode, right, atol=1e-6)
    q = torch.randn(5, 4, 8)
    assert torch.allclose(
        policy.query(ROPE, q, pos, StepContext(phase="prefill", seq_len=12)), ROPE.rotate(q, pos), atol=1e-6
    )


def test_a_turn_done_twice_and_not_at_all():
    torch.manual_seed(1)
    k = torch.randn(3, 2, 8)
    pos = torch.tensor([3, 4, 5])
    ctx = StepContext(phase="decode", seq_len=6)
    assert torch.allclose(times(2)(ROPE, k, pos, ctx), ROPE.rotate(k, 2 * pos), atol=1e-5)
    assert torch.equal(times(0)(ROPE, k, pos, ctx), k)
