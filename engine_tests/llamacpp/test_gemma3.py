"""Gemma 3 270M on llama.cpp: sliding layers (window 512, base 10,000) and global ones (base 1e6) with
q/k norms. The default gemma check (ropekv's window matrix) on the all-float32 GGUF under float32's
tolerance and on the original Q4_K_M file under its measured noise floor; the keys each kind of layer
reads past the window, against the reference's window (docs/engines/llamacpp.md, "Gemma 3 270M")."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from ropekv import check
from ropekv.adapters.llamacpp import LlamaCppEngine, add_arguments, default_cases
from ropekv.adapters.llamacpp.f32_gguf import default_f32_gguf
from ropekv.adapters.llamacpp.judge import judge
from ropekv.adapters.llamacpp.tolerance import tolerance_for_run
from ropekv.models.default import default_gguf_path
from ropekv.parity.cases import Case, token_stream, window_matrix
from ropekv.parity.compare import Tolerance

SLIDING, GLOBAL = 0, 5  # layer 0 slides over 512 keys; layer 5 is the first global one


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    """The original Gemma 3 270M Q4_K_M GGUF (the one place naming it)."""
    return default_gguf_path("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_f32(gemma_gguf) -> LlamaCppEngine:
    return LlamaCppEngine(default_f32_gguf(gemma_gguf))


@pytest.fixture(scope="module")
def gemma_q4km(gemma_gguf) -> LlamaCppEngine:
    return LlamaCppEngine(gemma_gguf)


def test_a_windowed_gguf_gets_the_window_matrix_by_default(gemma_gguf):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert default_cases(parser.parse_args(["--gguf", str(gemma_gguf)])) == window_matrix(512)


def test_each_layer_reads_its_own_window_of_keys(gemma_f32):
    """Past the window, with a chunk across its edge: the sliding layer's kernel reads exactly the 512
    positions t-511..t (llama.cpp's own mask over its SWA cache), the global layer every position
    0..t; the recorded positions are llama.cpp's, per cache."""
    tokens = token_stream(gemma_f32.config.vocab_size, 700, seed=0)
    run = gemma_f32.run_case(Case(length=600, chunk=301), tokens)
    for step in run.steps:
        t = step.position
        assert sorted(step.layers[SLIDING].key_positions.tolist()) == list(range(t - 511, t + 1))
        assert sorted(step.layers[GLOBAL].key_positions.tolist()) == list(range(t + 1))
        for layer in (SLIDING, GLOBAL):  # q before RoPE is read before llama.cpp's in-place ROPE overwrites it
            q, q_raw = step.layers[layer].q, step.layers[layer].q_raw
            assert not torch.allclose(q, q_raw, atol=1e-2)
            assert torch.allclose(q.norm(dim=-1), q_raw.norm(dim=-1), rtol=1e-5)  # a rotation keeps norms


def test_f32_gguf_passes_the_default_gemma_check_under_float32s_tolerance(gemma_f32):
    assert gemma_f32.weights == "f32" and gemma_f32.tolerance == tolerance_for_run("f32", "f32", "f32")
    report = check(gemma_f32, cases=window_matrix(512), tolerance=gemma_f32.tolerance)
    assert report.passed, report.table()
    assert report.tier == "forensics"


def test_q4_k_m_passes_the_window_cases_under_its_noise_floor(gemma_q4km):
    """The window matrix's prefix hit and its chunk across the edge (the whole matrix is the CLI run in
    docs/engines/llamacpp.md; two cases keep the lane short) pass under the file's measured tolerance;
    under float32's the same report fails: the noise is the file's, and the tolerance is not slack."""
    assert gemma_q4km.weights == "Q4_K_M"
    cases = [c for c in window_matrix(512) if c.prefix or c.chunk == 301]
    report = check(gemma_q4km, cases=cases, tolerance=gemma_q4km.tolerance)
    assert report.passed, report.table()
    assert not judge(report, Tolerance(attn=2e-3, hidden=2e-3, logits=5e-3)).passed


def test_state_contract_carries_each_layers_rope_and_refuses_another_global_base(gemma_f32, tmp_path):
    """A context's rope_freq_base reaches Gemma 3's global layers only (layer 0 slides with 10,000
    whatever the context says): the state contract records each layer's RoPE as the graph runs it, so a
    reader with another base is refused naming layer_ropes, before anything is restored."""
    from ropekv.adapters.llamacpp.rope_params import RopeOverrides
    from ropekv.adapters.llamacpp.state import StateContext, load_state, save_state
    from ropekv.errors import ContractMismatch

    writer = StateContext(gemma_f32)
    assert [r.theta for r in writer.contract.layer_ropes[:6]] == [1e4] * 5 + [1e6]  # as the config says
    tokens = token_stream(gemma_f32.config.vocab_size, 40, seed=1).tolist()
    writer.prefill(tokens)
    save_state(writer, tmp_path / "s", tokens)
    reader = StateContext(gemma_f32, rope=RopeOverrides(freq_base=20000.0))
    assert reader.contract.rope == writer.contract.rope  # layer 0's RoPE: the same, so it alone hid the change
    assert [r.theta for r in reader.contract.layer_ropes[:6]] == [1e4] * 5 + [2e4]
    with pytest.raises(ContractMismatch) as err:
        load_state(reader, tmp_path / "s", tokens)
    assert "layer_ropes" in err.value.fields
    assert reader.positions() == (-1, -1)  # nothing was restored
    same = StateContext(gemma_f32)
    load_state(same, tmp_path / "s", tokens)
    assert same.positions() == (0, 39)
