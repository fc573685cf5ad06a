"""The per-layer cache contract: each layer's RoPE (or none), compared layer by layer, serialized."""

from __future__ import annotations

import json

import pytest

from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.errors import ConfigError, ContractMismatch
from ropekv.rope import RopeScaling, RopeSpec

LOCAL = RopeSpec(head_dim=8, rotary_dim=8, theta=1e4)
GLOBAL = RopeSpec(head_dim=8, rotary_dim=8, theta=1e6, scaling=RopeScaling("linear", factor=4.0))


def make(layer_ropes=(LOCAL, GLOBAL, LOCAL), **changes) -> CacheContract:
    base = dict(
        key_form="rotated",
        rope=LOCAL,
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        window=5,
        window_layers=(0, 2),
        block_size=4,
        layer_ropes=layer_ropes,
    )
    base.update(changes)
    return CacheContract(**base)


def test_layer_rope_per_layer_and_uniform_normalizes_to_none():
    c = make()
    assert [c.layer_rope(i) for i in range(3)] == [LOCAL, GLOBAL, LOCAL]
    assert make(layer_ropes=(LOCAL,) * 3).layer_ropes is None  # one RoPE everywhere: the plain contract
    assert make(layer_ropes=(LOCAL, None, LOCAL)).layer_rope(1) is None


@pytest.mark.parametrize(
    "ropes,match",
    [
        ((LOCAL, GLOBAL), "one RoPE spec"),
        ((LOCAL, "rope", LOCAL), "RopeSpec or None"),
        ((LOCAL, RopeSpec(head_dim=16, rotary_dim=16, theta=1e4), LOCAL), "head_dim"),
    ],
)
def test_bad_layer_ropes_raise(ropes, match):
    with pytest.raises(ConfigError, match=match):
        make(layer_ropes=ropes)


def test_diff_names_the_layer_and_the_field():
    ours, theirs = make(), make(layer_ropes=(LOCAL, LOCAL.replace(theta=5e5), LOCAL))
    fields = {d.field for d in ours.diff(theirs)}
    assert "layers.1.rope.theta" in fields and "layers.1.rope.scaling.rope_type" in fields
    assert not any(f.startswith(("layers.0.", "layers.2.")) for f in fields)
    with pytest.raises(ContractMismatch) as info:
        ours.require_compatible(theirs)
    assert "layers.1.rope.theta" in str(info.value) and "on layer 1:" in str(info.value)


def test_nope_against_rope_on_a_layer_is_named():
    with pytest.raises(ContractMismatch) as info:
        make(layer_ropes=(LOCAL, None, LOCAL)).require_compatible(make())
    assert "layers.1.rope" in info.value.fields
    assert "layer 1 has no position embedding (NoPE) on one side" in str(info.value)


def test_uniform_against_per_layer_is_compared_layer_by_layer():
    uniform = make(layer_ropes=None)
    fields = {d.field for d in uniform.diff(make())}
    assert {"layers.1.rope.theta"} <= fields and not any(f.startswith("layers.0.") for f in fields)


def test_json_round_trip_and_unchanged_format_for_uniform_contracts():
    c = make(layer_ropes=(LOCAL, None, GLOBAL))
    back = CacheContract.from_json(c.to_json())
    assert back == c and back.layer_rope(1) is None and back.layer_rope(2) == GLOBAL
    plain = make(layer_ropes=None)
    assert "layer_ropes" not in json.loads(plain.to_json())  # one RoPE for all layers: left out
    assert CacheContract.from_json(plain.to_json()) == plain
    bad = json.loads(c.to_json())
    bad["layer_ropes"] = [1, 2, 3]
    with pytest.raises(ConfigError, match="layer_ropes"):
        CacheContract.from_json(json.dumps(bad))


def test_for_model_carries_the_models_layer_ropes(make_arch_checkpoint):
    from ropekv.models import load_checkpoint

    sw = {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]}
    ckpt = load_checkpoint(make_arch_checkpoint("cohere2", **sw))
    contract = CacheContract.for_model(ckpt.config, key_form="rotated")
    assert contract.layer_rope(0) == ckpt.config.rope and contract.layer_rope(1) is None
    # A contract that rotates the NoPE layer does not fit the model: refused before any cache exists.
    wrong = contract.replace(layer_ropes=None)
    with pytest.raises(ContractMismatch, match="layer_ropes") as info:
        Engine(ckpt, wrong)
    assert "layer_ropes" in info.value.fields


