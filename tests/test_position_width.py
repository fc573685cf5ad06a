"""Position index width: positions narrowed to int16 / int32 wrap, and the harness catches and names it.

Expectations come from the float64 reference decoder and from hand arithmetic on two's complement
(``40,020 - 2**16 = -25,516``; ``2**31 + 10 - 2**32 = -2**31 + 10``), never from the code under test.
"""

from __future__ import annotations

import forensic_rows
import pytest
import torch

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.position_wrapped import INT16_CASES, wrap_positions
from ropekv.bugs.registry import FAULTS
from ropekv.errors import UsageError
from ropekv.models import load_checkpoint
from ropekv.parity.cases import CacheOp, Case, parse_ops, token_stream, too_long
from ropekv.parity.compare import NextToken, RefRow
from ropekv.parity.keymap.fit import wrap
from ropekv.parity.protocol import Tier
from ropekv.testing.tiers import at_tier

SHIFT_40000, SHIFT_STRADDLE = INT16_CASES  # shift by 40,000 and by 32,758 (2**15 - 10)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


def test_wrapping_by_hand():
    p = torch.tensor([5, 32767, 32768, 40020, 65535, 65536 + 7])
    want16 = [5, 32767, -32768, 40020 - 2**16, -1, 7]
    assert wrap_positions(p, 16).tolist() == want16 and wrap(p, 16).tolist() == want16
    q = torch.tensor([2**31 - 1, 2**31, 2**31 + 10, 2**32 + 3])
    want32 = [2**31 - 1, -(2**31), -(2**31) + 10, 3]
    assert wrap_positions(q, 32).tolist() == want32 and wrap(q, 32).tolist() == want32


def test_shift_cases_span_their_tokens_and_their_amounts_are_bounded():
    # The scores depend on i - j only: a 20-token prompt shifted by 40,000 spans 22 positions.
    assert too_long(SHIFT_40000, 256) is None
    assert too_long(Case(length=300, decode_steps=2, op=CacheOp("shift", 40000)), 256) == (
        "needs 302 positions; the model has 256"
    )
    # A shift is a position, up to 2**33 (past both 32-bit limits); the other operations count tokens.
    assert parse_ops("shift:2147483648,shift:8589934592") == [CacheOp("shift", 2**31), CacheOp("shift", 2**33)]
    with pytest.raises(UsageError, match="at most 8589934592"):
        CacheOp("shift", 2**33 + 1)
    with pytest.raises(UsageError, match="at most 8589934592"):
        parse_ops("shift:8589934593")
    with pytest.raises(UsageError, match="at most 1048576"):
        CacheOp("rollback", 2**20 + 1)
    with pytest.raises(UsageError, match="at most 1048576"):
        parse_ops("evict:2147483648")
    assert parse_ops("shift:40000") == [CacheOp("shift", 40000)]


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_correct_engine_is_exact_past_2_15(llama, key_form, dtype):
    report = check(NativeAdapter(llama, key_form=key_form, dtype=dtype), cases=list(INT16_CASES))
    assert report.passed, report.table()
    tol = report.tolerances["reference"]["attn_logits"]
    assert max(c.max_attn_error for c in report.cases) < tol / 5


@pytest.mark.parametrize("tier", [Tier.LOGITS, Tier.ATTENTION])
def test_int16_positions_caught_at_every_tier(llama, tier):
    fault = FAULTS["positions-int16"]
    for key_form, case in (("rotated", SHIFT_40000), ("rotated", SHIFT_STRADDLE), ("raw", SHIFT_STRADDLE)):
        report = check(at_tier(fault.adapter(llama, key_form=key_form), tier), cases=[case])
        assert not report.passed, (key_form, case.label(), report.table())


def test_int16_positions_named_with_the_wrapped_query(llama):
    # Rotated keys: the prompt's keys were rotated at 0..19 and turned by R(40000) exactly (the shift
    # is not the cast), so they sit right; the first decode at 20 + 40,000 = 40,020 wraps to
    # 40,020 - 65,536 = -25,516, and so does the key it writes.
    report = check(FAULTS["positions-int16"].adapter(llama), cases=[SHIFT_40000])
    d = report.diagnosis
    assert d is not None and d.kind == "position_wrapped", report.table()
    assert "query logical 40020, effective -25516 = 40020 - 2**16" in d.evidence
    assert "1 key(s) (40020) wrapped with it, 20 at their logical positions (40000..40019)" in d.evidence
    assert forensic_rows.query_position(d) == -25516 and d.details["index_bits"] == 16


