"""Faults of per-layer RoPE features: each is caught by ``ropekv.check`` at the layer it breaks and
named by ``ropekv.parity.layer_forensics`` from the records of that run; clean runs name nothing."""

from __future__ import annotations

import pytest

from ropekv.errors import UsageError
from ropekv.models import ReferenceDecoder, load_checkpoint
from ropekv.parity.cases import Case, token_stream
from ropekv.adapters.faults import ARCH_FAULTS, FAULTS, get_fault
from ropekv import check
from ropekv.parity.layer_forensics import diagnose_layer

CASES = [Case(length=17, block_size=7, decode_steps=3), Case(length=12, chunk=5, block_size=3, decode_steps=2)]
LLAMA4 = {"num_hidden_layers": 2, "attention_chunk_size": 8, "no_rope_layer_interval": 2, "floor_scale": 4,
          "attn_scale": 0.5, "num_local_experts": 4, "interleave_moe_layer_step": 2, "intermediate_size_mlp": 80}
SW = {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]}
GEMMA3 = {**SW, "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}
# (fault, model_type, overrides, the layer it breaks first)
RUNS = [
    ("partial-rotary-all-channels", "stablelm", {}, 0),
    ("partial-rotary-all-channels", "glm", {}, 0),
    ("local-rope-on-global-layers", "gemma3_text", GEMMA3, 1),
    ("global-rope-on-local-layers", "gemma3_text", GEMMA3, 0),
    ("nope-layer-rotated", "cohere2", SW, 1),
    ("nope-layer-rotated", "smollm3", {"no_rope_layers": [1, 0]}, 1),
    ("nope-layer-rotated", "llama4_text", LLAMA4, 1),  # a NoPE layer with the temperature-scaled query
]


def _name_from_records(adapter, report):
    """Re-run the first failing case and hand its diverging layer's records to layer forensics."""
    ckpt = adapter.checkpoint
    tokens = token_stream(ckpt.config.vocab_size, max(c.total for c in CASES), report.seed)
    result = next(c for c in report.cases if not c.passed)
    fd = result.first_divergence
    view = adapter.run_case(result.case, tokens).steps[fd.step].layers[fd.layer]
    t = fd.query_position
    probe = ReferenceDecoder(ckpt).forward(tokens[: t + 1], probe_rows=[t]).layers[fd.layer]
    return fd, diagnose_layer(ckpt.config, fd.layer, q_raw=probe.q_raw[0], q_eff=view.q[0],
                              k_raw=probe.k_raw[view.key_positions], k_eff=view.k,
                              key_positions=view.key_positions, query_position=t, seq_len=t + 1)


@pytest.mark.parametrize("fault,arch,overrides,layer", RUNS, ids=[f"{r[0]}-{r[1]}" for r in RUNS])
def test_arch_fault_is_caught_at_its_layer_and_named(fault, arch, overrides, layer, make_arch_checkpoint):
    ckpt = load_checkpoint(make_arch_checkpoint(arch, **overrides))
    adapter = ARCH_FAULTS[fault].adapter(ckpt)
    report = check(adapter, cases=CASES)
    assert not report.passed
    fd, diagnosis = _name_from_records(adapter, report)
    assert fd.layer == layer
    assert diagnosis is not None and diagnosis.kind == ARCH_FAULTS[fault].kind, diagnosis
    assert f"layer {layer}" in diagnosis.evidence
    # The harness names it itself, from the same records.
    assert report.diagnosis.kind == ARCH_FAULTS[fault].kind, report.table()


@pytest.mark.parametrize("arch,overrides", [("stablelm", {}), ("gemma3_text", GEMMA3), ("cohere2", SW)])
def test_clean_records_name_nothing(arch, overrides, make_arch_checkpoint):
    ckpt = load_checkpoint(make_arch_checkpoint(arch, **overrides))
    tokens = token_stream(ckpt.config.vocab_size, 20, 0)
    from ropekv.adapters.native import NativeAdapter

    run = NativeAdapter(ckpt).run_case(CASES[0], tokens)
    for step in run.steps:
        probe_layers = ReferenceDecoder(ckpt).forward(tokens[: step.position + 1], probe_rows=[step.position]).layers
        for layer, (view, probe) in enumerate(zip(step.layers, probe_layers)):
            assert diagnose_layer(ckpt.config, layer, q_raw=probe.q_raw[0], q_eff=view.q[0],
                                  k_raw=probe.k_raw[view.key_positions], k_eff=view.k,
                                  key_positions=view.key_positions, query_position=step.position,
                                  seq_len=step.position + 1) is None


@pytest.mark.parametrize("arch", ["cohere", "glm"])
def test_layout_mismatch_on_an_interleaved_model_is_named_by_the_harness(arch, make_arch_checkpoint):
    ckpt = load_checkpoint(make_arch_checkpoint(arch))
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
