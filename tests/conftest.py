"""Shared fixtures: tiny random transformers checkpoints on disk, and transformers models to compare with.

Each checkpoint is written by transformers' own ``save_pretrained`` (config.json + model.safetensors),
so the loaders are tested on exactly what users have. Weights are re-drawn from a seeded generator
at unit scale (HF's init uses std 0.02, ones for norms and zeros for biases, which makes logits tiny
and hides bugs in norms and biases); every tensor, norm weights and biases included, is random.

Fixtures:
- ``tiny_llama_dir``, ``tiny_mistral_dir`` (sliding_window=5), ``tiny_qwen2_dir`` (q/k/v biases),
  ``tiny_qwen3_dir`` (q_norm/k_norm, head_dim * heads != hidden): paths to checkpoint directories.
- ``make_tiny_checkpoint(arch, **config_overrides) -> Path``: the same, for variants (cached by
  arguments), e.g. ``make_tiny_checkpoint("llama", rope_parameters={"rope_type": "dynamic", ...})``.
- ``hf_model(path)``: the transformers model of a checkpoint directory, float32, eager attention,
  eval mode (cached; do not modify it).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ropekv import user_code
from ropekv.testing.tiny import TINY_BASE, randomize

TINY_ARCH: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 5},
    "qwen2": {},
    "qwen3": {"hidden_size": 48},  # 4 heads x 16 != 48: q/o projections are not square
}
MISTRAL_WINDOW = TINY_ARCH["mistral"]["sliding_window"]


def _config_class(arch: str) -> type:
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]


def _make(root: Path, arch: str, overrides: dict[str, Any]) -> Path:
    from transformers import AutoModelForCausalLM

    kwargs = {**TINY_BASE, **TINY_ARCH[arch], **overrides}
    key = json.dumps([arch, kwargs], sort_keys=True, default=str)
    seed = zlib.crc32(key.encode())
    config = _config_class(arch)(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize(model, seed)
    path = root / f"{arch}-{seed:08x}"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def make_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``make_tiny_checkpoint(arch, **config_overrides) -> Path`` (cached by arguments)."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    cache: dict[str, Path] = {}

    def make(arch: str, **config_overrides: Any) -> Path:
        if arch not in TINY_ARCH:
            raise ValueError(f"unknown tiny architecture {arch!r}; have {sorted(TINY_ARCH)}")
        key = json.dumps([arch, config_overrides], sort_keys=True, default=str)
        if key not in cache:
            cache[key] = _make(root, arch, config_overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_checkpoint: Callable[..., Path]) -> Path:
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_mistral_dir(make_tiny_checkpoint: Callable[..., Path]) -> Path:
    return make_tiny_checkpoint("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(make_tiny_checkpoint: Callable[..., Path]) -> Path:
    return make_tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(make_tiny_checkpoint: Callable[..., Path]) -> Path:
    return make_tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], torch.nn.Module]:
    """``hf_model(path)``: transformers' model of a checkpoint dir (float32, eager attention, eval)."""
    cache: dict[Path, torch.nn.Module] = {}

    def load(path: Path) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        path = Path(path)
        if path not in cache:
            multimodal = json.loads((path / "config.json").read_text()).get("model_type") in MULTIMODAL
            auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
            model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
            cache[path] = model.eval()
        return cache[path]

    return load


# ---------------------------------------------------------------------- every described architecture

ARCH_BASE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def arch_kwargs(arch: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``ARCH_BASE`` with ``overrides`` for ``model_type`` ``arch``, less the fields its config class
    derives and cannot set (falcon's ``head_dim`` property)."""
    from transformers import CONFIG_MAPPING

    kwargs = {**ARCH_BASE, **overrides}
    if isinstance(getattr(CONFIG_MAPPING[arch], "head_dim", None), property):
        kwargs.pop("head_dim")
    return kwargs


# Multimodal architectures checked as their text model: the text fields go to text_config, a tiny
# vision tower keeps the checkpoint whole (ropekv drops it), the model class is the image-text one.
MULTIMODAL = {"qwen2_vl", "qwen2_5_vl"}
TINY_VISION: dict[str, dict[str, Any]] = {
    "qwen2_vl": dict(
        depth=1,
        embed_dim=16,
        hidden_size=64,
        num_heads=2,
        mlp_ratio=2,
        patch_size=2,
        spatial_merge_size=1,
        temporal_patch_size=1,
    ),
    "qwen2_5_vl": dict(
        depth=1,
        hidden_size=16,
        out_hidden_size=64,
        intermediate_size=32,
        num_heads=2,
        patch_size=2,
        spatial_merge_size=1,
        temporal_patch_size=1,
        window_size=4,
        fullatt_block_indexes=[0],
    ),
}


def build_arch_model(arch: str, overrides: dict[str, Any]) -> torch.nn.Module:
    """A tiny random transformers model of ``model_type`` ``arch`` (seeded by its arguments), eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    key = json.dumps([arch, overrides], sort_keys=True, default=str)
    seed = zlib.crc32(key.encode())
    fields = arch_kwargs(arch, overrides)
    if arch in MULTIMODAL:
        top = {k: fields.pop(k) for k in ("tie_word_embeddings",) if k in fields}
        config = AutoConfig.for_model(
            arch,
            text_config=fields,
            vision_config=TINY_VISION[arch],
            **top,
            image_token_id=93,
            video_token_id=94,
            vision_start_token_id=95,
        )
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="eager")
        randomize(model, seed)
        return model.eval()
    config = AutoConfig.for_model(arch, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize(model, seed)
    return model.eval()


@pytest.fixture(scope="session")
def make_arch_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``make_arch_checkpoint(model_type, **config_overrides) -> Path`` for any transformers
    architecture (``AutoConfig.for_model``), saved by ``save_pretrained``; cached by arguments."""
    root = tmp_path_factory.mktemp("arch_checkpoints")
    cache: dict[str, Path] = {}

    def make(arch: str, **overrides: Any) -> Path:
        key = json.dumps([arch, overrides], sort_keys=True, default=str)
        if key not in cache:
            path = root / f"{arch}-{zlib.crc32(key.encode()):08x}"
            build_arch_model(arch, overrides).save_pretrained(path)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(autouse=True)
def _no_user_code_carried_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that imports adapter code (``--engine file.py:Class``) marks the process
    (:mod:`ropekv.user_code`); each test starts unmarked, as a fresh ``ropekv`` process does."""
    monkeypatch.setattr(user_code, "_loaded", [])
