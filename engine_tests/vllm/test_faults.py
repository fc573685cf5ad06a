"""Bugs patched into the running vLLM's decode path: each is caught at the logits, attention and
forensics tiers (one vLLM run per fault, judged at each tier by replaying it) and named."""

from __future__ import annotations

import pytest
from conftest import BLOCK
from replay import Replay

from ropekv import check
from ropekv.bugs.registry import VLLM_FAULTS as FAULTS
from ropekv.faults.vllm import injected
from ropekv.parity.cases import Case
from ropekv.parity.protocol import Tier

CASE = Case(length=40, prefix=BLOCK, block_size=BLOCK, decode_steps=2)  # a prefix hit, decode past block 2


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_fault_is_caught_at_every_tier_and_named(engine_f32, name):
    forensic = Replay(engine_f32, Tier.FORENSICS)
    with injected(engine_f32, name) as fault:
        reports = {Tier.FORENSICS: check(forensic, cases=[CASE])}
    for tier in (Tier.LOGITS, Tier.ATTENTION):
        reports[tier] = check(forensic.with_tier(tier), cases=[CASE])
    for tier, report in reports.items():
        result = report.cases[0]
        assert not report.passed and not result.reference_passed, (tier, report.table())
        assert result.first_divergence.step == 0  # from the first decode step on
    assert reports[Tier.LOGITS].cases[0].max_abs_logit_diff > 0.1
    assert reports[Tier.ATTENTION].cases[0].first_divergence.layer == 0
    assert reports[Tier.LOGITS].diagnosis is None and reports[Tier.ATTENTION].diagnosis is None
    diagnosis = reports[Tier.FORENSICS].diagnosis
    assert diagnosis is not None and diagnosis.kind == fault.kind, diagnosis


def test_a_fault_is_gone_once_its_block_ends(engine_f32):
    layers = engine_f32.model.model.layers
    patched = lambda: [
        obj
        for layer in layers
        for obj in (layer.self_attn.rotary_emb, layer.self_attn.attn.impl)
        if "forward" in vars(obj)
    ]
    for name in FAULTS:
        with injected(engine_f32, name):
            assert patched()
        assert not patched(), name
