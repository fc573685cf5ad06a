"""Tiny random checkpoints of any transformers architecture, for fast tests.

Built by transformers itself from a config (``AutoConfig.for_model(arch, ...)``), with weights
re-drawn from a seeded generator at unit scale: HF's own init (std 0.02, ones for norms, zeros for
biases) makes logits tiny and hides bugs in norms and biases. Nothing is downloaded.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..models.config import Checkpoint
from ..models.hf_config import read_model_config

TINY_BASE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale random weights: embeddings N(0,1), linears N(0, 1/fan_in), norms 1 + N(0, 0.2^2),
    biases N(0, 0.3^2), router correction biases N(0, 0.1^2). Deterministic in ``seed`` whatever transformers' own init did."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * noise
            elif name.endswith(".bias"):
                value = 0.3 * noise
            elif "embed_tokens" in name:
                value = noise
            else:
                value = noise / param.shape[-1] ** 0.5
            param.copy_(value)
        # Routers' score-correction biases (deepseek_v3, glm4_moe) are buffers: N(0, 0.1^2) so routing
        # depends on them (drawn after every parameter: other models' weights stay as they were).
        for name, buf in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen, dtype=torch.float32))


def tiny_model(arch: str = "llama", **overrides: Any) -> torch.nn.Module:
    """A transformers ``*ForCausalLM`` of ``arch`` with :data:`TINY_BASE` sizes (``overrides`` win),
    float32, eager attention, eval mode, seeded by its arguments."""
    try:
        import transformers
    except ImportError:
        raise UsageError("tiny checkpoints need transformers: pip install 'ropekv[hf]'") from None
    kwargs = {**TINY_BASE, **overrides}
    seed = zlib.crc32(json.dumps([arch, kwargs], sort_keys=True, default=str).encode())
    try:
        config = transformers.AutoConfig.for_model(arch, **kwargs)
    except ValueError as exc:
        raise UsageError(f"unknown transformers architecture {arch!r}: {exc}") from None
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize(model, seed)
    return model.eval()


def tiny_checkpoint(arch: str = "llama", *, save_to: str | Path | None = None, **overrides: Any) -> Checkpoint | Path:
    """A tiny random checkpoint: in memory as a :class:`Checkpoint` (default), or saved with
    transformers' ``save_pretrained`` (config.json + model.safetensors) to ``save_to``, returning the path."""
    model: Any = tiny_model(arch, **overrides)  # a transformers PreTrainedModel
    if save_to is not None:
        path = Path(save_to)
        model.save_pretrained(path)
        return path
    return Checkpoint.from_tensors(
        read_model_config(model.config.to_dict(), source=f"tiny {arch}"), model.state_dict(), source=f"tiny {arch}"
    )
