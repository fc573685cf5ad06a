"""The adapters shown in docs/adapters.md are real: they run, pass on a correct engine, and a bug
planted in them is caught at their tier (the logits tier localizes the step, the attention tier the layer)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

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


# Sliding and full models, each through both DynamicCache kinds: the sliding layers generate() builds
# (DynamicCache(config=...), the examples' default) and full layers that keep every key (DynamicCache(),
# the window then lives in the mask only).
MODELS = {
    "llama": {},
    "mistral-sliding": {"arch": "mistral", "sliding_window": 12},
    "ministral-mixed": {
        "arch": "ministral",
        "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
WINDOW_CASES = CASES + [Case(length=30, decode_steps=3), Case(length=40, chunk=9, decode_steps=2)]


def _model(name):
    overrides = dict(MODELS[name])
    return tiny_model(overrides.pop("arch", name), **overrides)


def _full_layers(cls):
    class FullLayers(cls):
        def new_cache(self):
            return DynamicCache()

    return FullLayers


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("cache", ["sliding layers", "full layers"])
@pytest.mark.parametrize("example", [MyEngine, MyAttentionEngine], ids=["logits", "attention"])
def test_examples_pass_on_sliding_and_full_models(name, cache, example):
    model = _model(name)
    engine = (example if cache == "sliding layers" else _full_layers(example))(model)
    report = check(engine, cases=WINDOW_CASES)
    assert report.passed, report.table()
    if example is MyAttentionEngine:  # before: inf on every case past the window ("key position 0: reference -inf")
        assert max(r.max_attn_error for r in report.cases) < 1e-4


def test_attention_example_refuses_layers_it_cannot_label():
    model = tiny_model("llama")
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        MyAttentionEngine(model)


def test_keys_labelled_0_to_n_over_a_window_are_named_an_adapter_bug():
    # The examples' earlier labelling, arange(N) over a sliding layer's last N keys: the logits agree to
    # float precision, the recorded attention cannot; the diagnosis names the adapter, not the engine.
    class FromZero(MyAttentionEngine):
        def attention(self, module, query, key, value, mask, **kwargs):
            cache, self.cache = self.cache, None  # labels 0..N-1 whatever positions the cache holds
            try:
                return super().attention(module, query, key, value, mask, **kwargs)
            finally:
                self.cache = cache

    report = check(FromZero(_model("mistral-sliding")), cases=[Case(length=30, decode_steps=2)])
    assert not report.passed and max(r.max_abs_logit_diff for r in report.cases) < 1e-4
    d = report.diagnosis
    assert d is not None and d.kind == "mislabelled_keys", report.table()
    assert "the adapter's record is wrong" in d.evidence and "not the engine" in d.evidence
    # the 12 window keys at the decode of position 30 are 19..30, recorded as 0..11
    assert (
        "the 12 recorded keys are the reference's keys at positions 19..30 (recorded as 0..11, a constant shift of +19)"
        in d.evidence
    )
    assert d.details["layer"] == 0 and d.details["query_position"] == 30
    assert "bug class not named" not in report.limits and "the record, not the engine" in report.limits
