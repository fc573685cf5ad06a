"""ropekv.check on CTranslate2 at the logits tier: SmolLM2 against the float64 reference and
CTranslate2's own uncached forward; what it cannot honour is reported, never dropped."""

from __future__ import annotations

import argparse

import pytest

from ropekv import check
from ropekv.adapters.ct2 import CT2Engine, add_arguments, from_args
from ropekv.errors import UsageError
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import Case, token_stream


def test_smollm2_passes_at_the_logits_tier(engine):
    cases = [Case(length=1), Case(length=17), Case(length=30, prefix=13), Case(length=61, prefix=13, chunk=17)]
    report = check(engine, cases=cases)
    assert report.passed, report.table()
    assert report.tier == "logits"
    # Measured 2e-5 .. 5e-5 max |dlogit| (docs/engines/ct2.md); the float32 tolerance is 2e-3 scaled.
    assert max(r.max_abs_logit_diff for r in report.cases) < 1e-3
    chunked = report.cases[3]
    assert "chunk (CTranslate2 forwards a prompt at once)" in chunked.ignored, report.table()
    assert any("static-prompt cache" in n for n in report.cases[2].notes), report.table()


def test_a_case_window_is_not_applicable(engine):
    report = check(engine, cases=[Case(length=20), Case(length=48, window=37)])
    assert report.cases[0].not_applicable is None and "window" in (report.cases[1].not_applicable or "")


def test_the_decode_step_reads_the_cache_it_filled(engine):
    """A decode step's logits are the reference's at the step's position, not at the position before or
    after (one decode step on top of a prefill, what generate_batch runs)."""
    tokens = token_stream(engine.config.vocab_size, 24)
    run = engine.run_case(Case(length=20, decode_steps=2), tokens)
    ref = ReferenceDecoder(engine.checkpoint).forward(tokens[:22]).logits.double()
    scale = float(ref.abs().max())
    for step in run.steps:
        errs = [float((step.logits.double() - ref[p]).abs().max()) / scale for p in range(18, 22)]
        assert min(range(len(errs)), key=errs.__getitem__) + 18 == step.position and min(errs) < 1e-4


def test_options_are_bounded():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UsageError, match="float32"):
        from_args(argparse.Namespace(model=None, dtype="bfloat16", ct2_threads=2))
    with pytest.raises(UsageError, match="ct2-threads"):
        CT2Engine(None, threads=0)
    with pytest.raises(UsageError, match="not one"):
        CT2Engine("/nonexistent/folder")
