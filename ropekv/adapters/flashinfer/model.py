"""The llama block around FlashInfer's attention in the GPU check, in plain torch (float32 arithmetic).

The check's engine is this block with FlashInfer's paged decode as its attention: RMSNorm, the q/k/v
projections, attention, ``o_proj``, RMSNorm, the SiLU MLP, as transformers' ``LlamaDecoderLayer``
computes them. It imports nothing of ropekv's models or engine (the device gets only torch and the
weights the bundle carries); :func:`rotate` is the engine's own RoPE op, used where keys are written
rotated and where the kernel is asked not to rotate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...errors import CheckpointError

_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True)
class Shapes:
    """The numbers the block needs (from the bundle's metadata)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float

    def to_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


class LlamaLayers:
    """The first ``shapes.num_layers`` llama blocks, weights cast to float32 on ``device``."""

    def __init__(self, weights: Mapping[str, torch.Tensor], shapes: Shapes, device: str | torch.device):
        self.shapes = shapes
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(shapes.num_layers):
            layer = {}
            for part in _PROJ + _MLP + _NORMS:
                name = f"model.layers.{i}.{part}.weight"
                if name not in weights:
                    raise CheckpointError(f"the FlashInfer bundle lacks {name}")
                layer[part] = weights[name].to(device=device, dtype=torch.float32)
            self.layers.append(layer)
        d = shapes.head_dim
        inv = 1.0 / (shapes.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self._inv_freq = inv.to(device)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.shapes.rms_norm_eps) * w

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h [T, hidden]`` -> raw (pre-RoPE) ``q [T, H, D]``, ``k``, ``v [T, KVH, D]``, float32."""
        w, s = self.layers[layer], self.shapes
        x = self.norm(h, w["input_layernorm"])
        q = (x @ w["self_attn.q_proj"].T).view(-1, s.num_heads, s.head_dim)
        k = (x @ w["self_attn.k_proj"].T).view(-1, s.num_kv_heads, s.head_dim)
        v = (x @ w["self_attn.v_proj"].T).view(-1, s.num_kv_heads, s.head_dim)
        return q, k, v

    def finish(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of the block after attention: ``h [T, hidden]``, ``attn [T, H, D]`` -> the next layer's input."""
        w = self.layers[layer]
        h = h + attn.float().reshape(h.shape[0], -1) @ w["self_attn.o_proj"].T
        x = self.norm(h, w["post_attention_layernorm"])
        gate = torch.nn.functional.silu(x @ w["mlp.gate_proj"].T)
        return h + (gate * (x @ w["mlp.up_proj"].T)) @ w["mlp.down_proj"].T

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The engine's RoPE op: rotate-half RoPE of ``x [T, heads, D]`` at ``positions [T]`` (angles in
        float64, the product in float32)."""
        angle = positions.to(self._inv_freq.device, torch.float64)[:, None] * self._inv_freq  # [T, D/2]
        cos = torch.cat([angle.cos(), angle.cos()], -1).float()[:, None, :]
        sin = torch.cat([angle.sin(), angle.sin()], -1).float()[:, None, :]
        half = x.shape[-1] // 2
        partner = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + partner * sin
