"""Qwen2-VL's multimodal RoPE (mRoPE) on text: three position streams (temporal, height, width) turn
consecutive sections of the frequency pairs. For text all three are the token's position, so the
rotation is the plain RoPE of the same spec -- checked here against transformers' own rotary module,
not assumed. The contract records the sections, so a plain-RoPE reader is not compatible with keys an
mRoPE model wrote (they could hold image tokens, whose streams differ)."""

from __future__ import annotations

import json

import pytest
import torch

from ropekv.contract import CacheContract
from ropekv.errors import ConfigError, ContractMismatch
from ropekv.models import load_checkpoint
from ropekv.models.hf_config import read_model_config
from ropekv.rope import RopeSpec

SECTIONS = [2, 3, 3]  # 8 frequency pairs of a 16-wide head
MROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": SECTIONS}


def _hf_cos_sin(arch: str, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary module of ``arch``'s text model at ``streams [3, n]`` -> cos, sin ``[n, 16]``."""
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    text = AutoConfig.for_model(
        arch,
        text_config=dict(hidden_size=64, num_attention_heads=4, rope_parameters=MROPE, max_position_embeddings=256),
    ).text_config
    module = {
        "qwen2_vl": modeling_qwen2_vl.Qwen2VLRotaryEmbedding,
        "qwen2_5_vl": modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding,
    }[arch](text)
    cos, sin = module(torch.zeros(1, dtype=torch.float32), streams[:, None, :])
    return cos[0].double(), sin[0].double()


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_text_positions_make_mrope_the_plain_rope(arch):
    positions = torch.tensor([0, 1, 7, 8, 29, 200])
    spec = RopeSpec(head_dim=16, rotary_dim=16, theta=1e4, max_position_embeddings=256, mrope_section=(2, 3, 3))
    cos, sin = spec.cos_sin(positions)  # [n, 8] float64
    hf_cos, hf_sin = _hf_cos_sin(arch, positions.expand(3, -1))  # t = h = w = the token's position
    assert torch.allclose(hf_cos, torch.cat([cos, cos], -1), atol=1e-6)  # neox layout: pairs (m, m + 8)
    assert torch.allclose(hf_sin, torch.cat([sin, sin], -1), atol=1e-6)
    # The claim needs the streams to coincide: an image token's height stream moves its section only.
    moved = positions.expand(3, -1).clone()
    moved[1] += 5
    img_cos, _ = _hf_cos_sin(arch, moved)
    height = slice(2, 5)  # section 1 (3 pairs after the temporal section's 2)
    assert not torch.allclose(img_cos[1:, height], hf_cos[1:, height], atol=1e-3)
    others = [0, 1, 5, 6, 7]
    assert torch.allclose(img_cos[:, others], hf_cos[:, others])


def test_sections_are_read_recorded_and_compared(make_arch_checkpoint):
    ckpt = load_checkpoint(make_arch_checkpoint("qwen2_vl", rope_parameters=MROPE))
    cfg = ckpt.config
    assert cfg.rope.mrope_section == (2, 3, 3) and cfg.head_dim == 16
    assert not any(k.startswith(("visual.", "model.visual.")) for k in ckpt.weights)  # the vision tower: dropped
    assert any("vision_config is not checked" in w for w in cfg.warnings)
    mrope = CacheContract.for_model(cfg, key_form="rotated")
    data = json.loads(mrope.to_json())
    assert data["rope"]["mrope_section"] == [2, 3, 3] and data["version"] == 5
    assert CacheContract.from_json(mrope.to_json()) == mrope
    plain = mrope.replace(rope=cfg.rope.replace(mrope_section=None))
    assert "mrope_section" not in json.loads(plain.to_json())["rope"]  # plain specs are written as before
    with pytest.raises(ContractMismatch) as info:
        plain.require_compatible(mrope)  # a text-only reader of keys an mRoPE model wrote
    assert info.value.fields == ("rope.mrope_section",)
    assert "the same only while all three streams are the token's position" in str(info.value)


def test_bad_sections_are_refused_as_transformers_fails_on_them(make_arch_checkpoint):
    config = json.loads((make_arch_checkpoint("qwen2_vl", rope_parameters=MROPE) / "config.json").read_text())
    config["text_config"]["rope_parameters"] = {**MROPE, "mrope_section": [2, 3, 4]}
    with pytest.raises(ConfigError, match=r"mrope_section must be positive integers summing to rotary_dim/2 = 8"):
        read_model_config(config)
    with pytest.raises(RuntimeError):  # the claim about transformers, checked: the sections must cover the pairs
        _hf_cos_sin_with(config["text_config"]["rope_parameters"])
    del config["text_config"]["rope_parameters"]["mrope_section"]  # transformers' default [16, 24, 24]: head 128
    with pytest.raises(ConfigError, match="summing to rotary_dim/2 = 8"):
        read_model_config(config)


def _hf_cos_sin_with(rope_parameters):
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    text = AutoConfig.for_model(
        "qwen2_vl", text_config=dict(hidden_size=64, num_attention_heads=4, rope_parameters=rope_parameters)
    ).text_config
    return Qwen2VLRotaryEmbedding(text)(torch.zeros(1), torch.arange(4).expand(3, 1, -1))


def test_legacy_mrope_type_and_mrope_on_other_architectures(make_arch_checkpoint):
    config = json.loads((make_arch_checkpoint("qwen2_vl", rope_parameters=MROPE) / "config.json").read_text())
    config["text_config"]["rope_parameters"] = {"type": "mrope", "rope_theta": 1e4, "mrope_section": SECTIONS}
    assert read_model_config(config).rope.mrope_section == (2, 3, 3)
    llama = json.loads((make_arch_checkpoint("llama") / "config.json").read_text())
    llama["rope_parameters"] = MROPE  # llama's RoPE has no streams: refused, not read as plain RoPE silently
    with pytest.raises(ConfigError, match="unknown RoPE parameter"):
        read_model_config(llama)
