"""vLLM float32 on Gemma 3 270M (five sliding layers of window 512 at RoPE base 10,000, then one
global layer at base 1,000,000): ropekv's windowed default matrix through the adapter, and the keys of
a sliding and a global layer against ropekv's float64 reference, per layer type.

The checkpoint: the embedded gemma3-270m, converted once to a float32 transformers folder
(docs/models.md). One vLLM instance for the module (about 10 s to start; the whole
file about 2 min on 2 cores).
"""

from __future__ import annotations

import pytest
import torch
from parity_tools import reference

from ropekv import check
from ropekv.models.default import default_checkpoint_dir
from ropekv.parity.cases import Case, token_stream, window_matrix
from ropekv.parity.compare import scaled_error

WINDOW = 512
SLIDING, GLOBAL = 0, 5  # layer_types: five sliding layers, then a global one


@pytest.fixture(scope="module")
def gemma():
    from ropekv.adapters.vllm import VLLMEngine

    return VLLMEngine(default_checkpoint_dir("gemma3-270m"), dtype="float32", block_size=32, max_model_len=2048)


def test_vllm_builds_one_rotation_per_layer_type(gemma):
    cfg = gemma.checkpoint.config
    thetas = [c.theta for c in gemma.layer_contracts]
    assert thetas == [cfg.layer_rope(i).theta for i in range(cfg.num_layers)]
    assert (thetas[SLIDING], thetas[GLOBAL]) == (10_000.0, 1_000_000.0)
    assert gemma.contract_diff == ()  # every layer's table within float32 rounding of its own base


def test_the_default_windowed_matrix_passes(gemma):
    report = check(gemma, cases=window_matrix(WINDOW))
    print(report.table())
    assert report.passed, report.table()
    assert report.tier == "forensics"
    for r in report.cases:
        # float32: measured 3e-5..8e-5 (log-probabilities), 8e-6..2.4e-5 (attention) on 18 layers
        assert r.max_abs_logit_diff < 1e-3 and r.max_attn_error < 1e-4 and r.max_self_attn_error < 1e-4, r
    hit = next(r for r in report.cases if r.case.prefix)
    assert any(n.startswith("vLLM took 480 of 600 ") for n in hit.notes), hit.notes  # 509-token prefix: 15 whole blocks
    assert any(n.startswith("sliding layers 0-4,6-10,12-16 dropped 91 of 603 keys") for n in hit.notes), hit.notes


def test_sliding_and_global_keys_match_the_reference_per_layer(gemma):
    case = Case(length=600, block_size=32, decode_steps=1)
    tokens = token_stream(gemma.checkpoint.config.vocab_size, case.total, 0)
    run = gemma.run_case(case, tokens)
    (step,) = run.steps
    t = step.position
    ref = reference(gemma, tokens[: t + 1], [t])
    for layer, first in ((SLIDING, t - WINDOW + 1), (GLOBAL, 0)):
        probe = step.layers[layer]
        # The window the kernel reads: exactly the reference's visible keys (t-511..t), all keys globally.
        assert probe.key_positions.tolist() == list(range(first, t + 1)), layer
        ref_keys = _ref_keys(ref.layers[layer], probe.key_positions)  # [N, KVH, D] rotated at their own base
        assert scaled_error(probe.k.double(), ref_keys.double()) < 1e-4, layer
    # The other base's rotation is far from what vLLM stored: the comparison sees the base.
    other = _rotate(step.layers[SLIDING].k_raw, step.layers[SLIDING].key_positions, 1_000_000.0)
    assert scaled_error(other, _ref_keys(ref.layers[SLIDING], step.layers[SLIDING].key_positions).double()) > 0.1


def _ref_keys(ref_probe, positions: torch.Tensor) -> torch.Tensor:
    """The reference's keys at logical ``positions`` (looked up by its own key positions)."""
    at = {int(p): i for i, p in enumerate(ref_probe.key_positions.tolist())}
    return ref_probe.k[torch.tensor([at[int(p)] for p in positions.tolist()])]


def _rotate(k: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-rotated ``k [N, KVH, D]`` at ``positions`` with base ``theta``, in float64."""
    d = k.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None]  # [N, D/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = k.double()[..., : d // 2], k.double()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
