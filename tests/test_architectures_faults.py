"""Faults of per-layer RoPE features: each is caught by ``ropekv.check`` at the layer it breaks and
named by the explanations in ``ropekv.bugs`` from the records of that run; clean runs name nothing."""

from __future__ import annotations

import pytest
import torch

from ropekv import check
from ropekv.bugs.registry import ARCH_FAULTS, FAULTS, get_fault
from ropekv.errors import UsageError
from ropekv.models import ReferenceDecoder, load_checkpoint
from ropekv.parity.cases import Case, token_stream
from ropekv.parity.diagnose import layer_keymap
from ropekv.parity.explain.pattern import describe
from ropekv.parity.keymap.record import NOISE

CASES = [Case(length=17, block_size=7, decode_steps=3), Case(length=12, chunk=5, block_size=3, decode_steps=2)]
LLAMA4 = {
    "num_hidden_layers": 2,
    "attention_chunk_size": 8,
    "no_rope_layer_interval": 2,
    "floor_scale": 4,
    "attn_scale": 0.5,
    "num_local_experts": 4,
    "interleave_moe_layer_step": 2,
    "intermediate_size_mlp": 80,
}
SW = {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]}
GEMMA3 = {
    **SW,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
    },
}
MLA = {
    "num_key_value_heads": 4,
    "head_dim": 16,
    "kv_lora_rank": 20,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 16,
    "v_head_dim": 12,
    "n_routed_experts": 4,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "num_experts_per_tok": 2,
}
V3 = {**MLA, "q_lora_rank": 24, "n_group": 2, "topk_group": 1}
V2 = {**MLA, "q_lora_rank": None}
# (fault, model_type, overrides, the layer it breaks first)
RUNS = [
    ("partial-rotary-all-channels", "stablelm", {}, 0),
    ("partial-rotary-all-channels", "glm", {}, 0),
    ("partial-rotary-all-channels", "gpt_neox", {}, 0),
    ("local-rope-on-global-layers", "gemma3_text", GEMMA3, 1),
    ("global-rope-on-local-layers", "gemma3_text", GEMMA3, 0),
    ("nope-layer-rotated", "cohere2", SW, 1),
    ("nope-layer-rotated", "smollm3", {"no_rope_layers": [1, 0]}, 1),
    ("mla-rope-rotated-twice", "deepseek_v3", V3, 0),
    ("mla-rope-rotated-twice", "deepseek_v2", V2, 0),
    ("partial-rotary-all-channels", "deepseek_v3", V3, 0),  # MLA: the position-free part turns too
    ("nope-layer-rotated", "llama4_text", LLAMA4, 1),  # a NoPE layer with the temperature-scaled query
]


@pytest.mark.parametrize("fault,arch,overrides,layer", RUNS, ids=[f"{r[0]}-{r[1]}" for r in RUNS])
def test_arch_fault_is_caught_at_its_layer_and_named(fault, arch, overrides, layer, make_arch_checkpoint):
    ckpt = load_checkpoint(make_arch_checkpoint(arch, **overrides))
    adapter = ARCH_FAULTS[fault].adapter(ckpt)
    report = check(adapter, cases=CASES)
    assert not report.passed
    fd = next(c for c in report.cases if not c.passed).first_divergence
    assert fd.layer == layer
    d = report.diagnosis
    assert d.kind == ARCH_FAULTS[fault].kind, report.table()
    assert f"layer {layer}" in d.evidence


def _assert_clean_records_are_exact(ckpt) -> None:
    """Every layer's key map of a clean run of ropekv's engine on ``ckpt``: every query head and key
    exactly where the contract puts it (nothing for a bug class to read)."""
    tokens = token_stream(ckpt.config.vocab_size, 20, 0)
    from ropekv.adapters.native import NativeAdapter

    case = CASES[0]
    run = NativeAdapter(ckpt).run_case(case, tokens)
    for step in run.steps:
        probe_layers = ReferenceDecoder(ckpt).forward(tokens[: step.position + 1], probe_rows=[step.position]).layers
        for layer, (view, probe) in enumerate(zip(step.layers, probe_layers)):
            visible = torch.zeros(step.position + 1, dtype=torch.bool)
            visible[view.key_positions] = True
            km = layer_keymap(ckpt.config, case, layer, view, probe, 0, visible, step.position, NOISE["float32"])
            assert km is not None
            assert not bool(km.wrong_keys().any()) and not bool(km.wrong_query().any()), (layer, describe(km))


@pytest.mark.parametrize("arch,overrides", [("stablelm", {}), ("gemma3_text", GEMMA3), ("cohere2", SW)])
def test_clean_records_name_nothing(arch, overrides, make_arch_checkpoint):
    ckpt = load_checkpoint(make_arch_checkpoint(arch, **overrides))
    _assert_clean_records_are_exact(ckpt)


