"""Per-case outcomes: cases under the model's own windows, n/a with a reason, ignored parameters,
cases the model is too short for, numbers bounded by the model and the machine, the report's wording."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.attention_kind import LayerAttention
from ropekv.bugs.registry import FAULTS
from ropekv.cache.paged import PagedKVCache
from ropekv.contract import CacheContract
from ropekv.errors import CapacityError, NotApplicable, UsageError
from ropekv.models import load_checkpoint
from ropekv.parity.cases import CacheOp, Case, build_matrix
from ropekv.parity.protocol import CaseRun, EngineDescription, FullRun, Ignored
from ropekv.parity.report import REPORT_VERSION

EVICT = Case(length=30, prefix=13, block_size=7, decode_steps=2, op=CacheOp("evict", 5))


@pytest.fixture(scope="module")
def mistral12(make_tiny_checkpoint: Callable[..., Path]):
    """A tiny Mistral whose every layer slides with its own window of 12."""
    return load_checkpoint(make_tiny_checkpoint("mistral", sliding_window=12))


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


# ---------------------------------------------------------------------- the model's own windows


def test_evict_picks_positions_the_models_window_still_caches(mistral12):
    """Evicting from the case window's range ([1, 11, 21, ...]) was refused by the cache mid-run
    ("not live in the cache", exit 2 for the whole run); under W=12 only 32..41 are live."""
    report = check(mistral12, cases=[EVICT, Case(length=30, prefix=13, block_size=7, op=CacheOp("evict", 2))])
    assert report.passed, report.table()
    for r in report.cases:
        assert r.outcome == "pass" and "W=12(model)" in r.case.label()
        evicted = r.case.evicted_positions
        n = r.case.prefix + r.case.length
        assert evicted and all(n - 12 < p < n - 1 for p in evicted), evicted


def test_evict_more_than_the_models_window_keeps_is_not_applicable(mistral12):
    too_many = Case(length=30, prefix=13, block_size=7, decode_steps=2, op=CacheOp("evict", 11))
    report = check(mistral12, cases=[Case(length=17), too_many])
    assert report.passed and [r.outcome for r in report.cases] == ["pass", "n/a"], report.table()
    assert "model's window 12 has only 10 interior live tokens" in (report.cases[1].not_applicable or "")


def test_labels_show_the_models_own_windows():
    sliding, full, chunked = LayerAttention("sliding", 4), LayerAttention("full"), LayerAttention("chunked", 8)
    case = Case(length=20, block_size=7)
    assert case.for_model([LayerAttention("sliding", 12)] * 2).label() == "L=20 P=0 B=7 W=12(model) S=3"
    assert case.for_model([sliding, full]).label() == "L=20 P=0 B=7 W=4|full(model) S=3"
    assert case.for_model([chunked, full]).label() == "L=20 P=0 B=7 C=8|full(model) S=3"
    assert case.for_model([full, full]).label() == "L=20 P=0 B=7 S=3"
    own = Case(length=20, window=13)  # a case window replaces the model's: nothing recorded
    assert own.for_model([sliding, full]) == own
    # With a full layer every position stays cached somewhere: evictions spread over the prompt.
    mixed = EVICT.for_model([sliding, full])
    assert mixed.evicted_positions == [1, 11, 21, 31, 41]


# ---------------------------------------------------------------------- not applicable, per case


def test_a_shift_the_rope_forbids_is_na_and_the_fault_is_still_named(llama):
    """--inject stale-dynamic-scaling exited 3 (the shift case refused a non-shift-invariant RoPE)
    before any report; now the shift row is n/a and the other cases name the fault."""
    cases = [Case(length=60, decode_steps=8), Case(length=20, block_size=7, decode_steps=2, op=CacheOp("shift", 50))]
    report = check(FAULTS["stale-dynamic-scaling"].adapter(llama), cases=cases)
    assert [r.outcome for r in report.cases] == ["fail", "n/a"], report.table()
    assert "not shift-invariant" in (report.cases[1].not_applicable or "")
    assert not report.passed and report.diagnosis is not None
    assert report.diagnosis.kind == "stale_dynamic_scaling"


def test_every_case_na_is_refused_not_passed(mistral12):
    with pytest.raises(NotApplicable, match="nothing was judged"):
        check(mistral12, cases=[Case(length=300)])


def test_default_matrix_lists_the_cases_the_model_is_too_short_for(llama):
    report = check(llama, cases=build_matrix(max_positions=256))
    skipped = {r.case.label(): r.not_applicable for r in report.cases if r.outcome == "n/a"}
    # shift:1000 reaches position 1,021 but spans 22 positions: RoPE scores depend on i - j only, so it
    # runs on a model of 256 positions (ropekv.parity.cases.too_long)
    assert skipped == {"L=1100 P=0 B=16 chunk=256 S=3": "needs 1103 positions; the model has 256"}, report.table()
    assert report.passed and len(report.judged) == 14
    table = report.table()
    assert "not applicable: needs 1103 positions; the model has 256" in table
    assert "parity holds in all 14 judged cases; 1 case not applicable" in table
    data = json.loads(report.to_json())
    assert data["version"] == REPORT_VERSION == 4 and data["judged"] == 14 and data["not_applicable"] == 1
    rows = {c["label"]: c for c in data["cases"]}
    assert rows["L=1100 P=0 B=16 chunk=256 S=3"]["outcome"] == "n/a"
    assert rows["L=1100 P=0 B=16 chunk=256 S=3"]["not_applicable"] == "needs 1103 positions; the model has 256"
    assert rows["L=1 P=0 B=16 S=3"]["outcome"] == "pass" and rows["L=1 P=0 B=16 S=3"]["not_applicable"] is None
    assert data["units"]["max_abs_logit_diff"].startswith("absolute")
    assert data["units"]["attn_errors"].startswith("[step][layer] scale-aware")


def test_explicit_lengths_the_model_cannot_hold_are_still_refused_up_front():
    with pytest.raises(UsageError, match="needs 303 positions; the model has 256"):
        build_matrix(lengths=[17, 300], max_positions=256)


# ---------------------------------------------------------------------- ignored parameters


class IgnoresWindow(NativeAdapter):
    """A hand-written adapter whose engine has no case windows: it runs every case under the model's
    own attention, and says so in ``ignored()``; it also ignores the block size (one fixed block)."""

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        out = [Ignored("block_size", "block_size (one block of 16)")]
        if case.window is not None:
            out.append(Ignored("window", "window (the engine runs the model's own attention)"))
        return tuple(out)

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        return super().run_case(Case(length=case.length, prefix=case.prefix, decode_steps=case.decode_steps), tokens)

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        return super().full_forward(tokens, rows, Case(length=case.length))

    def describe(self) -> EngineDescription:
        return EngineDescription(name=self.name, ops=())


def test_an_ignored_window_is_not_judged_and_an_ignored_block_size_is(llama):
    """Before, the window case was reported "ignored for this engine: block_size, window" and then
    judged anyway: FAIL window_mismatch on a correct engine."""
    adapter = IgnoresWindow(llama, name="no-windows")
    report = check(adapter, cases=[Case(length=17, block_size=7), Case(length=40, block_size=5, window=13)])
    assert report.passed and [r.outcome for r in report.cases] == ["pass", "n/a"], report.table()
    assert report.cases[0].ignored == ("block_size (one block of 16)",)  # noted, judged
    why = report.cases[1].not_applicable or ""
    assert "window (the engine runs the model's own attention)" in why and "expected output" in why
    assert report.diagnosis is None


# ---------------------------------------------------------------------- numbers bounded


@pytest.mark.parametrize(
    "flags,named",
    [
        ({"block_sizes": [10_000_000], "lengths": [17]}, "block size 10000000 is larger than the model's 256"),
        ({"window": 10**9}, "window 1000000000 is larger than the model's 256"),
        ({"chunk": 100_000, "lengths": [17]}, "chunk 100000 is larger than the model's 256"),
    ],
)
def test_block_sizes_windows_and_chunks_are_bounded_by_the_models_positions(flags, named):
    with pytest.raises(UsageError, match=named):
        build_matrix(max_positions=256, **flags)


def test_a_case_handed_to_check_is_bounded_too(llama):
    """``--block-sizes 10000000`` was a raw RuntimeError after trying to allocate 12.8 GB."""
    with pytest.raises(UsageError, match="block size 10000000 is larger"):
        check(llama, cases=[Case(length=17, block_size=10_000_000)])


def test_a_cache_pool_that_cannot_fit_is_refused_before_allocating(llama):
    contract = CacheContract.for_model(llama.config, key_form="rotated", block_size=10**7)
    with pytest.raises(CapacityError, match="needs .* GiB; cpu has .* GiB available"):
        PagedKVCache(contract, 1000)


@pytest.mark.parametrize("length", [0, -5])
def test_bad_lengths_give_one_message(length):
    with pytest.raises(UsageError, match=rf"case length must be an integer >= 1, got {length}$"):
        Case(length=length)


# ---------------------------------------------------------------------- wording and plots


def test_one_case_is_one_case_and_its_plot_ticks_are_integers(llama, tmp_path):
    from ropekv.parity.plot import figure

    report = check(llama, cases=[Case(length=40, decode_steps=2)])
    assert "parity holds in 1 case (" in report.table() and "1 cases" not in report.table()
    fig = figure(report)
    fig.canvas.draw()  # tick labels are set when drawn
    ticks = [t.get_text() for t in fig.axes[1].get_xticklabels() if t.get_text()]  # the right panel
    assert ticks and len(ticks) == len(set(ticks)), ticks  # was "40 40 40 41 41"
    assert all(float(t.replace(",", "")).is_integer() for t in ticks), ticks


# ---------------------------------------------------------------------- the default matrix, own windows

REPRESENTATIVE = [
    ("mistral", {"sliding_window": 12}, "W=12(model)"),  # every layer slides
    ("gemma2", {"sliding_window": 5, "query_pre_attn_scalar": 16}, "W=5|full(model)"),  # sliding / global
    (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
        "W=12|full(model)",
    ),
]


@pytest.mark.parametrize("arch,overrides,label", REPRESENTATIVE, ids=[r[0] for r in REPRESENTATIVE])
def test_default_matrix_passes_under_the_models_own_windows(make_arch_checkpoint, arch, overrides, label):
    """What ``ropekv check DIR`` runs; the tiny mistral with window 12 exited 2 after 12 of 13 cases.
    scripts/check_architectures.py runs the same over every architecture."""
    ckpt = load_checkpoint(make_arch_checkpoint(arch, **overrides))
    report = check(ckpt, cases=build_matrix(max_positions=ckpt.config.position_limit))
    assert report.passed, report.table()
    skipped = sorted((r.case.length, r.not_applicable or "") for r in report.not_applicable)
    assert (1100, "needs 1103 positions; the model has 256") in skipped, report.table()
    # shift:1000 spans 22 positions (it runs past the model's 256); n/a only where the RoPE forbids a shift
    others = [why for length, why in skipped if length != 1100]
    assert all("not shift-invariant" in why for why in others), report.table()
    assert any(label in r.case.label() and r.case.op is not None for r in report.judged), report.table()
