"""M-RoPE axes on image-like positions: Qwen2-VL's three position streams (t, h, w) differ on an
image's tokens, so an engine that turns them at one position per token (h and w collapsed to t) is
wrong there and right on text. The positions come from ropekv.rope.image_streams, checked against
transformers' own get_rope_index; the rotation at them against transformers' rotary module."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.mrope_axes_collapsed import EXPOSING
from ropekv.bugs.registry import ARCH_FAULTS
from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.errors import ContractMismatch, UsageError
from ropekv.models import load_checkpoint
from ropekv.parity.applicable import applicability
from ropekv.parity.cases import CacheOp, Case, ImageGrid
from ropekv.parity.protocol import EngineDescription, Tier
from ropekv.rope import RopeSpec, image_streams
from ropekv.testing.tiers import at_tier

# theta 100 on a 16-wide head: every section's pairs turn fast enough to fit a position per stream
MROPE = {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]}
FAULT_NAMES = ["mrope-axes-collapsed", "mrope-hw-overwritten-by-t"]
TEXT_CASES = [Case(length=26, block_size=7, decode_steps=2), Case(length=14, prefix=11, block_size=5, chunk=6)]


@pytest.fixture(scope="module")
def qwen2_vl(make_arch_checkpoint):
    return load_checkpoint(make_arch_checkpoint("qwen2_vl", rope_parameters=MROPE))


def _hf_rope_index(n: int, start: int, rows: int, cols: int, merge: int = 2):
    """transformers' Qwen2VLModel.get_rope_index on one prompt with one image of ``rows x cols`` LLM
    tokens (a ``1 x rows*merge x cols*merge`` patch grid) at token ``start``."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    model = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)),
        get_vision_position_ids=lambda *a, **k: Qwen2VLModel.get_vision_position_ids(None, *a, **k),
    )
    types = torch.zeros(1, n, dtype=torch.int32)
    types[0, start : start + rows * cols] = 1  # image tokens
    ids = torch.full((1, n), 7, dtype=torch.int64)
    grid = torch.tensor([[1, rows * merge, cols * merge]])
    positions, deltas = Qwen2VLModel.get_rope_index(model, ids, types, image_grid_thw=grid)
    return positions[:, 0], int(deltas[0, 0])


@pytest.mark.parametrize("n,start,rows,cols", [(26, 5, 4, 4), (25, 3, 3, 5), (12, 0, 2, 6), (9, 1, 4, 2)])
def test_streams_match_transformers_get_rope_index(n, start, rows, cols):
    want, delta = _hf_rope_index(n, start, rows, cols)
    streams = image_streams(n, start, rows, cols)
    assert torch.equal(streams.streams, want)
    # decode past the prompt: Qwen2-VL's position n + rope_delta on all three streams
    assert torch.equal(streams.at(torch.tensor([n, n + 3])), torch.tensor([n + delta, n + 3 + delta]).expand(3, -1))


def test_rotation_at_image_streams_matches_transformers():
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    streams = image_streams(26, 5, 4, 4).streams
    text = AutoConfig.for_model(
        "qwen2_vl", text_config=dict(hidden_size=64, num_attention_heads=4, rope_parameters=MROPE)
    ).text_config
    hf_cos, hf_sin = Qwen2VLRotaryEmbedding(text)(torch.zeros(1), streams[:, None, :])
    spec = RopeSpec(head_dim=16, rotary_dim=16, theta=100.0, mrope_section=(2, 3, 3))
    cos, sin = spec.cos_sin(streams)
    assert torch.allclose(hf_cos[0].double(), torch.cat([cos, cos], -1), atol=1e-6)
    assert torch.allclose(hf_sin[0].double(), torch.cat([sin, sin], -1), atol=1e-6)
    assert not torch.allclose(cos, spec.cos_sin(streams[0])[0], atol=1e-3)  # the streams matter here


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_correct_engine_passes_on_image_positions(qwen2_vl, key_form):
    report = check(NativeAdapter(qwen2_vl, key_form=key_form), cases=list(EXPOSING))
    assert report.passed, report.table()
    assert all("img=" in c.case.label() for c in report.cases)


@pytest.mark.parametrize("name", FAULT_NAMES)
@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_fault_caught_at_every_tier_and_named(qwen2_vl, name, key_form):
    faulty = ARCH_FAULTS[name].adapter(qwen2_vl, key_form=key_form)
    for tier in (Tier.LOGITS, Tier.ATTENTION):
        low = check(at_tier(faulty, tier), cases=list(EXPOSING))
        assert not low.passed and low.diagnosis is None, low.table()
    report = check(faulty, cases=list(EXPOSING))
    assert not report.passed and report.diagnosis.kind == "mrope_axes_collapsed", report.table()
    # the first case: a 4x4 image at token 5: t = 5, h and w 5..8; token 5 itself is (5, 5, 5)
    assert "image keys 6..20 (15 keys): sections h, w sit at their t position (5)" in report.diagnosis.evidence
    assert "(h 5..8, w 5..8)" in report.diagnosis.evidence


