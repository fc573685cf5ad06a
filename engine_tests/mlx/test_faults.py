"""Bugs patched into mlx-lm's decode path in this process: ropekv's harness catches and names each,
and only where its bug class can show."""

from __future__ import annotations

from ropekv import check
from ropekv.faults.mlx import decode_keys_rotated_again, offset_counts_kept_rows
from ropekv.parity.cases import Case


def test_decode_keys_rotated_again_is_caught_and_named(engine):
    with decode_keys_rotated_again(engine.model):
        report = check(engine, cases=[Case(length=17, decode_steps=2)])
    assert not report.passed
    d = report.diagnosis
    assert d.kind == "double_rotation", d  # turned twice: at 2j
    assert d.details["layer"] == 0
    assert "effective 34" in d.evidence  # the decoded key at 17 sits at 2 * 17
    assert type(engine.model.layers[0].self_attn).__call__.__name__ == "__call__"  # restored


def test_offset_counting_kept_rows_is_caught_once_the_ring_wrapped(engine):
    with offset_counts_kept_rows(engine.model):
        unwrapped = check(engine, cases=[Case(length=20, decode_steps=2)])  # KVCache: size() == offset
        wrapped = check(engine, cases=[Case(length=48, window=37, decode_steps=2)])
    assert unwrapped.passed
    assert not wrapped.passed
    d = wrapped.diagnosis
    assert d.kind == "query_position_offset", d
    assert d.details["query_effective"] == 37 and d.details["query_position"] == 48  # the kept-row count
