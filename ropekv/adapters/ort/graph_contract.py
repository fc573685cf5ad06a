"""The cache contract of a built ONNX graph, read from the graph itself.

Per layer, from its ``GroupQueryAttention`` node (:class:`~.graph.GqaLayer`): where the keys are turned
(``do_rotary=1``: inside the kernel, before it writes the cache, ``"kernel_write"``; ``do_rotary=0``
with a ``RotaryEmbedding`` node feeding the key: ``"op"``; neither: no rotation), the channel pairing
(``rotary_interleaved``), the RoPE base and attention factor the ``cos_cache``/``sin_cache``
initializers hold, and the window (``local_window_size``). Where the caches hold exactly what the
model's own RoPE spec gives, the layer keeps that spec; otherwise its base and factor are fitted from
the tables (default scaling), so a graph built with another theta shows as a ``rope.theta`` difference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...contract import CacheContract, RotationSite
from ...errors import ConfigError
from ...models.config import ModelConfig
from ...rope import RopeSpec
from .graph import GqaLayer, initializer

TABLE_TOLERANCE = 1e-4  # float32 cos/sin tables agree with ropekv's float64 ones to ~1e-6


def _producer(model: Any, name: str) -> Any | None:
    return next((n for n in model.graph.node if name in n.output), None)


def _site(model: Any, layer: GqaLayer) -> RotationSite | None:
    if layer.do_rotary:
        return "kernel_write"
    node = _producer(model, layer.key or layer.query)
    return "op" if node is not None and "Rotary" in node.op_type else None


def table_rope(
    cos: np.ndarray, sin: np.ndarray, head_dim: int, model_spec: RopeSpec | None, interleaved: bool
) -> RopeSpec:
    """The RoPE spec a layer's ``cos``/``sin`` tables ``[positions, rd/2]`` hold (module docstring)."""
    layout = "gptj" if interleaved else "neox"
    rotary_dim = 2 * cos.shape[1]
    if model_spec is not None and model_spec.rotary_dim == rotary_dim:
        spec = model_spec.replace(layout=layout)
        n = min(cos.shape[0], 4096)
        c, s = spec.cos_sin(torch.arange(n))  # [n, rd/2] each, float64, scaled by the attention factor
        if max(float(np.abs(cos[:n] - c.numpy()).max()), float(np.abs(sin[:n] - s.numpy()).max())) < TABLE_TOLERANCE:
            return spec
    factor = float(math.hypot(float(cos[1, 0]), float(sin[1, 0])))
    inv_freq = np.arctan2(sin[1].astype(np.float64), cos[1].astype(np.float64))  # angle at position 1
    m = np.arange(1, rotary_dim // 2)
    exponents = 2.0 * m / rotary_dim
    if len(m) == 0 or (inv_freq[m] <= 0).any():
        raise ConfigError("the graph's cos/sin tables hold no RoPE frequencies ropekv can read")
    theta = float(np.exp(-(np.log(inv_freq[m]) * exponents).sum() / (exponents**2).sum()))
    base = model_spec or RopeSpec(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta)
    return RopeSpec(
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        theta=float(f"{theta:.6g}"),
        layout=layout,
        attention_factor=float(f"{factor:.6g}"),
        max_position_embeddings=base.max_position_embeddings,
    )


def graph_contract(
    model: Any, folder: Path, layers: Sequence[GqaLayer], config: ModelConfig, *, weights_fingerprint: str = ""
) -> CacheContract:
    """The contract of the graph ``model`` (built in ``folder``, whose weights are ``config``'s)."""
    if len(layers) != config.num_layers:
        raise ConfigError(f"the graph has {len(layers)} attention layers, the model {config.num_layers}")
    tables: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    ropes: list[RopeSpec | None] = []
    sites: list[RotationSite] = []
    windows = {la.window for la in layers if la.window is not None}
    if len(windows) > 1:
        raise ConfigError(f"the graph's windowed layers keep {sorted(windows)} keys: one contract window only")
    for la in layers:
        site = _site(model, la)
        if site is None:
            ropes.append(None)
            sites.append("op")
            continue
        key = (la.cos_cache, la.sin_cache)
        if key not in tables:
            tables[key] = (initializer(model, la.cos_cache, folder), initializer(model, la.sin_cache, folder))
        cos, sin = tables[key]
        ropes.append(table_rope(cos, sin, config.head_dim, config.layer_rope(la.index), la.interleaved))
        sites.append(site)
    window_layers = tuple(la.index for la in layers if la.window is not None)
    first = next((r for r in ropes if r is not None), config.rope)
    return CacheContract(
        key_form="rotated",
        rope=first,
        layer_ropes=tuple(ropes),
        rotation_sites=tuple(sites),
        num_layers=config.num_layers,
        num_kv_heads=layers[0].kv_num_heads,
        head_dim=config.head_dim,
        window=windows.pop() if windows else None,
        window_layers=window_layers,
        block_size=1,
        weights_fingerprint=weights_fingerprint,
    )
