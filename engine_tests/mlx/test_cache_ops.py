"""mlx-lm's own cache operations, each against the uninterrupted run's float64 reference:
save_prompt_cache / load_prompt_cache, and trim_prompt_cache after rejected draft tokens."""

from __future__ import annotations

import pytest
from conftest import against_reference

from ropekv.parity.cases import Case


@pytest.mark.parametrize(
    "case", [Case(length=30, prefix=13), Case(length=20, window=37, chunk=7)], ids=lambda c: c.label()
)
def test_save_and_load_prompt_cache(engine, reference, tokens, tol, case):
    run = engine.with_options(restore=True).run_case(case, tokens)
    assert any("load_prompt_cache" in n for n in run.notes)
    err = against_reference(reference, run, case, tokens)
    assert err.logits < tol.logits and max(err.attn) < tol.attn, err


def test_trim_after_rejected_drafts(engine, reference, tokens, tol):
    case = Case(length=25, prefix=13)
    run = engine.with_options(rollback=4).run_case(case, tokens)
    assert "removed 4 of 4" in " ".join(run.notes)
    err = against_reference(reference, run, case, tokens)
    assert err.logits < tol.logits and max(err.attn) < tol.attn, err


def test_trim_refused_by_a_wrapped_ring_leaves_the_drafts_and_is_caught(engine, reference, tokens, tol):
    """RotatingKVCache.is_trimmable() is False once offset >= max_size: trim_prompt_cache returns 0 and
    the rejected drafts stay in the cache. ropekv reports it (note) and the decode diverges."""
    case = Case(length=40, window=13)
    run = engine.with_options(rollback=3).run_case(case, tokens)
    assert "removed 0 of 3" in " ".join(run.notes)
    err = against_reference(reference, run, case, tokens)
    assert err.logits > 10 * tol.logits, err
