"""The adapter protocol: a catalogue of broken adapters, each refused with AdapterError naming the
field (none ever yields passed=True), the tiers, option handling, and assert_parity."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.registry import FAULTS
from ropekv.errors import AdapterError, UsageError
from ropekv.models import load_checkpoint
from ropekv.parity.cases import Case
from ropekv.parity.protocol import CaseRun, EngineDescription, FullRun, Tier
from ropekv.testing import assert_parity

CASES = [Case(length=9, block_size=4, decode_steps=3), Case(length=5, prefix=3, block_size=4, decode_steps=2)]


@pytest.fixture(scope="module")
def ckpt(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


@pytest.fixture(scope="module")
def native(ckpt):
    return NativeAdapter(ckpt)


class Wrapper:
    """Delegates to a working adapter; subclasses break one thing."""

    def __init__(self, inner, name="broken"):
        self.inner, self.name = inner, name
        self.tier, self.checkpoint, self.dtype = inner.tier, inner.checkpoint, inner.dtype

    def describe(self):
        return EngineDescription(name=self.name)

    def ignored(self, case):
        return ()

    def run_case(self, case, tokens):
        return self.inner.run_case(case, tokens)

    def full_forward(self, tokens, rows, case):
        return self.inner.full_forward(tokens, rows, case)


def _steps(run: CaseRun, fn) -> CaseRun:
    return dataclasses.replace(run, steps=tuple(fn(i, s) for i, s in enumerate(run.steps)))


def _layer(step, layer, **changes):
    layers = list(step.layers)
    layers[layer] = dataclasses.replace(layers[layer], **changes)
    return dataclasses.replace(step, layers=tuple(layers))


class FewerSteps(Wrapper):
    def run_case(self, case, tokens):
        run = super().run_case(case, tokens)
        return dataclasses.replace(run, steps=run.steps[:1])


class NoSteps(Wrapper):
    def run_case(self, case, tokens):
        return dataclasses.replace(super().run_case(case, tokens), steps=())


class FewerLayers(Wrapper):
    def run_case(self, case, tokens):
        return _steps(super().run_case(case, tokens), lambda i, s: dataclasses.replace(s, layers=s.layers[:1]))


class ExtraLayer(Wrapper):
    def run_case(self, case, tokens):
        return _steps(
            super().run_case(case, tokens), lambda i, s: dataclasses.replace(s, layers=s.layers + s.layers[-1:])
        )


class TransposedQuery(Wrapper):  # [H, 1, D] instead of [1, H, D]
    def run_case(self, case, tokens):
        return _steps(super().run_case(case, tokens), lambda i, s: _layer(s, 0, q=s.layers[0].q.transpose(0, 1)))


class FlatLogits(Wrapper):  # logits of another vocabulary size
    def run_case(self, case, tokens):
        return _steps(super().run_case(case, tokens), lambda i, s: dataclasses.replace(s, logits=s.logits[:-1]))


class PositionsOffByOne(Wrapper):
    def run_case(self, case, tokens):
        return _steps(
            super().run_case(case, tokens), lambda i, s: _layer(s, 1, key_positions=s.layers[1].key_positions + 1)
        )


class StepPositionWrong(Wrapper):
    def run_case(self, case, tokens):
        return _steps(
            super().run_case(case, tokens), lambda i, s: dataclasses.replace(s, position=s.position + (i == 1))
        )


class NaNKeys(Wrapper):
    def run_case(self, case, tokens):
        def nan(i, s):
            k = s.layers[0].k.clone()
            k[0, 0, 0] = float("nan")
            return _layer(s, 0, k=k)

        return _steps(super().run_case(case, tokens), nan)


class OtherHeadCount(Wrapper):  # keys with 3 heads where the model has 2 (and 4 query heads)
    def run_case(self, case, tokens):
        def heads(i, s):
            k = s.layers[0].k
            return _layer(s, 0, k=torch.cat([k, k[:, :1]], dim=1))

        return _steps(super().run_case(case, tokens), heads)


class FloatPositions(Wrapper):
    def run_case(self, case, tokens):
        return _steps(
            super().run_case(case, tokens), lambda i, s: _layer(s, 0, key_positions=s.layers[0].key_positions.double())
        )


class KeyOutsideWindow(Wrapper):
    """A faithful adapter of an engine that ignores its window: its kernel reads every key, including
    those older than the window (mlx-lm's make_prompt_cache(max_kv_size=...) on llama does this)."""

    def __init__(self, inner, unwindowed):
        super().__init__(inner, "reads-outside-window")
        self.unwindowed = unwindowed

    def run_case(self, case, tokens):
        return self.unwindowed.run_case(dataclasses.replace(case, window=None, sink_tokens=0), tokens)


class EmptyResult(Wrapper):
    def run_case(self, case, tokens):
        return None


class FullRowsWrong(Wrapper):
    def full_forward(self, tokens, rows, case):
        run = super().full_forward(tokens, rows, case)
        return dataclasses.replace(run, rows=run.rows + 1)


class FullFewerLayers(Wrapper):
    def full_forward(self, tokens, rows, case):
        run = super().full_forward(tokens, rows, case)
        return dataclasses.replace(run, layers=run.layers[:1])


class MissingFullForward:
    name, tier = "missing", Tier.LOGITS

    def __init__(self, inner):
        self.checkpoint, self.dtype = inner.checkpoint, inner.dtype

    def describe(self):
        return EngineDescription()

    def ignored(self, case):
        return ()

    def run_case(self, case, tokens):
        raise AssertionError("never called")


class BadTier(Wrapper):
    def __init__(self, inner):
        super().__init__(inner)
        self.tier = "everything"


class BadIgnored(Wrapper):
    def ignored(self, case):
        return "block_size"


BROKEN = [
    (FewerSteps, "steps", "3 decode steps"),
    (NoSteps, "steps", "3 decode steps"),
    (FewerLayers, "layers", "2 layers"),
    (ExtraLayer, "layers", "2 layers"),
    (TransposedQuery, "layer 0.q", "shape [1, 4, D]"),
    (FlatLogits, "logits", "shape [96]"),
    (PositionsOffByOne, "layer 1.key_positions", "positions in [0,"),
    (StepPositionWrong, "step 1.position", "position 10"),
    (NaNKeys, "layer 0.k", "finite values"),
    (OtherHeadCount, "layer 0.k", "KVH dividing 4"),
    (FloatPositions, "layer 0.key_positions", "an integer tensor"),
    (EmptyResult, "run_case", "a CaseRun"),
    (FullRowsWrong, "full_forward", "rows"),
    (FullFewerLayers, "full_forward", "2 layers"),
    (BadTier, "tier", "one of logits, attention, forensics"),
    (BadIgnored, "ignored", "a tuple of strings"),
]


@pytest.mark.parametrize("broken, field, expected", BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_broken_adapter_is_refused_naming_the_field(native, broken, field, expected):
    adapter = broken(native)
    with pytest.raises(AdapterError) as info:
        check(adapter, cases=CASES)
    err = info.value
    assert field in err.field, (err.field, str(err))
    assert expected in err.expected, (err.expected, str(err))
    assert str(err).startswith(f"adapter {adapter.name!r}: ")
    assert err.exit_code == 2


def test_missing_member_is_named(native):
    with pytest.raises(AdapterError, match="lacking full_forward"):
        check(MissingFullForward(native), cases=CASES)


def test_an_engine_reading_outside_its_window_fails_and_is_named(native):
    """Not an adapter error: the adapter reports truly what the kernel read. The harness fails the case
    (an infinite error against the reference's -inf) and names the window, not a rotation."""
    report = check(KeyOutsideWindow(native, native), cases=[Case(length=9, block_size=4, window=4, decode_steps=2)])
    assert not report.passed and report.diagnosis.kind == "window_mismatch"
    assert "read 6 key(s) the window hides" in report.diagnosis.evidence, report.diagnosis.evidence


def test_dtype_the_adapter_does_not_run_is_refused(native):
    with pytest.raises(UsageError, match="computes in torch.float32"):
        check(Wrapper(native), cases=CASES, dtype="bfloat16")
    with pytest.raises(UsageError, match="key_form"):
        check(Wrapper(native), cases=CASES, key_form="raw")


def test_empty_lengths_are_refused_not_defaulted(native):
    with pytest.raises(UsageError, match="lengths is empty"):
        check(native, lengths=[])


class LogitsOnly(Wrapper):
    """A logits-tier adapter: the cached path's next-token logits and the full forward's, nothing else."""

    def __init__(self, inner, name="logits-only"):
        super().__init__(inner, name)
        self.tier = Tier.LOGITS

    def run_case(self, case, tokens):
        return _steps(super().run_case(case, tokens), lambda i, s: dataclasses.replace(s, layers=()))

    def full_forward(self, tokens, rows, case):
        return dataclasses.replace(super().full_forward(tokens, rows, case), layers=())


class AttentionOnly(Wrapper):
    def __init__(self, inner, name="attention-only"):
        super().__init__(inner, name)
        self.tier = Tier.ATTENTION


def test_logits_tier_passes_a_correct_engine_and_says_what_it_cannot_conclude(native):
    report = check(LogitsOnly(native), cases=CASES)
    assert report.passed and report.tier == "logits"
    assert "layer and bug class not examined" in report.limits
    assert all(r.max_attn_error is None for r in report.cases)
    assert report.to_dict()["tier"] == "logits"


def test_logits_tier_detects_a_fault_at_the_first_step_without_layers(ckpt):
    faulty = FAULTS["double-rotation"].adapter(ckpt)
    report = check(LogitsOnly(faulty), cases=CASES)
    assert not report.passed and report.diagnosis is None
    fd = next(r.first_divergence for r in report.cases if r.first_divergence)
    assert fd.layer is None and fd.step == 0
    assert "logits tier: divergence localized to decode step 0" in report.limits
    assert "layer and bug class unknown" in report.limits


def test_attention_tier_localizes_the_layer_but_names_no_bug(ckpt):
    faulty = FAULTS["double-rotation"].adapter(ckpt)
    report = check(AttentionOnly(faulty), cases=CASES)
    fd = next(r.first_divergence for r in report.cases if r.first_divergence)
    assert not report.passed and fd.layer == 0 and report.diagnosis is None
    assert "bug class not named" in report.limits
    full = check(faulty, cases=CASES)
    assert full.diagnosis.kind == "double_rotation"


def test_assert_parity_raises_with_the_table_and_diagnosis(ckpt, native):
    assert assert_parity(native, cases=CASES).passed
    with pytest.raises(AssertionError) as info:
        assert_parity(FAULTS["decode-position-off-by-one"].adapter(ckpt), cases=CASES)
    message = str(info.value)
    assert "FAIL" in message and "diagnosis: query_position_offset" in message


def test_top_k_logprobs_are_compared_on_common_ids(native):
    """A logits-tier engine exposing top-k log-probabilities (vLLM) passes when correct, fails when not."""

    class TopK(LogitsOnly):
        def __init__(self, inner, k=5, shift=0.0):
            super().__init__(inner, "top-k")
            self.k, self.shift = k, shift

        def _top(self, logits):
            lp = torch.log_softmax(logits.double(), dim=-1)
            values, ids = lp.topk(self.k, dim=-1)
            return values, ids

        def run_case(self, case, tokens):
            def top(i, s):
                values, ids = self._top(s.logits)
                values = values.clone()
                values[..., 0] += self.shift  # a wrong engine: one log-probability off
                return dataclasses.replace(s, logits=values.clamp(max=0), token_ids=ids)

            return _steps(super().run_case(case, tokens), top)

        def full_forward(self, tokens, rows, case):
            run = super().full_forward(tokens, rows, case)
            values, ids = self._top(run.logits)
            return FullRun(rows=run.rows, logits=values, token_ids=ids)

    assert check(TopK(native), cases=CASES).passed
    assert not check(TopK(native, shift=-0.5), cases=CASES).passed