def test_int16_positions_named_in_raw_form_where_the_sequence_straddles_2_15(llama):
    # Raw keys turn on read: positions 32,758..32,767 stay, 32,768..32,778 (the first decode's key
    # included) wrap to -32,768..-32,758, and the query at 32,778 to 32,778 - 65,536 = -32,758.
    report = check(FAULTS["positions-int16"].adapter(llama, key_form="raw"), cases=[SHIFT_STRADDLE])
    d = report.diagnosis
    assert d is not None and d.kind == "position_wrapped", report.table()
    assert "query logical 32778, effective -32758 = 32778 - 2**16" in d.evidence
    assert "11 key(s) (32768..32778) wrapped with it, 10 at their logical positions (32758..32767)" in d.evidence


def test_raw_keys_wrapping_alike_change_no_score(llama):
    # Every position of the 40,000 case is past 2**15 and wraps by the same 2**16: i - j is unchanged.
    report = check(FAULTS["positions-int16"].adapter(llama, key_form="raw"), cases=[SHIFT_40000])
    assert report.passed, report.table()


# ---------------------------------------------------------------------- past 2**31, through the harness
# A shifted case's rows start at its shift (RefRow.origin): a shift past 2**31 costs what one by 1,000 does.


def _shifted(delta: int) -> Case:
    return Case(length=20, block_size=7, decode_steps=2, op=CacheOp("shift", delta))


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
@pytest.mark.parametrize("delta", [2**31 - 10, 2**31 + 5, 2**32 + 7, 2**33])
def test_correct_float32_engine_passes_past_2_31(llama, key_form, delta):
    # Angles from int64 positions in float64 (p w to 2**-52 relative, 5e-7 rad at 2**31), cos/sin cast
    # to float32: the check holds with the margin it has at position 20.
    report = check(NativeAdapter(llama, key_form=key_form), cases=[_shifted(delta)])
    assert report.passed, report.table()
    tol = report.tolerances["reference"]["attn_logits"]
    assert report.cases[0].max_attn_error < tol / 5, report.table()
    assert report.cases[0].first_divergence is None


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_correct_float64_engine_passes_at_2_33(llama, key_form):
    # The shift's bound: a float64 engine against the float64 reference, tolerance 1e-6, measured 1.7e-7.
    report = check(NativeAdapter(llama, key_form=key_form, dtype="float64"), cases=[_shifted(2**33)])
    assert report.passed, report.table()


def test_a_row_from_its_origin_reads_keys_by_position():
    # Columns 0..2 are positions 2**31 .. 2**31 + 2 (the middle one hidden); anything outside is -inf.
    o = 2**31
    attn = torch.tensor([[1.0, float("-inf"), 3.0], [4.0, float("-inf"), 6.0]], dtype=torch.float64)
    row = RefRow(hidden_in=(None,), attn_logits=(attn,), logits=NextToken(torch.zeros(1)), origin=o)
    got = row.at(0, torch.tensor([o + 2, o, o - 1, o + 3]))
    inf = float("-inf")
    assert got.tolist() == [[3.0, 1.0, inf, inf], [6.0, 4.0, inf, inf]]
    assert row.visible(0).tolist() == [o, o + 2]


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_int32_positions_wrap_past_2_31_and_are_named(llama, key_form):
    # The prompt sits at 2**31 - 10 .. 2**31 + 9, the first decode at t = 2**31 + 10, which an int32
    # holds as t - 2**32; raw keys turn on read, so 2**31 .. 2**31 + 10 wrap with it.
    report = check(FAULTS["positions-int32"].adapter(llama, key_form=key_form), cases=[_shifted(2**31 - 10)])
    assert not report.passed, report.table()
    d = report.diagnosis
    assert d is not None and d.kind == "position_wrapped", report.table()
    t = 2**31 + 10
    assert f"query logical {t}, effective {t - 2**32} = {t} - 2**32" in d.evidence
    wrapped_keys = 1 if key_form == "rotated" else 11
    assert d.details["index_bits"] == 32 and d.details["wrapped_keys"] == wrapped_keys, d.evidence
    assert forensic_rows.query_position(d) == t - 2**32


def test_int32_positions_pass_below_2_31(llama):
    # Control: the same fault with every position below 2**31 - 1 changes nothing.
    report = check(FAULTS["positions-int32"].adapter(llama), cases=[_shifted(2**31 - 100)])
    assert report.passed, report.table()


def test_engine_bounds_a_shifted_sequence(llama):
    engine = NativeAdapter(llama).make_engine(Case(length=20, block_size=7))
    engine.prefill("s", token_stream(llama.config.vocab_size, 20))
    with pytest.raises(UsageError, match="beyond 1099511627776"):
        engine.shift("s", 2**40)
    engine.shift("s", 40000)
    with pytest.raises(UsageError, match=r"span 257, beyond the model's 256 positions"):
        engine.prefill("s", token_stream(llama.config.vocab_size, 237))
