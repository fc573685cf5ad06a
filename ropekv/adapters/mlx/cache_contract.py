"""The cache contract an mlx-lm model and its prompt cache actually run, read from the loaded objects.

Nothing is taken from ``config.json``: the RoPE of each layer is read from the module mlx-lm calls
(``layers[i].self_attn.rope``), the attention kind of each layer from the cache object that layer
uses (a ``RotatingKVCache(max_size, keep)`` is a window of ``max_size`` keys with ``keep`` sinks, a
``KVCache`` is full attention), the shapes from the attention module and the dtype from the keys
(or, for a reader that has no keys yet, from ``k_proj``'s weight, which is what its keys will be).

mlx-lm's llama-style attention rotates queries and keys at ``cache.offset`` (the logical position)
before ``cache.update_and_fetch``: keys are cached rotated, indexed by logical position. mlx-lm has
no blocks (a ``KVCache`` grows by 256 rows, which is allocation, not addressing): ``block_size`` is 1.

Pure Python apart from attribute reads and one weights digest (no mlx import here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...contract import CacheContract
from ...errors import ConfigError
from ...models.weights import weights_digest
from ...rope import RopeScaling, RopeSpec

# mlx-lm cache classes whose state ropekv reads (and the attention kind each one is).
FULL_CACHES = ("KVCache", "ConcatenateKVCache")
WINDOW_CACHES = ("RotatingKVCache",)
SUPPORTED_CACHES = FULL_CACHES + WINDOW_CACHES
BLOCK_SIZE = 1  # no paging in mlx-lm: every token is its own row
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def layer_rope(rope: Any, *, head_dim: int, max_position_embeddings: int, where: str) -> RopeSpec:
    """The :class:`RopeSpec` of one mlx rope module, from its own attributes.

    - ``mlx.nn.RoPE(dims, traditional, base, scale)``: ``mx.fast.rope`` turns position ``p`` by
      ``p * scale * base^(-2m/dims)``: ``scale == 1`` is the default RoPE, ``scale = 1/f`` linear
      scaling by ``f`` (how mlx-lm's ``initialize_rope`` builds it); ``traditional`` pairs ``2m, 2m+1``.
    - ``DynamicNTKScalingRoPE``: dynamic NTK with its ``base``, ``factor`` and ``max_position_embeddings``.

    Other classes (``Llama3RoPE``, ``YarnRoPE``, ``SuScaledRoPE``, ...) keep only a frequency array;
    they are refused with ConfigError rather than described from the config."""
    kind = type(rope).__name__
    layout = "gptj" if bool(getattr(rope, "traditional", False)) else "neox"
    if kind == "RoPE":
        scale = float(rope.scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ConfigError(f"{where}: mlx RoPE scale {scale!r} is not a positive number")
        scaling = RopeScaling() if scale == 1.0 else RopeScaling("linear", factor=1.0 / scale)
    elif kind == "DynamicNTKScalingRoPE":
        scaling = RopeScaling("dynamic", factor=float(rope.factor))
        max_position_embeddings = int(rope.max_position_embeddings)
    else:
        raise ConfigError(
            f"{where}: mlx rope class {kind} is not read by ropekv's prompt-cache contract "
            "(supported: mlx.nn.RoPE for default and linear scaling, DynamicNTKScalingRoPE)"
        )
    return RopeSpec(
        head_dim=head_dim,
        rotary_dim=int(rope.dims),
        theta=float(rope.base),
        layout=layout,
        scaling=scaling,
        max_position_embeddings=max_position_embeddings,
    )


def model_ropes(model: Any) -> tuple[RopeSpec, ...]:
    """One spec per layer, read from each layer's ``self_attn.rope``."""
    layers = list(model.layers)
    max_pos = getattr(getattr(model, "args", None), "max_position_embeddings", None) or 2048
    return tuple(
        layer_rope(
            layer.self_attn.rope,
            head_dim=int(layer.self_attn.head_dim),
            max_position_embeddings=int(max_pos),
            where=f"layers[{i}].self_attn.rope",
        )
        for i, layer in enumerate(layers)
    )


def model_fingerprint(model: Any) -> str:
    """:func:`~ropekv.models.weights.weights_digest` (first 16 hex digits) of every parameter mlx holds,
    under mlx's names, widened to float32: the same weights give the same fingerprint on both sides of
    a file. RoPE is not in it (the contract compares RoPE field by field)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = {}
    for name, value in tree_flatten(model.parameters()):
        array = value.astype(mx.float32) if value.dtype in (mx.bfloat16, mx.float16) else value
        weights[name] = torch.from_numpy(np.asarray(array))
    return weights_digest(weights)[:16]


def cache_windows(caches: Sequence[Any]) -> tuple[int | None, tuple[int, ...], int]:
    """``(window, window_layers, sink_tokens)`` from the cache objects: each ``RotatingKVCache`` layer is
    a window of ``max_size`` with ``keep`` sinks. Layers with different windows or sinks, and cache
    classes ropekv does not read, are refused (ConfigError)."""
    windows: set[tuple[int, int]] = set()
    layers = []
    for i, c in enumerate(caches):
        kind = type(c).__name__
        if kind in WINDOW_CACHES:
            windows.add((int(c.max_size), int(c.keep)))
            layers.append(i)
        elif kind not in FULL_CACHES:
            raise ConfigError(
                f"layer {i}: mlx-lm cache class {kind} is not supported by the prompt-cache contract "
                f"(supported: {', '.join(SUPPORTED_CACHES)})"
            )
    if len(windows) > 1:
        raise ConfigError(f"the caches' windows differ between layers ({sorted(windows)}): one window is supported")
    if not windows:
        return None, (), 0
    ((size, keep),) = windows
    return size, tuple(layers), keep


def dtype_name(dtype: Any, where: str) -> str:
    """``mx.float32`` -> ``"float32"`` (the names of ropekv.contract.DTYPES)."""
    name = str(dtype).rsplit(".", 1)[-1]
    if name not in _DTYPES:
        raise ConfigError(f"{where}: dtype {dtype} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def mlx_contract(model: Any, caches: Sequence[Any], *, dtype: str, fingerprint: str) -> CacheContract:
    """The contract of ``caches`` (one per layer) used with ``model``: RoPE from the modules, windows
    from the cache objects, shapes from the attention modules."""
    ropes = model_ropes(model)
    if len(caches) != len(ropes):
        raise ConfigError(f"{len(caches)} cache(s) for a model of {len(ropes)} layers")
    attn = model.layers[0].self_attn
    window, window_layers, sinks = cache_windows(caches)
    return CacheContract(
        key_form="rotated",
        rotation_index="logical",
        rope=ropes[0],
        layer_ropes=ropes,  # normalized to None when every layer turns alike
        window=window,
        window_layers=window_layers,
        sink_tokens=sinks,
        block_size=BLOCK_SIZE,
        dtype=dtype,
        num_layers=len(ropes),
        num_kv_heads=int(attn.n_kv_heads),
        head_dim=int(attn.head_dim),
        weights_fingerprint=fingerprint,
    )


def model_dtype(model: Any) -> str:
    """The dtype the model's keys are computed in: its first layer's ``k_proj`` weight."""
    return dtype_name(model.layers[0].self_attn.k_proj.weight.dtype, "layers[0].self_attn.k_proj.weight")
