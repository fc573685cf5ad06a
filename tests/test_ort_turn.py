"""The query turn the ONNX Runtime adapter measures from a token's own key (ropekv/adapters/ort/turn.py),
against ropekv's RoPE as an independent rotation; no onnxruntime needed."""

import pytest
import torch

from ropekv.adapters.ort.builder_main import flatten_layer_type_rope
from ropekv.adapters.ort.turn import apply_turn, check_scores, measured_turn, pairs, table_turn
from ropekv.errors import AdapterError
from ropekv.rope import RopeSpec

D, KVH, H = 16, 2, 4


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("position", [0, 7, 1000])
def test_the_keys_turn_applied_to_the_query_is_the_rotation_at_that_position(layout, position):
    spec = RopeSpec(head_dim=D, rotary_dim=D, theta=10000.0, layout=layout)
    gen = torch.Generator().manual_seed(position)
    k_raw, q_raw = torch.randn(KVH, D, generator=gen), torch.randn(H, D, generator=gen)
    pos = torch.tensor([position])
    k_rot = spec.rotate(k_raw[None].double(), pos)[0].float()
    a, b = pairs(D, D, interleaved=layout == "gptj")
    q = apply_turn(q_raw, measured_turn(k_raw, k_rot, a, b), a, b)
    expected = spec.rotate(q_raw[None].double(), pos)[0]
    assert float((q.double() - expected).abs().max()) < 1e-5


def test_the_other_pairing_is_not_a_rotation_of_the_query():
    """Measured in the wrong pairing, the turn does not rotate the query as the kernel did."""
    spec = RopeSpec(head_dim=D, rotary_dim=D, theta=10000.0, layout="neox")
    gen = torch.Generator().manual_seed(1)
    k_raw, q_raw = torch.randn(KVH, D, generator=gen), torch.randn(H, D, generator=gen)
    pos = torch.tensor([9])
    k_rot = spec.rotate(k_raw[None].double(), pos)[0].float()
    a, b = pairs(D, D, interleaved=True)
    q = apply_turn(q_raw, measured_turn(k_raw, k_rot, a, b), a, b)
    assert float((q.double() - spec.rotate(q_raw[None].double(), pos)[0]).abs().max()) > 0.1


def test_a_pair_zero_in_every_head_has_no_measured_turn_and_takes_the_table():
    k_raw = torch.randn(KVH, D)
    k_raw[:, 0] = k_raw[:, D // 2] = 0.0  # pair 0 of the half-split pairing
    a, b = pairs(D, D, interleaved=False)
    factor = measured_turn(k_raw, k_raw, a, b)
    assert torch.isnan(factor[0].real) and torch.allclose(factor[1:], torch.ones(D // 2 - 1, dtype=factor.dtype))
    cos, sin = torch.tensor([[1.0, 1.0], [0.6, 0.0]]), torch.tensor([[0.0, 0.0], [0.8, 1.0]])
    assert abs(complex(table_turn(cos, sin, 1)[0]) - complex(0.6, 0.8)) < 1e-7


def test_scores_that_disagree_with_the_kernels_are_refused():
    q, k = torch.randn(1, H, D), torch.randn(5, KVH, D)
    scores = 0.25 * torch.einsum("rhd,nhd->hrn", q, k.repeat_interleave(H // KVH, dim=1))
    assert check_scores("ort", 0, q, k, 0.25, scores) < 1e-6
    with pytest.raises(AdapterError, match="qk_output"):
        check_scores("ort", 0, q, k, 0.25, scores + 0.1)


class _Config:
    pass


def test_gemma3s_per_layer_type_rope_is_respelled_for_the_builder():
    config = _Config()
    config.rope_parameters = {
        "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
    }
    assert flatten_layer_type_rope(config)
    assert config.rope_parameters == {"rope_theta": 1e6, "rope_type": "default"}
    assert (config.rope_theta, config.rope_local_base_freq) == (1e6, 1e4)
    assert not flatten_layer_type_rope(config)  # already flat: untouched
