"""The adapters shown in docs/adapters.md are real: they run, pass on a correct engine, and a bug
planted in them is caught at their tier (the logits tier localizes the step, the attention tier the layer)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ropekv import check
from ropekv.parity.cases import Case
from ropekv.testing.tiny import tiny_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "adapters"
sys.path.insert(0, str(EXAMPLES))

from attention_tier import MyAttentionEngine  # noqa: E402
from logits_tier import MyEngine  # noqa: E402

CASES = [Case(length=1), Case(length=17, chunk=5), Case(length=9, prefix=4, decode_steps=2)]


def _off_by_one(cls):
    class Buggy(cls):  # one-token forwards run one position too far (a 1-token prompt shifts as a whole: no error)
        def forward(self, ids, start, cache):
            return super().forward(ids, start + (1 if cache is not None and len(ids) == 1 else 0), cache)

    return Buggy


@pytest.mark.parametrize("path", ["logits_tier.py", "attention_tier.py"])
def test_docs_show_the_examples_verbatim(path):
    doc = (Path(__file__).resolve().parent.parent / "docs" / "adapters.md").read_text()
    assert (EXAMPLES / path).read_text() in doc


def test_logits_tier_example_passes_and_catches_a_bug():
    model = tiny_model("llama")
    report = check(MyEngine(model), cases=CASES)
    assert report.passed and report.tier == "logits"
    assert report.cases[0].ignored == ("block_size",)
    assert "no prefix cache" in " ".join(report.cases[2].ignored)
    bad = check(_off_by_one(MyEngine)(model), cases=CASES)
    assert not bad.passed and bad.diagnosis is None and bad.cases[0].passed
    fd = bad.cases[1].first_divergence
    assert fd.step == 0 and fd.layer is None
    assert "divergence localized to decode step 0" in bad.limits


def test_attention_tier_example_passes_and_localizes_a_bug():
    model = tiny_model("llama")
    report = check(MyAttentionEngine(model), cases=CASES)
    assert report.passed and report.tier == "attention"
    assert max(r.max_attn_error for r in report.cases) < 1e-4
    bad = check(_off_by_one(MyAttentionEngine)(tiny_model("llama")), cases=CASES)
    fd = bad.cases[1].first_divergence
    assert not bad.passed and fd.layer == 0 and fd.input_matched
    assert bad.diagnosis is None and "bug class not named" in bad.limits
    with torch.no_grad():  # the recorder left the model usable as before
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 96)
