"""vLLM float32 (kernel ``vec``) on the embedded SmolLM2: the contract it runs, and parity across the
issue's cases through ``ropekv.check`` (decode against vLLM's own prompt_logprobs forward and against
ropekv's float64 reference, layer by layer)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import BLOCK, BUDGET
from parity_tools import run_and_compare

from ropekv import check
from ropekv.adapters.vllm import vllm_cases
from ropekv.adapters.vllm.topk import topk_error, topk_error_vs_logits
from ropekv.parity.cases import Case, token_stream
from ropekv.parity.compare import scaled_error

LONG = 400  # the long case: chunked into 64-token forwards (CI time bounds it; docs/engines/vllm.md has 1,500)
CASES = vllm_cases(BLOCK, max_num_batched_tokens=BUDGET, long_context=LONG, decode_steps=2) + [
    Case(length=60, block_size=BLOCK, decode_steps=5)
]  # multi-step decode across a block boundary


@pytest.fixture(scope="module")
def report(engine_f32):
    report = check(engine_f32, cases=CASES)
    print(report.table())
    return report


def test_the_contract_read_from_vllms_model_is_the_checkpoints(engine_f32):
    c, spec = engine_f32.contract, engine_f32.checkpoint.config.rope
    assert (c.rope_type, c.theta, c.head_dim, c.rotary_dim, c.layout) == (
        spec.scaling.rope_type,
        spec.theta,
        spec.head_dim,
        spec.rotary_dim,
        spec.layout,
    )
    assert (c.block_size, c.dtype, c.kernel_isa, c.cos_sin_dtype, c.key_form) == (
        BLOCK,
        "float32",
        "vec",
        "float32",
        "rotated",
    )
    assert c.same_module_all_layers and c.cos_sin_positions == spec.max_position_embeddings
    assert 0 < c.cos_sin_max_error < 1e-3  # float32 angles: nonzero, below the stated tolerance
    assert engine_f32.contract_diff == ()
    assert engine_f32.describe().extra["contract_diff"] == []


def test_a_changed_rope_base_shows_in_the_contract_diff(engine_f32):
    spec = engine_f32.checkpoint.config.rope
    diff = engine_f32.contract.diff(spec.replace(theta=10000.0), tolerance=1e-3)
    assert {d.field for d in diff} == {"theta", "cos_sin_cache"}


def test_parity_holds_on_every_case(report):
    assert report.passed, report.table()
    assert report.tier == "forensics"
    for r in report.cases:
        # float32: top-k log-probabilities within 1e-3 of the float64 reference (measured 2e-5, 2.4e-4 at L=1)
        assert r.max_abs_logit_diff < 1e-3 and r.max_attn_error < 1e-4 and r.max_self_attn_error < 1e-4, r


def test_vllm_reports_its_prefix_cache_hits_and_chunks(report):
    hits = {r.case.prefix: r.notes[0] for r in report.cases}
    # vLLM reuses whole 32-token blocks only: its own counter says how many prompt tokens it took.
    assert hits[32].startswith("vLLM took 32 of 49 ") and hits[64].startswith("vLLM took 64 of 73 ")
    assert hits[BLOCK + 13].startswith("vLLM took 32 of 65 ") and hits[0].startswith("vLLM took 0 of")
    long = next(r for r in report.cases if r.case.length == LONG)
    assert long.notes[1].startswith(f"prefill of {LONG} tokens ran in {math.ceil(LONG / BUDGET)} forward pass(es)")


def test_keys_in_the_paged_cache_are_rotated_by_their_logical_positions(engine_f32):
    case = Case(length=40, prefix=BLOCK, block_size=BLOCK, decode_steps=2)
    tokens = token_stream(engine_f32.checkpoint.config.vocab_size, case.total, 0)
    errors, run = run_and_compare(engine_f32, case, tokens)
    from ropekv.models.reference import ReferenceDecoder

    ref = ReferenceDecoder(engine_f32.checkpoint).forward(tokens[: case.total], probe_rows=[case.total - 1])
    for step in run.steps:
        for probe, ref_layer in zip(step.layers, ref.layers):
            assert torch.equal(probe.key_positions, torch.arange(step.position + 1))  # from vLLM's slot mapping
            assert bool((probe.key_slots != probe.key_positions).all())  # slots are not positions here
            k_rot = ref_layer.k[probe.key_positions]  # the reference's rotated keys
            assert scaled_error(probe.k, k_rot) < 1e-4  # cache == k after RoPE (rotated form)
            assert scaled_error(probe.k, ref_layer.k_raw[probe.key_positions]) > 1e-2  # and not the raw keys
            assert scaled_error(probe.k_raw, ref_layer.k_raw[probe.key_positions]) < 1e-4  # qkv_proj's k
    assert max(errors.worst.values()) < 1e-4, errors.worst
    # The logits tier alone, on the union of the top-k sets: decode vs prompt_logprobs vs the reference.
    assert max(errors.logits_ref) < 1e-3 and max(errors.logits_self) < 1e-3, errors


def test_the_topk_comparison_is_not_vacuous():
    ids, lp = torch.tensor([5, 7, 9]), torch.tensor([-0.5, -1.0, -2.0])
    assert topk_error(ids, lp, ids, lp) == 0.0
    # token 5 only in the first list: at most -3.0 (the k-th value) in the second, so off by >= 2.5
    assert topk_error(ids, lp, torch.tensor([7, 9, 11]), torch.tensor([-1.0, -2.0, -3.0])) == 2.5
    logits = torch.full((16,), -30.0)
    logits[5], logits[7], logits[9] = 10.0, 9.5, 8.5
    full = torch.log_softmax(logits.double(), -1)
    assert topk_error_vs_logits(ids, full[ids].float(), logits) < 1e-6
    assert topk_error_vs_logits(torch.tensor([7, 9, 11]), full[[7, 9, 11]].float(), logits) > 1.0  # top token left out
