"""Sliding layers of configs without ``layer_types``: derived exactly as each architecture's
transformers 5 config class derives them (``Family.windows``), or refused where transformers itself
has no rule. Checked against the config classes (layer by layer) and numerically (the reference's
logits from a config.json stripped of ``layer_types`` against transformers' forward)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCH_BASE, build_arch_model
from test_architectures import MOE, TOL, scaled

from ropekv.errors import ConfigError
from ropekv.models import ReferenceDecoder, load_checkpoint
from ropekv.models.hf_config import read_model_config

W = 5
QWEN2_MOE = {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, **MOE}
GPT_OSS = {"num_local_experts": 4, **MOE}
# (id, model_type, fields of a hand-written config.json without layer_types)
DERIVED = [
    ("gemma2", "gemma2", {"sliding_window": W}),
    ("gemma3-default-period", "gemma3_text", {"sliding_window": W}),
    ("gemma3-pattern", "gemma3_text", {"sliding_window": W, "sliding_window_pattern": 3}),
    ("cohere2-default-period", "cohere2", {"sliding_window": W}),
    ("cohere2-pattern", "cohere2", {"sliding_window": W, "sliding_window_pattern": 3}),
    ("exaone4-default-period", "exaone4", {"sliding_window": W}),
    ("exaone4-pattern", "exaone4", {"sliding_window": W, "sliding_window_pattern": 3}),
    ("olmo3", "olmo3", {"sliding_window": W}),
    ("ministral", "ministral", {"sliding_window": W}),
    ("ministral-no-window", "ministral", {"sliding_window": None}),
    ("gpt_oss", "gpt_oss", {"sliding_window": W, **GPT_OSS}),
    ("qwen2", "qwen2", {"sliding_window": W, "use_sliding_window": True, "max_window_layers": 3}),
    ("qwen2-default-max-window-layers", "qwen2", {"sliding_window": W, "use_sliding_window": True}),
    ("qwen3", "qwen3", {"sliding_window": W, "use_sliding_window": True, "max_window_layers": 2}),
    ("qwen2_moe", "qwen2_moe", {"sliding_window": W, "use_sliding_window": True, "max_window_layers": 3, **QWEN2_MOE}),
    ("smollm3", "smollm3", {"sliding_window": W, "use_sliding_window": True}),
    ("smollm3-interval", "smollm3", {"sliding_window": W, "use_sliding_window": True, "no_rope_layer_interval": 2}),
    ("mistral", "mistral", {"sliding_window": W}),
    (
        "qwen3_moe",
        "qwen3_moe",
        {"sliding_window": W, "use_sliding_window": True, "num_experts": 4, "moe_intermediate_size": 32, **MOE},
    ),
]


def _config_json(arch: str, fields: dict, layers: int) -> dict:
    """The config as transformers writes it, without layer_types, plus the hand-written fields (some
    config classes consume a pattern field and never write it back)."""
    from transformers import AutoConfig

    full = AutoConfig.for_model(arch, **{**ARCH_BASE, "num_hidden_layers": layers, **fields}).to_dict()
    full.pop("layer_types", None)
    full["architectures"] = []
    return {**full, **fields}


@pytest.mark.parametrize("arch,fields", [d[1:] for d in DERIVED], ids=[d[0] for d in DERIVED])
def test_layer_types_are_derived_as_the_config_class_derives_them(arch, fields):
    from transformers import AutoConfig

    layers = 30 if arch == "qwen2" and "max_window_layers" not in fields else 8  # the default 28 then shows
    theirs = AutoConfig.for_model(arch, **{**ARCH_BASE, "num_hidden_layers": layers, **fields})
    ours = read_model_config(_config_json(arch, fields, layers))
    expected = tuple(
        getattr(theirs, "layer_types", None)
        or (["sliding_attention" if theirs.sliding_window else "full_attention"] * layers)
    )  # qwen3_moe has none
    assert ours.layer_types == expected
    if "sliding_attention" in expected:
        assert ours.sliding_window == W
    assert len(set(expected)) == 2 or arch in ("ministral", "mistral", "qwen3_moe")  # the rule is exercised


NUMERIC = [
    "gemma2",
    "gemma3-pattern",
    "cohere2-pattern",
    "exaone4-default-period",
    "olmo3",
    "gpt_oss",
    "qwen2",
    "qwen2_moe",
    "smollm3-interval",
]


@pytest.mark.parametrize("case", NUMERIC)
def test_derived_layers_match_transformers_numerically(case, tmp_path):
    """4 layers, window 5 over 30 tokens: a layer derived as the wrong kind changes the logits."""
    _, arch, fields = next(d for d in DERIVED if d[0] == case)
    model = build_arch_model(arch, {**fields, "num_hidden_layers": 4})
    assert "sliding_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.layer_types == tuple(model.config.layer_types)
    tokens = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf = model(tokens[None]).logits[0]
    assert scaled(hf, ReferenceDecoder(ckpt).forward(tokens).logits) < TOL


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"sliding_window": W, "sliding_window_pattern": "LLLG"}, "derives the layers only from an integer period"),
        ({"sliding_window": None}, "sliding_attention layers need a 'sliding_window'"),
    ],
)
def test_exaone4_patterns_transformers_cannot_derive_are_refused(fields, message):
    from transformers import AutoConfig

    with pytest.raises((TypeError, ZeroDivisionError)):  # the claim about transformers, checked
        AutoConfig.for_model("exaone4", **{**ARCH_BASE, **fields})
    config = {**_config_json("exaone4", {"sliding_window": W}, 2), **fields}
    with pytest.raises(ConfigError, match=message):
        read_model_config(config)


@pytest.mark.parametrize("arch", ["qwen2", "smollm3"])
def test_sliding_layers_without_use_sliding_window_are_refused(arch):
    """transformers keeps no window then and fails building its cache; ropekv does not guess one."""
    config = {
        **_config_json(arch, {}, 2),
        "sliding_window": W,
        "use_sliding_window": False,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    with pytest.raises(ConfigError, match="use_sliding_window is false"):
        read_model_config(config)


def test_bidirectional_attention_is_refused():
    config = {**_config_json("gemma3_text", {"sliding_window": W}, 2), "use_bidirectional_attention": True}
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        read_model_config(config)
