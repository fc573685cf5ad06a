"""ropekv.check on llama.cpp: the default-matrix lengths on the float32 GGUF (f32 and f16 KV, a batch
size that splits the prompt), against llama.cpp's own full forward and the float64 reference."""

from __future__ import annotations

import argparse

import pytest

from ropekv import check
from ropekv.adapters.llamacpp import LlamaCppEngine, add_arguments, default_cases, llamacpp_cases
from ropekv.parity.cases import Case


def test_default_cases_are_the_default_matrix_without_windows():
    cases = llamacpp_cases(8192)
    assert [c.length for c in cases] == [1, 15, 16, 17, 20, 30, 61, 1100]
    assert all(c.window is None for c in cases)


def test_the_cli_lists_what_llamacpp_cannot_honour_as_not_applicable():
    """Without case flags the CLI lists the whole default matrix: windows, sinks, cache operations and
    cases longer than the context come back as n/a rows with the reason, none dropped silently."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    listed = default_cases(parser.parse_args(["--n-ctx", "64"]))
    assert len(listed) == 15 and any(c.window for c in listed) and any(c.op for c in listed)
    small = LlamaCppEngine(n_ctx=64)
    report = check(small, cases=[Case(length=30), Case(length=70), Case(length=48, window=37)])
    outcome = {r.case.length: r.not_applicable for r in report.cases}
    assert outcome[30] is None and report.passed, report.table()
    assert "the case needs 73 cells; n_ctx is 64" in (outcome[70] or ""), report.table()
    assert "window" in (outcome[48] or ""), report.table()


def test_f32_gguf_f32_kv_passes_every_default_case(f32_engine):
    report = check(f32_engine, cases=llamacpp_cases(f32_engine.n_ctx))
    assert report.passed, report.table()
    assert report.tier == "forensics"
    # Measured 1e-6 .. 4e-5 (docs/engines/llamacpp.md): far inside the float32 tolerance, so a RoPE
    # error of one position (scores move by ~1) could not hide.
    assert max(r.max_attn_error for r in report.cases) < 2e-4
    assert max(r.max_abs_logit_diff for r in report.cases) < 1e-3


def test_f16_kv_passes_with_the_f16_tolerance():
    engine = LlamaCppEngine(type_k="f16", type_v="f16")
    cases = [Case(length=17), Case(length=61, prefix=13, chunk=17)]
    report = check(engine, cases=cases)
    assert report.passed, report.table()
    worst = max(r.max_attn_error for r in report.cases)
    assert 1e-5 < worst < engine.tolerance.attn  # the f16 cache's rounding is visible, and bounded


@pytest.mark.parametrize("n_batch", [7])
def test_a_batch_size_that_splits_the_prompt(n_batch):
    engine = LlamaCppEngine(n_batch=n_batch)
    assert engine.describe().extra["n_ubatch"] == n_batch
    report = check(engine, cases=[Case(length=45, prefix=13), Case(length=20, chunk=9)])
    assert report.passed, report.table()
    assert max(r.max_attn_error for r in report.cases) < 2e-4