# ---------------------------------------------------------------------- multi-head latent attention

MLA_V3 = {
    "num_key_value_heads": 4,
    "head_dim": 8,
    "kv_lora_rank": 20,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 4,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "num_experts_per_tok": 2,
    "q_lora_rank": 24,
    "n_group": 2,
    "topk_group": 1,
}


@pytest.fixture(scope="module")
def mla_config(make_arch_checkpoint):
    from ropekv.models import load_checkpoint

    return load_checkpoint(make_arch_checkpoint("deepseek_v3", **MLA_V3)).config


def test_mla_contract_says_which_part_is_rotated_and_what_is_cached(mla_config):
    c = CacheContract.for_model(mla_config, key_form="rotated")
    assert (c.head_dim, c.num_kv_heads) == (16, 4)  # expanded per-head keys [k_nope 8, k_pe 8]
    assert (c.rope.rotary_offset, c.rope.rotary_dim, c.rope.layout) == (8, 8, "gptj")  # the last 8, interleaved
    assert c.mla.cached == "expanded" and c.mla.v_head_dim == 12 and c.mla.kv_lora_rank == 20
    latent = CacheContract.for_model(mla_config, key_form="rotated", mla_form="latent")
    assert (latent.head_dim, latent.num_kv_heads, latent.rope.rotary_offset) == (28, 1, 20)  # [latent 20, k_pe 8]
    for contract in (c, latent):
        data = json.loads(contract.to_json())
        assert (
            data["mla"]["cached"] == contract.mla.cached
            and data["rope"]["rotary_offset"] == contract.rope.rotary_offset
        )
        assert CacheContract.from_json(contract.to_json()) == contract


def test_mla_mismatches_are_named(mla_config):
    expanded = CacheContract.for_model(mla_config, key_form="rotated")
    latent = CacheContract.for_model(mla_config, key_form="rotated", mla_form="latent")
    with pytest.raises(ContractMismatch) as info:
        expanded.require_compatible(latent)
    assert {"mla.cached", "rope.rotary_offset", "head_dim", "num_kv_heads"} <= set(info.value.fields)
    assert "compressed latent" in str(info.value)
    # The rotated slice alone: a writer that rotated the leading channels instead of the trailing ones.
    trailing = CacheContract(
        key_form="rotated", rope=RopeSpec(16, 8, 1e4, rotary_offset=8), num_layers=2, num_kv_heads=4, head_dim=16
    )
    with pytest.raises(ContractMismatch) as info:
        trailing.require_compatible(trailing.replace(rope=trailing.rope.replace(rotary_offset=0)))
    assert info.value.fields == ("rope.rotary_offset",) and "another slice of each key" in str(info.value)
    # MLA on one side only is one difference, not one per field.
    plain = expanded.replace(mla=None)
    assert [d.field for d in expanded.diff(plain)] == ["mla"]


def test_mla_contract_is_validated(mla_config):
    c = CacheContract.for_model(mla_config, key_form="rotated")
    with pytest.raises(ConfigError, match="must rotate exactly the rope part"):
        c.replace(rope=c.rope.replace(rotary_offset=0))
    with pytest.raises(ConfigError, match="rows of 28 channels in one head"):
        c.replace(mla=CacheContract.for_model(mla_config, key_form="rotated", mla_form="latent").mla)
    with pytest.raises(ConfigError, match="rotary_offset"):
        RopeSpec(head_dim=16, rotary_dim=8, theta=1e4, rotary_offset=9)


def test_engine_refuses_a_latent_cache_contract(make_arch_checkpoint):
    from ropekv.models import load_checkpoint

    ckpt = load_checkpoint(make_arch_checkpoint("deepseek_v3", **MLA_V3))
    latent = CacheContract.for_model(ckpt.config, key_form="rotated", mla_form="latent")
    with pytest.raises(ContractMismatch, match="caches MLA keys 'expanded'") as info:
        Engine(ckpt, latent, num_blocks=8)
    assert "mla.cached" in info.value.fields


def test_rope_specs_without_offset_keep_their_serialized_form():
    spec = RopeSpec(head_dim=16, rotary_dim=8, theta=1e4)
    assert "rotary_offset" not in spec.to_dict() and RopeSpec.from_dict(spec.to_dict()) == spec
    shifted = spec.replace(rotary_offset=8)
    assert shifted.to_dict()["rotary_offset"] == 8 and RopeSpec.from_dict(shifted.to_dict()) == shifted
    assert shifted.fingerprint() != spec.fingerprint()
