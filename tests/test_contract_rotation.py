"""The cache contract compares what RoPE computes, not how the configuration spells it.

A field that changes no key or query (``max_position_embeddings`` outside dynamic NTK) takes no part;
a difference in the frequencies is named by the fields that produce it; the weights fingerprint covers
the weights alone, so "keys come from another model" is said only when the weights differ.
"""

import json

import pytest
import torch

from ropekv.contract import CacheContract
from ropekv.errors import ContractMismatch
from ropekv.handoff import vllm_driver
from ropekv.models.config import Checkpoint
from ropekv.rope import RopeScaling, RopeSpec
from ropekv.testing.tiny import tiny_checkpoint

LLAMA3 = RopeScaling(
    "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
SCALINGS = {
    "default": RopeScaling(),
    "linear": RopeScaling("linear", factor=2.0),
    "llama3": LLAMA3,
    "yarn": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64),
}


@pytest.fixture(scope="module")
def ckpt() -> Checkpoint:
    c = tiny_checkpoint("llama")
    assert isinstance(c, Checkpoint)
    return c


def with_rope(ckpt: Checkpoint, scaling: RopeScaling, max_positions: int) -> Checkpoint:
    """The same weights under ``scaling`` and ``max_position_embeddings`` (config and RoPE spec)."""
    rope = ckpt.config.rope.replace(scaling=scaling, max_position_embeddings=max_positions)
    return ckpt.with_config(ckpt.config.replace(rope=rope, max_position_embeddings=max_positions))


def contract(ckpt: Checkpoint) -> CacheContract:
    return CacheContract.for_model(ckpt.config, key_form="rotated", weights_fingerprint=ckpt.weights_fingerprint)


@pytest.mark.parametrize("scaling", ["default", "linear", "llama3", "yarn"])
def test_another_max_position_embeddings_is_accepted_where_it_changes_no_key(ckpt, scaling):
    """A consumer serving 4096 positions against a producer serving 8192, same weights: the keys are
    the same (the frequencies do not depend on the length), so the contracts agree."""
    producer = with_rope(ckpt, SCALINGS[scaling], 8192)
    consumer = with_rope(ckpt, SCALINGS[scaling], 4096)
    assert producer.fingerprint != consumer.fingerprint  # the checkpoint's own fingerprint covers the config
    assert contract(consumer).diff(contract(producer)) == []
    contract(consumer).require_compatible(contract(producer), ours="consumer", theirs="producer")


def test_dynamic_ntk_with_another_max_position_embeddings_is_refused_by_that_field(ckpt):
    """Dynamic NTK grows its base past max_position_embeddings: another length is another rotation."""
    dynamic = RopeScaling("dynamic", factor=2.0)
    producer, consumer = with_rope(ckpt, dynamic, 8192), with_rope(ckpt, dynamic, 4096)
    with pytest.raises(ContractMismatch) as info:
        contract(consumer).require_compatible(contract(producer), ours="consumer", theirs="producer")
    assert info.value.fields == ("rope.max_position_embeddings",)
    assert "dynamic NTK would grow its base past another sequence length" in str(info.value)
    # ... and the rotation really differs past the shorter length (float64, outside the contract code)
    specs = [c.config.rope for c in (producer, consumer)]
    positions = torch.tensor([5000])
    cos = [spec.cos_sin(positions, seq_len=6000)[0] for spec in specs]
    assert not torch.allclose(cos[0], cos[1], rtol=1e-9, atol=0)


def test_llama3_bands_refused_naming_the_rope_field_not_the_weights(ckpt):
    producer = with_rope(ckpt, LLAMA3, 8192)
    other = RopeScaling(
        "llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=64
    )
    consumer = with_rope(ckpt, other, 8192)
    with pytest.raises(ContractMismatch) as info:
        contract(consumer).require_compatible(contract(producer), ours="consumer", theirs="producer")
    assert set(info.value.fields) == {"rope.scaling.low_freq_factor", "rope.scaling.high_freq_factor"}
    assert "weights_fingerprint" not in str(info.value) and "another model" not in str(info.value)
    assert "config_fingerprint" not in info.value.fields


