"""config.json read as transformers 5 reads it: what it refuses is refused, what it ignores is a warning.

Each case is checked against transformers itself (``AutoConfig.from_pretrained`` / the model it builds)
on the same file, so the expectation is transformers' behaviour, not ropekv's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import ARCH_BASE

from ropekv.errors import ConfigError
from ropekv.models import load_checkpoint, load_config
from ropekv.models.reference import ReferenceDecoder


def _edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_model_type_chooses_the_architecture_not_architectures(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = _edited(tiny_llama_dir, tmp_path / "ck", model_type="qwen2", architectures=["LlamaForCausalLM"])
    assert type(transformers.AutoConfig.from_pretrained(path)).__name__ == "Qwen2Config"
    config = load_config(path)
    assert config.architecture == "qwen2"
    assert any("LlamaForCausalLM" in w and "model_type 'qwen2'" in w for w in config.warnings), config.warnings


@pytest.mark.parametrize("act", [0, [], {}, None])
def test_an_activation_that_is_not_a_string_is_refused(tiny_llama_dir: Path, tmp_path: Path, act) -> None:
    path = _edited(tiny_llama_dir, tmp_path / "ck", hidden_act=act)
    with pytest.raises(Exception, match="hidden_act"):  # transformers: StrictDataclassFieldValidationError
        transformers.AutoConfig.from_pretrained(path)
    with pytest.raises(ConfigError, match=r"field 'hidden_act' must be a string naming an activation"):
        load_config(path)


@pytest.mark.parametrize("factor", ["x", -1, [], 2.0])
def test_a_parameter_the_default_rope_never_reads_is_ignored_with_a_warning(
    tiny_llama_dir: Path, tmp_path: Path, factor
) -> None:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "factor": factor}
    path = _edited(tiny_llama_dir, tmp_path / "ck", rope_parameters=rope)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # accepted there
    ckpt = load_checkpoint(path)
    assert ckpt.config.rope.scaling.rope_type == "default" and ckpt.config.rope.scaling.factor is None
    assert any(w.startswith(f"RoPE parameter factor={factor!r} is ignored") for w in ckpt.config.warnings)
    tokens = torch.arange(1, 12)
    with torch.no_grad():
        theirs = model(tokens[None]).logits[0]
    ours = ReferenceDecoder(ckpt).forward(tokens).logits
    assert (ours - theirs.double()).abs().max() < 1e-4  # the factor is ignored on both sides


def test_gemma_legacy_gelu_is_read_as_its_tanh_approximation(tmp_path: Path) -> None:
    """GemmaConfig rewrites hidden_act "gelu" to "gelu_pytorch_tanh"; exact GELU would misread it."""
    from conftest import build_arch_model

    build_arch_model("gemma", {}).save_pretrained(tmp_path / "saved")
    path = _edited(tmp_path / "saved", tmp_path / "ck", hidden_act="gelu")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.hidden_act == "gelu_pytorch_tanh"
    ckpt = load_checkpoint(path)
    assert ckpt.config.hidden_act == "gelu_pytorch_tanh" and any("gelu" in w for w in ckpt.config.warnings)
    tokens = torch.arange(1, 12)
    with torch.no_grad():
        theirs = model(tokens[None]).logits[0]
    ours = ReferenceDecoder(ckpt).forward(tokens).logits
    assert (ours - theirs.double()).abs().max() / max(1.0, theirs.abs().max().item()) < 1e-5


@pytest.mark.parametrize(
    "model_type,arch,what",
    [
        ("gpt2", "GPT2LMHeadModel", "learned absolute position embeddings"),
        ("bloom", "BloomForCausalLM", "ALiBi"),
        ("mamba", "MambaForCausalLM", "no attention"),
    ],
)
def test_architectures_without_rope_are_refused_saying_so(tmp_path: Path, model_type, arch, what) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch], **ARCH_BASE}))
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    message = str(info.value)
    assert "has no RoPE" in message and what in message and arch in message and "\n" not in message
