"""mlx-lm's own cache operations, each against the uninterrupted run's float64 reference:
save_prompt_cache / load_prompt_cache, and trim_prompt_cache after rejected draft tokens."""

from __future__ import annotations

import pytest

from ropekv.adapters.mlx import MLXEngine
from ropekv.parity.cases import Case

from conftest import against_reference


@pytest.fixture(scope="module")
def ops_engine(engine):
    # the same loaded model under other options (no second load)
    e = MLXEngine.__new__(MLXEngine)
    e.__dict__.update(engine.__dict__)
    return e


@pytest.mark.parametrize("case", [Case(length=30, prefix=13), Case(length=20, window=37, chunk=7)],
                         ids=lambda c: c.label())
def test_save_and_load_prompt_cache(ops_engine, reference, tokens, tol, case):
    ops_engine.restore, ops_engine.rollback = True, 0
    run = ops_engine.run_case(case, tokens)
    assert any("load_prompt_cache" in n for n in run.notes)
    err = against_reference(reference, run, case, tokens)
    assert err.logits < tol.logits and max(err.attn) < tol.attn, err


def test_trim_after_rejected_drafts(ops_engine, reference, tokens, tol):
    ops_engine.restore, ops_engine.rollback = False, 4
    case = Case(length=25, prefix=13)
    run = ops_engine.run_case(case, tokens)
    assert "removed 4 of 4" in " ".join(run.notes)
    err = against_reference(reference, run, case, tokens)
    assert err.logits < tol.logits and max(err.attn) < tol.attn, err


def test_trim_refused_by_a_wrapped_ring_leaves_the_drafts_and_is_caught(ops_engine, reference, tokens, tol):
    """RotatingKVCache.is_trimmable() is False once offset >= max_size: trim_prompt_cache returns 0 and
    the rejected drafts stay in the cache. ropekv reports it (note) and the decode diverges."""
    ops_engine.restore, ops_engine.rollback = False, 3
    case = Case(length=40, window=13)
    run = ops_engine.run_case(case, tokens)
    assert "removed 0 of 3" in " ".join(run.notes)
    err = against_reference(reference, run, case, tokens)
    assert err.logits > 10 * tol.logits, err
    ops_engine.rollback = 0
