"""ropekv.check on ONNX Runtime GenAI: SmolLM2 at the forensics tier through the probed graph, Gemma 3 at
the logits tier; the contract read from the graph; the cache's keys against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import GEMMA_CASE

from ropekv import check
from ropekv.errors import UsageError
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import Case, token_stream


def test_smollm2_passes_at_the_forensics_tier(engine):
    cases = [Case(length=1, decode_steps=2), Case(length=30, prefix=13, chunk=7, decode_steps=2)]
    report = check(engine, cases=cases)
    assert report.passed, report.table()
    assert report.tier == "forensics"
    # Measured 3e-6 .. 1e-5 (docs/engines/ort.md): a key one position off moves scores by ~1.
    assert max(r.max_attn_error for r in report.cases) < 2e-4
    assert max(r.max_abs_logit_diff for r in report.cases) < 1e-3
    # every query was checked against the kernel's own scale * q K^T (qk_output)
    assert 0 < engine.last_score_error < 1e-4


def test_the_contract_is_read_from_the_graph(engine):
    c = engine.contract
    assert c.rotation_sites == ("kernel_write",) * 30 and not c.kernel_rotates
    assert c.key_form == "rotated" and c.layer_rope(0) == engine.config.rope  # pairing and base from the graph
    assert c.window is None and engine.graph_differences == ""
    assert all(la.do_rotary and not la.interleaved for la in engine.layers)


def test_the_kernel_stores_rotated_keys(engine):
    """The buffer the kernel reads holds R(j) k_j: 1e-5 from the float64 reference's rotated keys, far
    from its raw ones (the kernel never turns cached keys again)."""
    n = 24
    tokens = token_stream(engine.config.vocab_size, n)
    ref = ReferenceDecoder(engine.checkpoint).forward(tokens, probe_rows=[n - 1])
    gen = engine._generator(n)
    engine._append(gen, [int(t) for t in tokens])
    layer0 = engine.layers[0]
    stored = engine._keys(gen, layer0, n).double()  # [n, KVH, D]
    rotated, raw = ref.layers[0].k.double(), ref.layers[0].k_raw.double()
    scale = float(rotated.abs().max())
    assert float((stored - rotated).abs().max()) / scale < 1e-4
    assert float((stored[1:] - raw[1:]).abs().max()) / scale > 0.1
    assert engine._positions == list(range(n))  # the positions the Generator fed, slot by slot


def test_gemma3_runs_at_the_logits_tier_with_its_windows_read_from_the_graph(gemma, gemma_store):
    sliding = [la.index for la in gemma.layers if la.sliding_window_cache]
    assert sliding == [i for i in range(18) if i % 6 != 5]
    assert gemma.tier == "logits"
    c = gemma.contract
    # local_window_size=512 on the sliding layers: 512 keys, the query's own included, as transformers
    assert c.window_layers == tuple(sliding) and c.window == 512
    assert c.layer_rope(0).theta == 10000.0 and c.layer_rope(5).theta == 1000000.0  # from the cos/sin caches
    assert gemma.graph_differences == ""
    report = check(gemma, cases=[GEMMA_CASE], reference_cache=gemma_store)
    assert report.passed, report.table()


def test_a_tier_the_graph_does_not_allow_is_refused(gemma):
    from ropekv.adapters.ort import OrtEngine

    with pytest.raises(UsageError, match="allows the logits tier at most"):
        OrtEngine("gemma3-270m", tier="forensics")


def test_the_full_forward_returns_every_row(engine):
    tokens = token_stream(engine.config.vocab_size, 20)
    run = engine.full_forward(tokens, [3, 19], Case(length=17))
    ref = ReferenceDecoder(engine.checkpoint).forward(tokens)
    err = (run.logits.double() - ref.logits[[3, 19]].double()).abs().max()
    assert float(err) / float(ref.logits.abs().max()) < 1e-4
    assert torch.equal(run.layers[0].key_positions, torch.arange(20)) and run.layers[0].q.shape[0] == 2
    assert np.isfinite(run.logits.numpy()).all()


def test_gemma3_windows_over_full_buffers_reach_the_forensics_tier(gemma_store):
    """The sliding layers' own kernel window (local_window_size=512) over full-length buffers: every layer
    returns its scores, the query sees exactly the 512 keys transformers' Gemma 3 sees (the kernel's zero
    scores before them match the reference's masked ones), and the check passes at the forensics tier."""
    from ropekv.adapters.ort import OrtEngine

    engine = OrtEngine("gemma3-270m", full_buffers=True)
    assert engine.tier == "forensics" and engine.contract.window == 512
    report = check(engine, cases=[GEMMA_CASE], reference_cache=gemma_store)
    assert report.passed and report.tier == "forensics", report.table()
    assert engine.last_score_error < 1e-4
