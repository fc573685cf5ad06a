"""The ordered registry of bug classes (what a check's diagnosis tries, first to last) and of every
catalogued fault.

Specific classes come before the generic ones they would otherwise be read as: the adapter's record
before the engine; masks before rotations; per-layer RoPE features, length-dependent RoPE and index
widths before plain positions; a case operation's bugs before the position patterns they resemble; a
handoff's before double rotation; position offsets last. Where two classes account for a case alike,
the earlier one is named (:mod:`ropekv.parity.explain.combine`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType, ModuleType
from typing import TypeVar

from ..errors import ConfigError, UsageError
from ..faults import mlx, ort, vllm, vllm_transfer
from ..faults.handoff import HandoffFault
from ..faults.mlx import MlxFault
from ..faults.native import NativeFault, OpFault
from ..faults.record import Fault, FaultEngine
from ..faults.vllm import VLLMFault
from ..faults.vllm_transfer import TransferFault
from ..parity.explain.evidence import Explanation
from . import (
    block_layout_mismatch,
    block_local_position,
    block_seam,
    chunk_mismatch,
    double_rotation,
    evict_offset,
    frequency_mismatch,
    ignored_prefix_offset,
    key_position_offset,
    kv_scale_mismatch,
    layer_rope_mismatch,
    layout_mismatch,
    low_precision_angles,
    mislabelled_keys,
    missing_rotation,
    mixed_rotations,
    mla_rope_rotated_twice,
    mrope_axes_collapsed,
    nope_rotated,
    padding_offset,
    partial_rotary_mismatch,
    position_wrapped,
    prefill_rows_diverged,
    query_position_offset,
    restore_offset_lost,
    rollback_offset,
    rollback_stale_keys,
    rope_magnitude,
    rotate_on_transfer,
    shift_applied_twice,
    shift_not_rotated,
    shift_rotated_raw,
    slot_as_position,
    spec_verify_position_offset,
    stale_dynamic_scaling,
    value_mismatch,
    window_mismatch,
)

MODULES: tuple[ModuleType, ...] = (
    mislabelled_keys,
    window_mismatch,
    chunk_mismatch,
    block_layout_mismatch,
    mrope_axes_collapsed,
    nope_rotated,
    partial_rotary_mismatch,
    mla_rope_rotated_twice,
    layer_rope_mismatch,
    mixed_rotations,
    stale_dynamic_scaling,
    position_wrapped,
    rollback_stale_keys,
    rollback_offset,
    evict_offset,
    shift_not_rotated,
    shift_rotated_raw,
    shift_applied_twice,
    padding_offset,
    restore_offset_lost,
    spec_verify_position_offset,
    block_seam,
    rotate_on_transfer,
    double_rotation,
    missing_rotation,
    slot_as_position,
    ignored_prefix_offset,
    block_local_position,
    low_precision_angles,
    layout_mismatch,
    frequency_mismatch,
    kv_scale_mismatch,
    rope_magnitude,
    value_mismatch,
    prefill_rows_diverged,
    query_position_offset,
    key_position_offset,
)

EXPLANATIONS: tuple[Explanation, ...] = tuple(m.EXPLANATION for m in MODULES)

F = TypeVar("F", bound=Fault)


def _by_name(faults: Iterable[F]) -> Mapping[str, F]:
    out: dict[str, F] = {}
    for f in faults:
        if f.name in out:
            raise ConfigError(f"fault name {f.name!r} is catalogued twice")
        out[f.name] = f
    return MappingProxyType(out)


# Every catalogued fault by name (names are unique across engines): ropekv's own engine's and the
# handoff's, from their bug classes' modules in registry order, then the patches of other engines.
REGISTRY: Mapping[str, Fault] = _by_name(
    (
        *(f for m in MODULES for f in m.FAULTS),
        *vllm.CATALOGUE,
        *vllm_transfer.CATALOGUE,
        *mlx.CATALOGUE,
        *ort.CATALOGUE,
    )
)


def faults_for(engine: FaultEngine) -> list[Fault]:
    """The faults that run on ``engine``, in registry order."""
    return [f for f in REGISTRY.values() if f.engine == engine]


FAULTS: Mapping[str, NativeFault] = _by_name(f for f in REGISTRY.values() if isinstance(f, NativeFault) and not f.needs)
ARCH_FAULTS: Mapping[str, NativeFault] = _by_name(
    f for f in REGISTRY.values() if isinstance(f, NativeFault) and f.needs
)
OP_FAULTS: Mapping[str, OpFault] = _by_name(f for f in REGISTRY.values() if isinstance(f, OpFault))
HANDOFF_FAULTS: Mapping[str, HandoffFault] = _by_name(f for f in REGISTRY.values() if isinstance(f, HandoffFault))
VLLM_FAULTS: Mapping[str, VLLMFault] = _by_name(f for f in REGISTRY.values() if isinstance(f, VLLMFault))
VLLM_TRANSFER_FAULTS: Mapping[str, TransferFault] = _by_name(
    f for f in REGISTRY.values() if isinstance(f, TransferFault)
)
MLX_FAULTS: Mapping[str, MlxFault] = _by_name(f for f in REGISTRY.values() if isinstance(f, MlxFault))


def get_fault(name: str) -> NativeFault:
    """The fault of ropekv's engine named ``name`` (``ropekv check --inject``); UsageError if none."""
    if name in ARCH_FAULTS:
        return ARCH_FAULTS[name]
    if name not in FAULTS:
        raise UsageError(f"unknown fault {name!r}; choose one of: {', '.join([*FAULTS, *ARCH_FAULTS])}")
    return FAULTS[name]


def get_handoff_fault(name: str) -> HandoffFault:
    """The handoff fault named ``name`` (``ropekv handoff --inject``); UsageError if none."""
    if name not in HANDOFF_FAULTS:
        raise UsageError(f"unknown handoff fault {name!r}; choose one of: {', '.join(HANDOFF_FAULTS)}")
    return HANDOFF_FAULTS[name]


def listing(f: Fault) -> str:
    """The line ``--list-faults`` prints for ``f``."""
    line = f"{f.name:28s} -> {f.kind:22s} {f.description}"
    return f"{line} (shows with: {f.shows_when})" if f.shows_when else line


def get_transfer_fault(name: str) -> TransferFault:
    """The vLLM transfer fault named ``name`` (``ropekv handoff --engine vllm --inject``); UsageError if none."""
    if name not in VLLM_TRANSFER_FAULTS:
        raise UsageError(f"unknown vLLM transfer fault {name!r}; choose one of: {', '.join(VLLM_TRANSFER_FAULTS)}")
    return VLLM_TRANSFER_FAULTS[name]
