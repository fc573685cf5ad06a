"""One checkpoint, one fingerprint (ropekv.models.config.fingerprint_of, ropekv.models.weights).

Contracts compare model fingerprints, so two loaders of the same weights that disagree would refuse a
valid handoff between engines. Every path to one saved checkpoint must give the same fingerprint:
ropekv's safetensors loader, transformers' model of it (``HFEngine.load`` / ``HFEngine(model)``),
relative and absolute paths, a copy in another folder; and different weights or a config that
computes differently must give another one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import build_arch_model
from test_architectures import VARIANTS

from ropekv.adapters.hf import HFEngine
from ropekv.models import load_checkpoint
from ropekv.models.config import Checkpoint
from ropekv.models.families import FAMILIES
from ropekv.models.hf_config import read_model_config


def _hf_checkpoint(model: torch.nn.Module) -> Checkpoint:
    """What ``HFEngine(model).checkpoint`` builds (falcon, which HFEngine refuses, included)."""
    if FAMILIES[read_model_config(model.config.to_dict()).architecture].hf.attention_inline:
        return Checkpoint.from_tensors(read_model_config(model.config.to_dict()), model.state_dict())
    return HFEngine(model).checkpoint


@pytest.mark.parametrize("arch,overrides", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_every_path_to_a_checkpoint_gives_one_fingerprint(arch, overrides, tmp_path: Path) -> None:
    model = build_arch_model(arch, overrides)
    model.save_pretrained(tmp_path / "saved")
    shutil.copytree(tmp_path / "saved", tmp_path / "elsewhere" / "copy")
    ours = load_checkpoint(tmp_path / "saved").fingerprint
    assert load_checkpoint(tmp_path / "elsewhere" / "copy").fingerprint == ours
    assert _hf_checkpoint(model).fingerprint == ours  # the model in memory, never loaded from a path
    loaded = transformers.AutoModelForImageTextToText if "vision_config" in model.config.to_dict() else None
    auto = loaded or transformers.AutoModelForCausalLM
    for path in (tmp_path / "saved", tmp_path / "elsewhere" / "copy"):
        again = auto.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        assert again.config.to_dict()["_name_or_path"] == str(path)  # the path is in the config...
        assert _hf_checkpoint(again).fingerprint == ours  # ...and not in the fingerprint


def test_hf_engine_load_relative_and_absolute(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absolute = HFEngine.load(tiny_llama_dir).checkpoint.fingerprint
    monkeypatch.chdir(tiny_llama_dir.parent)
    relative = HFEngine.load(tiny_llama_dir.name).checkpoint.fingerprint
    assert relative == absolute == load_checkpoint(tiny_llama_dir.name).fingerprint
    assert os.path.isabs(str(tiny_llama_dir))


def test_other_weights_or_semantics_give_another_fingerprint(tiny_llama_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_llama_dir)
    weights = dict(ckpt.weights)
    name = "model.layers.0.self_attn.k_proj.weight"
    changed = weights[name].clone()
    changed[0, 0] = torch.nextafter(changed[0, 0], torch.tensor(float("inf")))  # one ulp
    weights[name] = changed
    assert Checkpoint.from_tensors(ckpt.config, weights).fingerprint != ckpt.fingerprint
    assert Checkpoint.from_tensors(ckpt.config, ckpt.weights).fingerprint == ckpt.fingerprint
    renamed = ckpt.config.replace(name="another label")
    assert Checkpoint.from_tensors(renamed, ckpt.weights).fingerprint == ckpt.fingerprint
    other_eps = ckpt.config.replace(rms_norm_eps=ckpt.config.rms_norm_eps * 2)
    assert Checkpoint.from_tensors(other_eps, ckpt.weights).fingerprint != ckpt.fingerprint
    other_theta = ckpt.config.replace(rope=ckpt.config.rope.replace(theta=ckpt.config.rope.theta * 2))
    assert Checkpoint.from_tensors(other_theta, ckpt.weights).fingerprint != ckpt.fingerprint
