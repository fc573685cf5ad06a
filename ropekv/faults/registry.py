"""The fault registry: every catalogued fault of every engine, built once from the catalogues.

``ropekv check --inject`` / ``--list-faults``, ``ropekv handoff --inject`` / ``--list-faults`` and the
tests read it. The views below are filters of :data:`REGISTRY`, in its order:

- :data:`FAULTS`: ropekv's engine, every model (``ropekv.faults.catalogue``), then those that need a
  case running a cache operation (``ropekv.faults.ops``);
- :data:`ARCH_FAULTS`: ropekv's engine, those that need a model with a per-layer RoPE feature;
- :data:`OP_FAULTS`: the cache-operation ones alone;
- :data:`HANDOFF_FAULTS`, :data:`VLLM_FAULTS`, :data:`MLX_FAULTS`: the handoff's import, a patched vLLM
  and a patched mlx-lm; :data:`VLLM_TRANSFER_FAULTS`: between a vLLM producer and consumer
  (``ropekv handoff --engine vllm --inject``). Registering these imports neither vLLM nor mlx (their patches do, when run).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TypeVar

from ..errors import ConfigError, UsageError
from . import (
    block_seam,
    catalogue,
    handoff,
    magnitude,
    mixed_rotations,
    mlx,
    mrope_axes,
    ops,
    position_width,
    quantized_kv,
    speculative,
    transfer_layout,
    vllm,
    vllm_transfer,
)
from .handoff import HandoffFault
from .mlx import MlxFault
from .native import NativeFault
from .ops import OpFault
from .record import Fault, FaultEngine
from .vllm import VLLMFault
from .vllm_transfer import TransferFault

F = TypeVar("F", bound=Fault)


def _by_name(faults: Iterable[F]) -> Mapping[str, F]:
    out: dict[str, F] = {}
    for f in faults:
        if f.name in out:
            raise ConfigError(f"fault name {f.name!r} is catalogued twice")
        out[f.name] = f
    return MappingProxyType(out)


# Every fault by name; names are unique across engines.
REGISTRY: Mapping[str, Fault] = _by_name(
    (
        *catalogue.CATALOGUE,
        *magnitude.CATALOGUE,
        *mixed_rotations.CATALOGUE,
        *quantized_kv.CATALOGUE,
        *ops.CATALOGUE,
        *speculative.CATALOGUE,
        *position_width.CATALOGUE,
        *block_seam.CATALOGUE,
        *handoff.CATALOGUE,
        *transfer_layout.CATALOGUE,
        *vllm.CATALOGUE,
        *vllm_transfer.CATALOGUE,
        *mlx.CATALOGUE,
        *mrope_axes.CATALOGUE,
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
