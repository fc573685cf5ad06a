"""Faults patched into the built ONNX graph (ropekv.faults.ort): each caught and named by ropekv's
forensics on SmolLM2; the graph's own contract shows the pairing and base faults before anything runs."""

from __future__ import annotations

import pytest
from conftest import GEMMA_CASE

from ropekv import check
from ropekv.bugs.registry import REGISTRY
from ropekv.faults.ort import CATALOGUE
from ropekv.parity.cases import Case

FAULTS = {f.name: f for f in CATALOGUE}
CASES = {
    "ort-rotary-interleaved-flipped": [Case(length=17, decode_steps=1)],
    "ort-cos-sin-other-theta": [Case(length=40, decode_steps=1)],
    "ort-decode-position-off-by-one": [Case(length=17, decode_steps=1)],
}
STATIC = {
    "ort-rotary-interleaved-flipped": "rope.layout (graph 'gptj', model 'neox')",
    "ort-cos-sin-other-theta": "rope.theta (graph 10000.0, model 100000.0)",
    "ort-decode-position-off-by-one": "",  # a position the graph computes: nothing to read statically
}


def test_the_graph_faults_are_registered():
    assert all(REGISTRY[name] is f for name, f in FAULTS.items())
    assert {f.engine for f in CATALOGUE} == {"ort"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_fault_is_caught_and_named(name):
    fault = FAULTS[name]
    engine = fault.adapter()
    assert engine.graph_differences == STATIC[name]
    report = check(engine, cases=CASES[name])
    assert not report.passed, report.table()
    assert report.diagnosis is not None and report.diagnosis.kind == fault.kind, report.table()


def test_the_window_fault_is_named_on_gemma3(gemma_store):
    """Dropping Gemma 3's windows also drops the sliding buffers, so the graph allows the forensics tier,
    and the sliding layers reading 513 keys past the window are named."""
    fault = FAULTS["ort-window-dropped"]
    engine = fault.adapter("gemma3-270m")
    assert engine.tier == "forensics" and engine.contract.window is None
    report = check(engine, cases=[GEMMA_CASE], reference_cache=gemma_store)
    assert not report.passed and report.diagnosis.kind == fault.kind, report.table()
