"""Cache operations through the parity harness: each passes in both key forms across
lengths that cross a block and a wrapped window, against its own float64 reference; each catalogued
operation fault is caught and named; an adapter that cannot run an operation is refused, not passed.

References are computed by ropekv's float64 ReferenceDecoder (tests/test_reference.py checks it
against transformers), never by the engine under test.
"""

from __future__ import annotations

import pytest

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.registry import OP_FAULTS
from ropekv.errors import NotApplicable
from ropekv.models import load_checkpoint
from ropekv.parity.cases import CacheOp, Case

# Lengths cross a block (B=7) and the W=13 window wraps (40 + draft/decode tokens > 13 + 2 sinks).
OP_CASES = [
    Case(length=17, block_size=7, op=CacheOp("rollback", 3)),
    Case(length=40, block_size=5, window=13, sink_tokens=2, op=CacheOp("rollback", 4)),
    Case(length=30, prefix=13, block_size=7, op=CacheOp("evict", 5)),
    Case(length=40, block_size=5, window=13, sink_tokens=2, chunk=9, op=CacheOp("evict", 3)),
    Case(length=20, block_size=7, op=CacheOp("shift", 100)),
    Case(length=40, block_size=5, window=13, op=CacheOp("shift", 37)),
    Case(length=20, block_size=7, op=CacheOp("batch", 3)),
    Case(length=40, block_size=5, window=13, sink_tokens=2, op=CacheOp("batch", 2)),
    Case(length=30, prefix=13, block_size=7, op=CacheOp("restore")),
    Case(length=40, block_size=5, window=13, sink_tokens=2, op=CacheOp("restore")),
]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_every_operation_passes_in_both_key_forms(llama, key_form):
    report = check(NativeAdapter(llama, key_form=key_form), cases=OP_CASES)
    assert report.passed, report.table()
    tol = report.tolerances["reference"]["attn_logits"]
    assert max(c.max_attn_error for c in report.cases) < tol / 5, report.table()


def _fault_cases(fault) -> list[Case]:
    """Cases running the fault's operation: one plain, one on a wrapped window (B=5, W=13, 2 sinks)."""
    op = fault.op
    wrapped = Case(length=40, block_size=5, window=13, sink_tokens=2, op=op)
    if fault.needs_window:
        return [wrapped]
    return [Case(length=30, block_size=7, op=op), wrapped]


@pytest.mark.parametrize("name", sorted(OP_FAULTS))
def test_each_operation_fault_is_caught_and_named(llama, name):
    fault = OP_FAULTS[name]
    report = check(fault.adapter(llama), cases=_fault_cases(fault))
    assert not report.passed, f"{name} went unnoticed:\n{report.table()}"
    assert report.diagnosis is not None and report.diagnosis.kind == fault.kind, report.table()
    print(name, "->", report.diagnosis.evidence)


def test_hf_rollback_via_crop_passes_and_other_ops_are_not_applicable(tiny_llama_dir):
    """transformers' DynamicCache.crop runs a rollback; an operation the adapter cannot run is n/a in
    its row (never compared as if it had run), the other cases are judged; with nothing left to
    judge the run is refused (NotApplicable)."""
    from ropekv.adapters.hf import HFEngine

    hf = HFEngine.load(tiny_llama_dir)
    report = check(
        hf,
        cases=[
            Case(length=17, op=CacheOp("rollback", 3)),
            Case(length=40, window=13, sink_tokens=2, op=CacheOp("rollback", 4)),
        ],
    )
    assert report.passed, report.table()
    assert any("crop" in n for n in report.cases[0].notes)
    mixed = check(hf, cases=[Case(length=17), Case(length=20, op=CacheOp("evict", 3))])
    assert mixed.passed and [r.outcome for r in mixed.cases] == ["pass", "n/a"], mixed.table()
    assert "runs only rollback" in (mixed.cases[1].not_applicable or "")
    with pytest.raises(NotApplicable, match="nothing was judged"):
        check(hf, cases=[Case(length=20, op=CacheOp("evict", 3))])