@pytest.mark.parametrize("name", FAULT_NAMES)
def test_text_positions_hide_the_faults(qwen2_vl, name):
    """Why the image case is needed: on text t = h = w, and collapsing them changes nothing."""
    report = check(ARCH_FAULTS[name].adapter(qwen2_vl), cases=TEXT_CASES)
    assert report.passed, report.table()


def test_clean_engine_is_named_nothing_by_the_axes_fit(qwen2_vl):
    """The per-stream fit on a clean engine's keys puts every key at its own streams."""
    from ropekv.models import ReferenceDecoder
    from ropekv.parity.cases import token_stream
    from ropekv.parity.diagnose import layer_keymap
    from ropekv.parity.keymap.record import NOISE

    case = EXPOSING[0]
    tokens = token_stream(qwen2_vl.config.vocab_size, case.total, 0)
    step = NativeAdapter(qwen2_vl).run_case(case, tokens).steps[0]
    t = step.position
    ref = ReferenceDecoder(qwen2_vl).forward(tokens[: t + 1], probe_rows=[t], streams=case.position_streams())
    view = step.layers[0]
    visible = torch.ones(t + 1, dtype=torch.bool)
    km = layer_keymap(qwen2_vl.config, case, 0, view, ref.layers[0], 0, visible, t, NOISE["float32"])
    want = case.position_streams().at(view.key_positions).T  # [N, 3]
    assert torch.equal(km.keys.effective[:, 0, :], want) and torch.equal(km.keys.effective[:, 1, :], want)
    assert not bool(km.wrong_keys().any())


def test_shift_of_mrope_is_refused_loudly(qwen2_vl):
    cfg = qwen2_vl.config
    engine = Engine(qwen2_vl, CacheContract.for_model(cfg, key_form="rotated"), 8)
    engine.prefill("s", torch.arange(20, 30))
    with pytest.raises(ContractMismatch, match="M-RoPE RoPE is not shift-invariant"):
        engine.shift("s", 5)
    case = Case(length=20, block_size=7, decode_steps=2, op=CacheOp("shift", 10)).for_model(cfg.layer_attentions)
    why = applicability(case, cfg, EngineDescription(name="x", ops=("shift",)), ()).not_applicable
    assert why is not None and "M-RoPE RoPE is not shift-invariant" in why


def test_image_cases_are_bounded_and_validated(qwen2_vl, tiny_llama_dir):
    with pytest.raises(UsageError, match="past the 20-token prompt"):
        Case(length=20, image=ImageGrid(10, 3, 4))
    with pytest.raises(UsageError, match="without cache operations"):
        Case(length=30, image=ImageGrid(2, 3, 4), op=CacheOp("rollback", 2))
    with pytest.raises(UsageError, match="image grid"):
        ImageGrid(0, 0, 4)
    with pytest.raises(UsageError, match="image grid"):
        ImageGrid(0, 2000, 4)
    llama = load_checkpoint(tiny_llama_dir)
    report = check(NativeAdapter(llama), cases=[EXPOSING[0]] + TEXT_CASES[:1])
    assert [c.outcome for c in report.cases] == ["n/a", "pass"]
    assert "need an M-RoPE model" in (report.cases[0].not_applicable or "")
    engine = Engine(qwen2_vl, CacheContract.for_model(qwen2_vl.config, key_form="raw"), 8)
    engine.prefill("s", torch.arange(20, 30))  # text
    with pytest.raises(UsageError, match="cannot change under cached keys"):
        engine.prefill("s", torch.arange(20, 30), streams=image_streams(20, 2, 3, 3))


IMAGE_FLAGS = ["--image-grid", "4x4@5", "--lengths", "26", "--block-sizes", "7", "--decode-steps", "2"]


def test_cli_image_grid_runs_and_names_the_fault(make_arch_checkpoint, capsys):
    from ropekv.cli.main import main

    model = str(make_arch_checkpoint("qwen2_vl", rope_parameters=MROPE))
    assert main(["check", model, *IMAGE_FLAGS]) == 0
    assert "img=4x4@5" in capsys.readouterr().out
    assert main(["check", model, *IMAGE_FLAGS, "--inject", "mrope-axes-collapsed"]) == 1
    assert "diagnosis: mrope_axes_collapsed" in capsys.readouterr().out
    for bad, why in (("4x4", "write ROWSxCOLS@START"), ("4x4@30", "past the 26-token prompt"), ("0x4@1", "image grid")):
        assert main(["check", model, *IMAGE_FLAGS[2:], "--image-grid", bad]) == 2
        assert why in capsys.readouterr().err


@pytest.mark.parametrize("name", ["double-rotation", "missing-rotation"])
def test_other_rotation_faults_on_image_cases_are_not_named_collapsed(qwen2_vl, name):
    """Keys off their streams in every section are not M-RoPE axes collapsed: the class is the fault's own
    (each section of an image key at twice its own stream, or all at 0)."""
    from ropekv.bugs.registry import FAULTS

    report = check(FAULTS[name].adapter(qwen2_vl), cases=list(EXPOSING[:1]))
    assert not report.passed and report.diagnosis.kind == FAULTS[name].kind, report.table()
