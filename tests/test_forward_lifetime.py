"""How long a check holds its full forwards (ropekv.parity.references.References): each shared forward is
run once, and dropped after the last case that reads it, so a long check does not carry every
forward's probes (all positions' keys and values, per layer) to its end. A failing check's
forensics read a dropped reference again, recomputed, and name the same bug."""

from __future__ import annotations

from pathlib import Path

import pytest

from ropekv import check
from ropekv.bugs.registry import FAULTS
from ropekv.models import load_checkpoint
from ropekv.models.config import Checkpoint
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity import references
from ropekv.parity.cases import Case, build_matrix, parse_ops

# Two attention groups (full attention; a window with sinks), each read by more than one case, and
# cache operations: an eviction and a shift have a reference forward of their own, a rollback reads
# the full group's. So four reference forwards, whatever the order of the cases.
CASES = [
    Case(length=17, block_size=7),
    Case(length=40, block_size=5, window=13, sink_tokens=2, decode_steps=2),
    Case(length=30, prefix=13, block_size=7, chunk=9),
    Case(length=33, block_size=5, window=13, sink_tokens=2),
] + build_matrix(ops=parse_ops("evict:3,shift:50,rollback:2"), lengths=[20], max_positions=256)
FORWARDS = 4


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> Checkpoint:
    return load_checkpoint(tiny_llama_dir)


@pytest.fixture
def watched(monkeypatch):
    """Counts the reference forwards, and after each judged case records how many forwards (float64
    and the engine's) the check still holds."""
    seen: dict[str, list[int]] = {"forwards": [], "held": [], "references_held": []}
    real_forward, real_done = ReferenceDecoder.forward, references.References.done
    real_reference_done = references.References.done_with_reference

    def forward(self, tokens, **kwargs):
        seen["forwards"].append(len(tokens))
        return real_forward(self, tokens, **kwargs)

    def done(self, case):
        real_done(self, case)
        seen["held"].append(len(self._ref) + len(self._op_ref) + len(self._self))

    def reference_done(self, case):
        real_reference_done(self, case)
        seen["references_held"].append(len(self._ref) + len(self._op_ref))

    monkeypatch.setattr(ReferenceDecoder, "forward", forward)
    monkeypatch.setattr(references.References, "done_with_reference", reference_done)
    monkeypatch.setattr(references.References, "done", done)
    return seen


def test_each_forward_runs_once_and_none_outlives_its_last_reader(llama, watched):
    report = check(llama, cases=CASES)
    assert report.passed
    assert len(watched["forwards"]) == FORWARDS  # none recomputed: no forward was dropped early
    # After each case, the forwards (a float64 reference and the engine's own per group) that later
    # cases still read: the full group's two stay until the rollback, its last reader (the shift's
    # self rows are the full group's, relabelled); the window group's two go after its second case;
    # the eviction's and the shift's own references go with their cases.
    assert watched["held"] == [2, 4, 4, 2, 2, 2, 0]
    # Between a case's reference rows and the engine's full forward, the float64 forwards still held:
    # a group's reference goes with its last reader's reference rows, before that case's engine
    # forward runs; the eviction's own reference stays until its self rows (which are reference rows).
    assert watched["references_held"] == [1, 2, 2, 1, 2, 1, 0]


@pytest.mark.parametrize("fault", ["block-local-position", "shift-not-rotated"])
def test_a_failing_check_names_its_bug_without_recomputing_a_reference(llama, watched, fault):
    report = check(FAULTS[fault].adapter(llama), cases=CASES)
    assert not report.passed and report.diagnosis is not None
    assert report.diagnosis.kind == FAULTS[fault].kind
    # each failing case's evidence is taken while its forward is held: no forward runs twice
    assert len(watched["forwards"]) == FORWARDS
    assert watched["held"][-1] == 0
