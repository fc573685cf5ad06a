"""The engines ``ropekv check --engine NAME`` can drive, each imported only when chosen.

An engine module defines ``add_arguments(group)`` (its own CLI flags, added to ``ropekv check`` under
a group named after the engine; it must not import the engine's package), ``from_args(args) ->
EngineAdapter`` (which may), ``default_cases(args) -> list[Case]`` (what ``ropekv check --engine NAME``
runs when no case flag is given: the default matrix less what the engine cannot honour) and
``engine_tolerance(adapter) -> Tolerance | None`` (None: the per-dtype default; else the engine's own,
justified in its docs). Engines whose package conflicts with ropekv's own
pins run from their own virtual environment (``venv``); the error says which one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from ..errors import EngineUnavailable


@dataclass(frozen=True)
class EngineEntry:
    name: str
    module: str  # the adapter module, imported lazily
    venv: str | None  # the project-local venv it runs from (None: ropekv's own .venv)
    summary: str


ENGINES: dict[str, EngineEntry] = {
    e.name: e
    for e in (
        EngineEntry("ropekv", "ropekv.adapters.native", None, "ropekv's own paged engine (default)"),
        EngineEntry("hf", "ropekv.adapters.hf", None, "the model's HF transformers implementation"),
        EngineEntry("vllm", "ropekv.adapters.vllm", ".venv-vllm", "vLLM (CPU build), in process"),
        EngineEntry("mlx", "ropekv.adapters.mlx", ".venv-mlx", "mlx-lm on MLX's CPU backend"),
        EngineEntry("llamacpp", "ropekv.adapters.llamacpp", ".venv-llamacpp", "llama.cpp through llama-cpp-python"),
        EngineEntry(
            "ort", "ropekv.adapters.ort", ".venv-ort", "ONNX Runtime GenAI (CPU): RoPE inside the attention kernel"
        ),
        EngineEntry("ct2", "ropekv.adapters.ct2", ".venv-ct2", "CTranslate2 (CPU), logits tier"),
    )
}


def engine_module(name: str) -> ModuleType:
    """The adapter module of engine ``name``; EngineUnavailable if it cannot be imported here."""
    entry = ENGINES[name]
    try:
        return importlib.import_module(entry.module)
    except ImportError as exc:
        where = f" (run it from {entry.venv}: make setup-{name})" if entry.venv else ""
        raise EngineUnavailable(f"engine {name!r} is not available in this environment{where}: {exc}") from None