@pytest.mark.parametrize("arch,overrides", [("cohere", {}), ("glm", {}), ("gptj", {"rotary_dim": 8})])
def test_layout_mismatch_on_an_interleaved_model_is_named_by_the_harness(arch, overrides, make_arch_checkpoint):
    ckpt = load_checkpoint(make_arch_checkpoint(arch, **overrides))
    assert ckpt.config.rope.layout == "gptj"
    report = check(FAULTS["layout-mismatch"].adapter(ckpt), cases=CASES)
    assert not report.passed and report.diagnosis.kind == "layout_mismatch", report.table()


def test_arch_faults_refuse_models_without_their_feature(tiny_llama_dir):
    llama = load_checkpoint(tiny_llama_dir)
    for name in ARCH_FAULTS:
        with pytest.raises(UsageError, match="needs a model with"):
            get_fault(name).adapter(llama)


def test_existing_faults_run_on_nope_layers(make_arch_checkpoint):
    """Catalogued faults leave a NoPE layer alone (nothing to rotate) instead of crashing on it."""
    ckpt = load_checkpoint(make_arch_checkpoint("cohere2", **SW))
    report = check(FAULTS["double-rotation"].adapter(ckpt), cases=CASES[:1])
    assert not report.passed and report.diagnosis.kind == "double_rotation"


def test_mla_fault_turns_only_the_rope_part(make_arch_checkpoint):
    """The fault's keys: position-free channels as the reference's, the rope part at twice its position."""
    ckpt = load_checkpoint(make_arch_checkpoint("deepseek_v3", **V3))
    rope = ckpt.config.rope
    tokens = token_stream(ckpt.config.vocab_size, 20, 0)
    view = ARCH_FAULTS["mla-rope-rotated-twice"].adapter(ckpt).run_case(CASES[0], tokens).steps[0].layers[0]
    t = CASES[0].decode_positions[0]
    probe = ReferenceDecoder(ckpt).forward(tokens[: t + 1], probe_rows=[t]).layers[0]
    k_raw, pos = probe.k_raw[view.key_positions].double(), view.key_positions
    nope = slice(0, rope.rotary_offset)
    assert torch.allclose(view.k[..., nope].double(), k_raw[..., nope], atol=1e-5)
    cached = pos < t  # the decode step's own key is rotated by the same fault
    twice = rope.rotate(rope.rotate(k_raw, pos), pos)
    assert torch.allclose(view.k[cached].double(), twice[cached], atol=1e-4)
    assert not torch.allclose(view.k[cached][1:].double(), rope.rotate(k_raw, pos)[cached][1:], atol=1e-2)


# The catalogue on an MLA model (a rope part of 16 channels: with fewer frequency pairs the general
# forensics can mistake a frequency mismatch for a position offset): each fault that can run there is named by its own kind, never by the
# MLA kind; double rotation is the one exception, because on MLA it is exactly this bug (only the rope
# part turns, so a key rotated on write and again on read is the rope part rotated twice).
MLA_CASES = [*CASES, Case(length=10, prefix=3, chunk=4, block_size=3, decode_steps=2)]
ON_MLA = [
    "missing-rotation",
    "ignored-prefix-offset",
    "block-local-position",
    "decode-position-off-by-one",
    "scaling-mismatch",
    "layout-mismatch",
    "partial-rotary-all-channels",
]


@pytest.mark.parametrize("fault", ON_MLA)
def test_no_other_fault_is_named_mla_rope_rotated_twice(fault, make_arch_checkpoint):
    ckpt = load_checkpoint(make_arch_checkpoint("deepseek_v3", **V3))
    report = check(get_fault(fault).adapter(ckpt), cases=MLA_CASES)
    assert not report.passed
    assert report.diagnosis.kind == get_fault(fault).kind != "mla_rope_rotated_twice", report.table()


def test_double_rotation_on_an_mla_model_is_the_mla_kind(make_arch_checkpoint):
    ckpt = load_checkpoint(make_arch_checkpoint("deepseek_v2", **V2))
    report = check(FAULTS["double-rotation"].adapter(ckpt), cases=CASES[:1])
    assert not report.passed and report.diagnosis.kind == "mla_rope_rotated_twice", report.table()
    assert "rope part (channels 8..23)" in report.diagnosis.evidence


def test_mla_kind_names_no_clean_run_and_no_fault_elsewhere(make_arch_checkpoint):
    """Clean MLA records name nothing; on models without MLA the kind cannot come up at all."""
    ckpt = load_checkpoint(make_arch_checkpoint("deepseek_v3", **V3))
    _assert_clean_records_are_exact(ckpt)
    assert all(
        f.kind != "mla_rope_rotated_twice"
        for f in [*FAULTS.values(), *ARCH_FAULTS.values()]
        if f.name != "mla-rope-rotated-twice"
    )
