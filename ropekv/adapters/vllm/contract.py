"""The cache contract vLLM actually runs, read from the loaded model object, and its field-by-field
comparison with the checkpoint's :class:`~ropekv.rope.RopeSpec`.

vLLM builds its rotary module from ``config.json`` itself (``get_rope``), so what it runs can differ
from what ropekv reads out of the same file: another base, a scaling type it maps differently, a
cos/sin table in low precision. Nothing here is taken from the config: every value is an attribute
of the module vLLM calls (``layers[i].self_attn.rotary_emb``) or of the engine's own configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ...contract import FieldDiff
from ...rope import RopeSpec

# vLLM rotary classes -> the HF rope_type they implement (vllm/model_executor/layers/rotary_embedding).
ROPE_CLASSES = {
    "RotaryEmbedding": "default",
    "LinearScalingRotaryEmbedding": "linear",
    "DynamicNTKScalingRotaryEmbedding": "dynamic",
    "YaRNScalingRotaryEmbedding": "yarn",
    "Llama3RotaryEmbedding": "llama3",
    "Phi3LongRoPEScaledRotaryEmbedding": "longrope",
}


@dataclass(frozen=True)
class VLLMContract:
    """What vLLM runs. ``cos_sin_max_error`` is the largest difference between vLLM's cos/sin table
    (the buffer its kernels index by position) and ropekv's float64 cos/sin for the same positions."""

    rope_class: str
    rope_type: str | None  # None: a class ropekv does not map
    theta: float
    head_dim: int
    rotary_dim: int
    layout: str  # "neox" (is_neox_style) or "gptj"
    scaling_factor: float | None
    max_position_embeddings: int
    cos_sin_dtype: str
    cos_sin_positions: int  # rows in the table
    cos_sin_max_error: float | None  # None where the spec is length dependent (no single table)
    same_module_all_layers: bool
    block_size: int
    dtype: str
    kv_cache_dtype: str
    attention_backend: str
    kernel_isa: str
    key_form: str = "rotated"  # the model rotates q/k before Attention writes the cache
    cos_sin_table: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [positions, rotary_dim]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cos_sin_table"}

    def diff(self, spec: RopeSpec, *, tolerance: float) -> tuple[FieldDiff, ...]:
        """Fields where vLLM runs something else than ``spec``, each a :class:`~ropekv.contract.FieldDiff`
        with ``ours`` = what vLLM runs, ``theirs`` = the checkpoint's; ``tolerance`` bounds the cos/sin
        table error that counts as the same table (its dtype's rounding)."""
        out = []
        want = {
            "rope_type": spec.scaling.rope_type,
            "theta": float(spec.theta),
            "head_dim": spec.head_dim,
            "rotary_dim": spec.rotary_dim,
            "layout": spec.layout,
        }
        for name, value in want.items():
            got = getattr(self, name)
            if got != value:
                out.append(FieldDiff(name, got, value))
        if spec.scaling.factor is not None and self.scaling_factor != spec.scaling.factor:
            out.append(FieldDiff("scaling.factor", self.scaling_factor, spec.scaling.factor))
        error = table_error(self.cos_sin_table, spec)
        if error is not None and error > tolerance:
            out.append(
                FieldDiff(
                    "cos_sin_cache", f"max error {error:.3g}", f"within {tolerance:.3g} of ropekv's float64 table"
                )
            )
        if not self.same_module_all_layers:
            out.append(FieldDiff("rotary module", "differs between layers", "one rotation for every layer"))
        return tuple(out)


def read_contract(
    model: Any, spec: RopeSpec, *, block_size: int, dtype: torch.dtype, kv_cache_dtype: str
) -> VLLMContract:
    """Read the contract from vLLM's loaded ``model`` (a ``*ForCausalLM`` with ``model.layers``; ``Any``:
    its attributes are vLLM's)."""
    layers = list(model.model.layers)
    attn0 = layers[0].self_attn
    rope = attn0.rotary_emb
    same = all(
        getattr(block.self_attn, "rotary_emb", None) is rope or _same_rope(block.self_attn.rotary_emb, rope)
        for block in layers
    )
    return rotary_contract(
        rope,
        spec,
        same_module_all_layers=same,
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        attention=attn0.attn,
    )


def rotary_contract(
    rope: Any,
    spec: RopeSpec,
    *,
    same_module_all_layers: bool,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    attention: Any,
) -> VLLMContract:
    """The contract of one rotary module vLLM built (``rope``, vLLM's ``RotaryEmbedding``: ``Any``, its
    attributes are vLLM's) and one of its ``Attention`` layers."""
    cls = type(rope).__name__
    table = getattr(rope, "cos_sin_cache", None)  # [max_positions, rotary_dim]: cos | sin halves
    table = None if table is None else table.detach().clone()
    return VLLMContract(
        rope_class=cls,
        rope_type=ROPE_CLASSES.get(cls),
        theta=float(rope.base),
        head_dim=int(rope.head_size),
        rotary_dim=int(rope.rotary_dim),
        layout="neox" if rope.is_neox_style else "gptj",
        scaling_factor=_scaling_factor(rope),
        max_position_embeddings=int(rope.max_position_embeddings),
        cos_sin_dtype=str(table.dtype).removeprefix("torch.") if table is not None else "none",
        cos_sin_positions=int(table.shape[0]) if table is not None else 0,
        cos_sin_max_error=table_error(table, spec),
        cos_sin_table=table,
        same_module_all_layers=same_module_all_layers,
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=kv_cache_dtype,
        attention_backend=type(attention.impl).__name__,
        kernel_isa=str(getattr(attention, "isa", "unknown")),
    )


def table_error(table: torch.Tensor | None, spec: RopeSpec) -> float | None:
    """Largest difference between vLLM's ``cos | sin`` table ``[n, rotary_dim]`` and ropekv's float64
    cos/sin under ``spec`` at positions ``0..n-1``; None where there is no single table."""
    if table is None or spec.length_dependent:
        return None
    cos, sin = spec.cos_sin(torch.arange(table.shape[0]))  # float64 [n, rotary_dim / 2]
    ours = torch.cat((cos, sin), dim=-1)
    return float((table.double() - ours).abs().max()) if table.shape == ours.shape else float("inf")


def _scaling_factor(rope: torch.nn.Module) -> float | None:
    factor = getattr(rope, "scaling_factor", None)
    if factor is None:
        factors = getattr(rope, "scaling_factors", None)  # linear scaling keeps a list
        factor = factors[0] if factors else None
    return None if factor is None else float(factor)


def _same_rope(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    ta, tb = getattr(a, "cos_sin_cache", None), getattr(b, "cos_sin_cache", None)
    return (
        type(a) is type(b)
        and a.base == b.base
        and a.rotary_dim == b.rotary_dim
        and ta is not None
        and tb is not None
        and ta.shape == tb.shape
        and bool(torch.equal(ta, tb))
    )
