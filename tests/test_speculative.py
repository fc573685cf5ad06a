"""Speculative decoding (``spec:K``) through the parity harness: one step drafts K tokens with a
drafter of its own cache, verifies them in one forward, accepts M = K // 2, rolls the rest back in
both caches and decodes on. The correct engine passes in both key forms, on a plain cache and on a
wrapped window; each catalogued speculative fault is caught at the logits and attention tiers and
named at the forensics tier.

References: ropekv's float64 ReferenceDecoder over the plain token stream (the accepted draft tokens
are the stream's own), never the engine under test.
"""

from __future__ import annotations

import pytest

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.registry import OP_FAULTS
from ropekv.errors import UsageError
from ropekv.models import load_checkpoint
from ropekv.parity.cases import MAX_SPEC_DRAFT, CacheOp, Case, parse_ops
from ropekv.parity.protocol import Tier
from ropekv.testing.tiers import at_tier

SPEC_FAULTS = sorted(n for n, f in OP_FAULTS.items() if f.op.kind == "spec")
PLAIN = Case(length=30, block_size=7, op=CacheOp("spec", 3))
WRAPPED = Case(length=40, block_size=5, window=13, sink_tokens=2, op=CacheOp("spec", 3))


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_spec_passes_on_a_plain_cache_and_a_wrapped_window(llama, key_form):
    cases = [PLAIN, WRAPPED, Case(length=17, prefix=5, block_size=7, op=CacheOp("spec", 4))]
    report = check(NativeAdapter(llama, key_form=key_form), cases=cases)
    assert report.passed, report.table()
    tol = report.tolerances["reference"]["attn_logits"]
    assert max(c.max_attn_error for c in report.cases) < tol / 5, report.table()
    # spec:3 on a 30-token prompt: drafter row 30, verify row 30, drafter row 31, decode 31..33
    assert report.cases[0].positions == (30, 30, 31, 31, 32, 33), report.cases[0].positions
    # spec:4 after a 5-token prefix hit: M = 2 accepted at 22, 23
    assert report.cases[2].positions == (22, 23, 22, 23, 24, 24, 25, 26), report.cases[2].positions
    assert any("verified in one forward" in n for n in report.cases[0].notes)


def test_spec_cases_count_accepted_tokens_and_draft_positions():
    """Hand-derived: K = 5 after 10 tokens accepts 2; the draft reaches position 14; 3 decode steps
    make 10 + 2 + 3 tokens."""
    c = Case(length=10, op=CacheOp("spec", 5))
    assert c.spec_accepted == 2 and c.total == 15 and c.positions_needed == 15
    assert c.decode_positions == [10, 11, 10, 11, 12, 12, 13, 14]
    long_draft = Case(length=4, decode_steps=1, op=CacheOp("spec", 9))
    assert long_draft.total == 9 and long_draft.positions_needed == 13


@pytest.mark.parametrize("name", SPEC_FAULTS)
def test_each_spec_fault_is_caught_at_every_tier_and_named(llama, name):
    fault = OP_FAULTS[name]
    cases = [WRAPPED] if fault.needs_window else [PLAIN, WRAPPED]
    adapter = fault.adapter(llama)
    for tier in (Tier.LOGITS, Tier.ATTENTION):
        seen = check(at_tier(adapter, tier), cases=cases)
        assert not seen.passed, f"{name} went unnoticed at the {tier.value} tier:\n{seen.table()}"
    report = check(adapter, cases=cases)
    assert not report.passed and report.diagnosis is not None, report.table()
    assert report.diagnosis.kind == fault.kind, report.diagnosis.evidence
    assert "verify" in report.diagnosis.evidence, report.diagnosis.evidence
    print(name, "->", report.diagnosis.kind, ":", report.diagnosis.evidence)


def test_spec_faults_do_not_show_without_their_operation(llama):
    plain = [Case(length=17, block_size=7), Case(length=40, block_size=5, window=13, sink_tokens=2)]
    for name in SPEC_FAULTS:
        report = check(OP_FAULTS[name].adapter(llama), cases=plain)
        assert report.passed, f"{name} on plain cases:\n{report.table()}"


def test_parse_ops_accepts_spec_and_bounds_the_draft():
    assert parse_ops("spec:3") == [CacheOp("spec", 3)]
    assert parse_ops(f"rollback:2,spec:{MAX_SPEC_DRAFT}")[1] == CacheOp("spec", MAX_SPEC_DRAFT)
    for text in ("spec:0", "spec:-1", "spec:1", f"spec:{MAX_SPEC_DRAFT + 1}", "spec:100000000000", "spec"):
        with pytest.raises(UsageError):
            parse_ops(text)


def test_hf_engine_refuses_spec_as_not_applicable(tiny_llama_dir):
    """transformers' adapter declares rollback only: a spec case is n/a in its row, not run as plain."""
    from ropekv.adapters.hf import HFEngine

    report = check(HFEngine.load(tiny_llama_dir), cases=[Case(length=17), PLAIN])
    assert [r.outcome for r in report.cases] == ["pass", "n/a"], report.table()
    assert "not spec:3" in (report.cases[1].not_applicable or "")


def test_ops_spec_alone_runs_its_default_case_and_other_flags_carry_it():
    """``--ops spec:3`` without other flags: a wrapped odd-size window (48 tokens, W=37); with
    ``--lengths``: spec on each of those cases."""
    from ropekv.parity.cases import build_matrix

    (alone,) = build_matrix(ops=[CacheOp("spec", 3)], max_positions=2048)
    assert alone.op == CacheOp("spec", 3) and alone.window == 37 and alone.window_wrapped
    given = build_matrix(ops=[CacheOp("spec", 4)], lengths=[17, 40], max_positions=2048)
    assert [(c.length, c.op) for c in given] == [(17, CacheOp("spec", 4)), (40, CacheOp("spec", 4))]


def test_rollback_faults_on_a_spec_step_are_named_at_the_drafters_rollback(llama):
    """The drafter's own cache is checked: the rollback faults (offset kept, ring slots not restored)
    hit the drafter's rollback first (spec:5 after 40 tokens, W=13+2 sinks: the drafter gives back
    its steps at 42, 43, which overwrote the slots of 29, 30; its row at 42 sees 30's)."""
    wrapped5 = Case(length=40, block_size=5, window=13, sink_tokens=2, op=CacheOp("spec", 5))
    for name, kind, text in (
        ("rollback-offset", "rollback_offset", "logical 42, effective 44: the drafter's offset kept"),
        ("rollback-stale-ring", "rollback_stale_keys", "positions 30 are no rotation"),
    ):
        report = check(OP_FAULTS[name].adapter(llama), cases=[wrapped5])
        assert not report.passed and report.diagnosis is not None, report.table()
        assert report.diagnosis.kind == kind and text in report.diagnosis.evidence, report.diagnosis.evidence
        assert "drafter's" in report.diagnosis.evidence and "verify pass" in report.diagnosis.evidence