def test_other_weights_are_refused_naming_the_weights(ckpt):
    weights = dict(ckpt.weights)
    name = "model.layers.0.self_attn.k_proj.weight"
    weights[name] = weights[name] * 1.5
    other = Checkpoint.from_tensors(ckpt.config, weights, source="other weights")
    assert other.config_fingerprint == ckpt.config_fingerprint
    with pytest.raises(ContractMismatch) as info:
        contract(other).require_compatible(contract(ckpt), ours="consumer", theirs="producer")
    assert info.value.fields == ("weights_fingerprint",)
    assert "keys come from another model (other weights)" in str(info.value)


def test_another_configuration_outside_rope_is_named_as_the_configuration(ckpt):
    """The same weights under another norm epsilon: not "another model", another configuration."""
    other = ckpt.with_config(ckpt.config.replace(rms_norm_eps=1e-3))
    with pytest.raises(ContractMismatch) as info:
        contract(other).require_compatible(contract(ckpt))
    assert info.value.fields == ("config_fingerprint",)
    assert "another model" not in str(info.value)


@pytest.mark.parametrize(
    "a, b",
    [
        # the same frequencies, spelled twice: theta as an int and a float, factor 1 against no scaling
        (RopeSpec(head_dim=16, rotary_dim=16, theta=10000), RopeSpec(head_dim=16, rotary_dim=16, theta=1e4)),
        (
            RopeSpec(head_dim=16, rotary_dim=16, theta=1e4),
            RopeSpec(head_dim=16, rotary_dim=16, theta=1e4, scaling=RopeScaling("linear", factor=1.0)),
        ),
        (
            RopeSpec(head_dim=16, rotary_dim=16, theta=1e4),
            RopeSpec(
                head_dim=16,
                rotary_dim=16,
                theta=1e4,
                scaling=RopeScaling(
                    "llama3", factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
                ),
            ),
        ),
    ],
    ids=["theta-int-float", "linear-factor-1", "llama3-factor-1"],
)
def test_equal_frequencies_spelled_differently_are_accepted(a, b):
    def make(spec: RopeSpec) -> CacheContract:
        return CacheContract(key_form="rotated", rope=spec, num_layers=2, num_kv_heads=2, head_dim=16)

    assert make(a).diff(make(b)) == []


def test_older_contract_versions_are_refused_naming_the_version(ckpt):
    data = json.loads(contract(ckpt).to_json())
    data["version"] = 4
    with pytest.raises(Exception) as info:
        CacheContract.from_json(json.dumps(data))
    assert type(info.value).__name__ == "ConfigError" and "version 4 is not supported" in str(info.value)


def test_the_vllm_sides_do_not_compare_max_position_embeddings():
    """vLLM's max_model_len follows max_position_embeddings; under default RoPE it changes no key."""

    def side(max_positions: int) -> dict:
        rope = RopeSpec(head_dim=64, rotary_dim=64, theta=1e5, max_position_embeddings=max_positions)
        c = CacheContract(key_form="rotated", rope=rope, num_layers=2, num_kv_heads=2, head_dim=64, block_size=32)
        run = {"theta": 1e5, "dtype": "float32", "max_position_embeddings": max_positions}
        return {"cache_contract": c.to_dict(), "contract": run}

    assert vllm_driver.compare_sides(side(8192), side(4096)) == ([], [])


def test_the_engine_takes_a_contract_whose_rope_differs_only_where_no_key_changes(ckpt):
    """check_contract_fits_model compares the model's RoPE with the contract's by what they compute."""
    from ropekv.engine.fit import check_contract_fits_model

    longer = contract(ckpt).replace(rope=ckpt.config.rope.replace(max_position_embeddings=8192))
    check_contract_fits_model(ckpt, longer)  # default RoPE: the length changes no key
    dynamic = with_rope(ckpt, RopeScaling("dynamic", factor=2.0), 256)
    other_length = contract(dynamic).replace(rope=dynamic.config.rope.replace(max_position_embeddings=8192))
    with pytest.raises(ContractMismatch, match="rope.max_position_embeddings") as info:
        check_contract_fits_model(dynamic, other_length)
    assert info.value.fields == ("rope",)
