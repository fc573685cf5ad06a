"""The parity harness: clean engines pass, every catalogued fault fails with its own kind.

The harness compares against the float64 reference decoder, which tests/test_reference.py checks
against transformers; none of the expectations here are computed by the code under test.
"""

from __future__ import annotations

import json

import pytest

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.registry import FAULTS
from ropekv.bugs.stale_dynamic_scaling import dynamic_variant
from ropekv.models import load_checkpoint
from ropekv.parity import references
from ropekv.parity.cases import Case, build_matrix, default_matrix

# A small matrix that exercises every bug class on the tiny models (256 positions).
TINY_CASES = [
    Case(length=1),
    Case(length=17, block_size=7),
    Case(length=30, prefix=13, block_size=7, chunk=9),
    Case(length=40, block_size=5, window=13, sink_tokens=2, chunk=9),
    Case(length=200, chunk=64, decode_steps=2),
]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


@pytest.mark.parametrize("key_form,backend", [("rotated", "rotated"), ("raw", "rotate_on_read")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clean_engine_passes(llama, key_form, backend, dtype):
    report = check(NativeAdapter(llama, key_form=key_form, backend=backend, dtype=dtype), cases=TINY_CASES)
    assert report.passed, report.table()
    assert report.diagnosis is None
    tol = report.tolerances["reference"]["attn_logits"]
    # Clean runs stay well below the tolerance: the margin is what lets faults stand out.
    assert max(c.max_attn_error for c in report.cases) < tol / 5


@pytest.mark.parametrize(
    "name", sorted(n for n, f in FAULTS.items() if not hasattr(f, "op"))
)  # op faults: test_ops_parity
def test_each_fault_is_caught_and_named(llama, name):
    fault = FAULTS[name]
    report = check(fault.adapter(llama), cases=list(fault.exposing) or TINY_CASES)
    assert not report.passed, f"{name} went unnoticed:\n{report.table()}"
    assert report.diagnosis is not None and report.diagnosis.kind == fault.kind, report.table()
    failing = [c for c in report.cases if not c.passed]
    fd = failing[0].first_divergence
    assert fd is not None and 0 <= fd.layer < llama.config.num_layers
    assert fd.key_position <= fd.query_position


def test_faults_only_show_where_their_bug_class_can(llama):
    """Each bug hides where the primer says it hides; the harness must not blame other cases."""
    by_case = {
        name: [c.passed for c in check(FAULTS[name].adapter(llama), cases=TINY_CASES).cases]
        for name in ("slot-as-position", "ignored-prefix-offset", "block-local-position")
    }
    assert by_case["slot-as-position"] == [True, True, True, False, True]  # only the wrapped window
    assert by_case["ignored-prefix-offset"] == [True, True, False, True, True]  # only the prefix hit
    assert by_case["block-local-position"][0] is True  # one token never leaves the first block


def test_low_precision_angles_only_the_float64_reference_sees_it(llama):
    report = check(FAULTS["low-precision-angles"].adapter(llama), cases=TINY_CASES)
    failing = [c for c in report.cases if not c.passed]
    assert failing and all(c.self_passed and not c.reference_passed for c in failing)
    assert report.diagnosis.kind == "low_precision_angles"


def test_dynamic_ntk_raw_keys_exact_at_layer_0_and_stale_rotation_is_named(llama):
    """Against a full forward over exactly t + 1 tokens (transformers' semantics), raw keys rotated on
    read are exact at layer 0; deeper layers differ by what the cached prefix computed under earlier
    frequencies (inherent), far less than rotated keys with stale frequencies."""
    dyn = dynamic_variant(llama, original_max=64, factor=2.0)
    cases = [Case(length=60, decode_steps=8), Case(length=100, chunk=30)]
    raw = check(NativeAdapter(dyn, key_form="raw"), cases=cases)
    tol = raw.tolerances["reference"]["attn_logits"]
    assert all(step[0] < tol for c in raw.cases for step in c.attn_errors)  # layer 0 exact
    assert raw.cases[0].attn_errors[3][1] < tol  # before the original length: every layer exact
    stale = check(FAULTS["stale-dynamic-scaling"].adapter(llama), cases=cases)
    assert not stale.passed and stale.diagnosis.kind == "stale_dynamic_scaling"
    first = stale.cases[0].first_divergence
    assert first is not None and first.query_position >= 64 and first.layer == 0  # only past the original length
    assert max(c.max_attn_error for c in stale.cases) > 5 * max(c.max_attn_error for c in raw.cases)
    if not raw.passed:  # the inherent deeper-layer effect is named, not left unknown
        assert raw.diagnosis.kind == "stale_dynamic_scaling" and "inherent" in raw.diagnosis.evidence


def test_one_reference_forward_serves_every_case_of_a_window(llama, monkeypatch):
    calls = []
    original = references.ReferenceDecoder.forward

    def counting(self, tokens, **kw):
        calls.append((tokens.numel(), kw.get("window")))
        return original(self, tokens, **kw)

    monkeypatch.setattr(references.ReferenceDecoder, "forward", counting)
    check(llama, cases=TINY_CASES)
    # Two window settings in TINY_CASES (the model's own and W=13): one forward each, over the longest.
    assert sorted(calls, key=str) == sorted([(202, "model"), (43, 13)], key=str)


def test_report_json_round_trips_and_names_everything(llama):
    report = check(FAULTS["double-rotation"].adapter(llama), cases=TINY_CASES[:2])
    data = json.loads(report.to_json())
    assert data["format"] == "ropekv.parity-report" and data["passed"] is False
    assert data["model"]["fingerprint"] == llama.fingerprint
    assert data["engine"]["rotation_policy"] == "double-rotation"
    assert data["engine"]["contract"]["key_form"] == "rotated"
    case = data["cases"][0]
    for key in ("case", "passed", "max_abs_logit_diff", "first_divergence", "attn_errors", "self_attn_errors"):
        assert key in case
    assert case["first_divergence"]["against"] == "reference"
    assert data["diagnosis"]["kind"] == "double_rotation"
    assert "effective" in data["diagnosis"]["evidence"]


def test_default_matrix_covers_what_the_issue_asks():
    cases = default_matrix(8192)
    assert any(c.length == 1 for c in cases)
    assert any(c.block_size % 2 == 1 for c in cases)
    assert {15, 16, 17} <= {c.length for c in cases if c.block_size == 16 and c.prefix == 0}
    assert any(c.prefix and c.prefix % c.block_size for c in cases)
    assert any(c.chunk for c in cases)
    assert all(c.decode_steps > 1 for c in cases)
    wrapped = [c for c in cases if c.window_wrapped]
    assert wrapped and all(c.window % 2 == 1 for c in wrapped) and any(c.sink_tokens for c in wrapped)
    assert max(c.total for c in cases) > 1000


def test_matrix_flags_make_a_product_and_refuse_lengths_past_the_model():
    cases = build_matrix(lengths=[1, 17], block_sizes=[1, 7], prefix_offsets=[0, 13], max_positions=4096)
    assert len(cases) == 8
    from ropekv.errors import UsageError

    with pytest.raises(UsageError, match="positions"):
        build_matrix(lengths=[8190], max_positions=8192)


@pytest.mark.slow
def test_default_checkpoint_passes_reduced_matrix_in_both_key_forms():
    ckpt = load_checkpoint(None)
    cases = [
        Case(length=1),
        Case(length=17, block_size=7, prefix=5),
        Case(length=48, block_size=7, window=37),
        Case(length=300, chunk=128, decode_steps=2),
    ]
    for key_form in ("rotated", "raw"):
        report = check(ckpt, key_form=key_form, cases=cases)
        assert report.passed, report.table()
    report = check(FAULTS["double-rotation"].adapter(ckpt), cases=cases[:1] + cases[3:])
    assert report.diagnosis.kind == "double_rotation"
    # At position 1 a theta = 1e5 rotation barely turns anything: the layout fault must still be named
    # from the case that carries the evidence, not read as "no rotation".
    report = check(FAULTS["layout-mismatch"].adapter(ckpt), cases=cases[:1] + cases[3:])
    assert report.diagnosis.kind == "layout_mismatch"
