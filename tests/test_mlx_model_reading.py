"""What the mlx adapter does when mlx-lm built a layer otherwise than config.json says (no mlx needed:
stand-ins with mlx-lm's class names and attributes).

A RoPE built otherwise is a finding the check must judge (mlx-lm 0.28's gemma3_text dropped the global
layers' linear scaling: that release must FAIL, not be refused); a window built otherwise, or a RoPE
that the caller's own overrides built, is refused as another model than the folder's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ropekv.adapters.mlx.model_reading import check_built, rope_reading_note
from ropekv.errors import ConfigError
from ropekv.models.hf_config import read_model_config

GEMMA3 = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 96,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "rope_theta": 1e6,
    "rope_local_base_freq": 1e4,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}


class RoPE:  # mlx.nn.RoPE's attributes: p turns by p * scale * base^(-2m/dims)
    def __init__(self, base: float, scale: float) -> None:
        self.dims, self.traditional, self.base, self.scale = 16, False, base, scale


class RotatingKVCache:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size


class KVCache:
    pass


def model(global_scale: float) -> SimpleNamespace:
    """Layer 0 sliding (base 1e4, unscaled), layer 1 global (base 1e6, scale ``global_scale``)."""
    ropes = (RoPE(1e4, 1.0), RoPE(1e6, global_scale))
    return SimpleNamespace(layers=[SimpleNamespace(self_attn=SimpleNamespace(rope=r)) for r in ropes])


CACHES = [RotatingKVCache(8), KVCache()]


def test_the_model_as_config_json_says_gives_no_finding():
    config = read_model_config(GEMMA3)
    assert check_built(model(1 / 8), CACHES, config, refuse_rope=False) == ()


def test_a_global_layer_built_without_its_linear_scaling_is_a_finding_not_a_refusal():
    config = read_model_config(GEMMA3)
    found = check_built(model(1.0), CACHES, config, refuse_rope=False)
    assert found == ("layer 1 RoPE scaling default (ropekv: linear x8)",)
    note = rope_reading_note(found)
    assert "mlx-lm turns otherwise than config.json says (layer 1 RoPE scaling default (ropekv: linear x8))" in note
    assert "the float64 reference follows config.json" in note


def test_the_same_rope_built_from_the_callers_overrides_is_refused():
    config = read_model_config(GEMMA3)
    with pytest.raises(ConfigError, match=r"layer 1 RoPE scaling default \(ropekv: linear x8\)"):
        check_built(model(1.0), CACHES, config, refuse_rope=True)


def test_a_window_built_otherwise_is_refused_whoever_built_it():
    config = read_model_config(GEMMA3)
    with pytest.raises(ConfigError, match=r"layer 0 cache KVCache window None \(ropekv: 8\)"):
        check_built(model(1 / 8), [KVCache(), KVCache()], config, refuse_rope=False)