def test_operation_faults_do_not_show_without_their_operation(llama):
    """An operation fault is a different engine only once its operation ran: plain cases pass."""
    plain = [Case(length=17, block_size=7), Case(length=40, block_size=5, window=13, sink_tokens=2)]
    for name in ("rollback-offset", "evict-offset", "shift-not-rotated", "restore-without-positions"):
        report = check(OP_FAULTS[name].adapter(llama), cases=plain)
        assert report.passed, f"{name} on plain cases:\n{report.table()}"


@pytest.mark.parametrize(
    "ops,named",
    [
        ("rollback", "needs an amount"),
        ("evict:x", "integer"),
        ("spin:3", "unknown operation"),
        ("batch:1", ">= 2"),
        ("rollback:3,,restore", "empty item"),
        ("restore:2", "no amount"),
    ],
)
def test_ops_flag_parse_errors_are_one_line_before_anything_is_read(tiny_llama_dir, capsys, monkeypatch, ops, named):
    import ropekv.models
    from ropekv.cli.main import main

    def forbidden(*a, **k):
        raise AssertionError("the model was read before --ops was refused")

    monkeypatch.setattr(ropekv.models, "load_config", forbidden)
    monkeypatch.setattr(ropekv.models, "load_checkpoint", forbidden)
    code = main(["check", str(tiny_llama_dir), "--ops", ops])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("ropekv: error: ") and named in err and err.count("\n") == 1, err


def test_ops_flag_runs_the_operations_and_inject_names_an_operation_fault(tiny_llama_dir, capsys):
    from ropekv.cli.main import main

    argv = [
        "check",
        str(tiny_llama_dir),
        "--lengths",
        "17,40",
        "--block-sizes",
        "7",
        "--ops",
        "evict:3,shift:50",
        "--no-progress",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("evict:3") == 2 and out.count("shift:50") == 2 and "parity holds in all 4 cases" in out
    assert main(argv + ["--inject", "evict-offset"]) == 1
    out = capsys.readouterr().out
    assert "diagnosis: evict_offset" in out and "the offset counts kept rows" in out
    assert main(["check", "--list-faults"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in OP_FAULTS)


def test_reference_positions_and_key_mask_against_transformers_and_removal(tiny_llama_dir, hf_model, llama):
    """The two reference keywords the operation cases use. ``positions``: transformers' forward with
    the same ``position_ids``. ``key_mask``: hiding token j's key from every other row equals the
    forward over the sequence without token j (positions kept), at every other row."""
    import torch

    from ropekv.models.reference import ReferenceDecoder

    ref = ReferenceDecoder(llama)
    tokens = torch.arange(20, 44)
    shifted = ref.forward(tokens, positions=torch.arange(24) + 137).logits
    with torch.no_grad():
        want = hf_model(tiny_llama_dir)(tokens[None], position_ids=(torch.arange(24) + 137)[None]).logits[0]
    torch.testing.assert_close(shifted.float(), want, atol=2e-4, rtol=0)
    j, T = 9, 24
    mask = torch.ones(T, T, dtype=torch.bool)
    mask[:, j] = False
    mask[j, j] = True
    masked = ref.forward(tokens, key_mask=mask).logits
    keep = [i for i in range(T) if i != j]
    removed = ref.forward(tokens[keep], positions=torch.tensor(keep)).logits
    torch.testing.assert_close(masked[keep], removed, atol=1e-9, rtol=0)


# Two layers, one sliding (base 1e4), one global (base 1e6): the gemma3 pattern at its smallest.
GEMMA3_TWO_BASES = {
    "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    },
}


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_shift_turns_each_layer_with_its_own_rope(make_arch_checkpoint, key_form):
    """A gemma3 model's sliding and global layers turn with different bases: a shift must turn each
    layer's keys with that layer's RoPE (turning the global layers with the sliding base diverged by
    2.4 in attention logits at layer 5 of Gemma 3 270M)."""
    ckpt = load_checkpoint(make_arch_checkpoint("gemma3_text", **GEMMA3_TWO_BASES))
    assert ckpt.config.layer_rope(0) != ckpt.config.layer_rope(1)  # two bases, or the test proves nothing
    report = check(
        NativeAdapter(ckpt, key_form=key_form), cases=[Case(length=20, block_size=7, op=CacheOp("shift", 100))]
    )
    assert report.passed, report.table()
