"""ONNX Runtime GenAI (``ropekv check --engine ort``; run from ``.venv-ort``: ``make setup-ort``).

``add_arguments`` imports nothing of the engine; :func:`from_args` does, and raises
:class:`~ropekv.errors.EngineUnavailable` where onnxruntime-genai is not installed.
See docs/engines/ort.md.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["OrtEngine", "add_arguments", "from_args", "default_cases", "engine_tolerance"]


def __getattr__(name: str) -> Any:
    if name == "OrtEngine":  # lazy: keeps add_arguments free of the engine's imports
        from .engine import OrtEngine

        return OrtEngine
    raise AttributeError(name)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """``ropekv check --engine ort`` flags."""
    group.add_argument(
        "--ort-tier",
        choices=("logits", "attention", "forensics"),
        default=None,
        help="run at this tier (default: the highest the graph allows; a lower one skips the probes)",
    )
    group.add_argument(
        "--ort-full-buffers",
        action="store_true",
        help="run windowed layers with their window over full-length buffers instead of the builder's "
        "sliding buffers (reaches the forensics tier on Gemma 3; not the graph as built)",
    )


def from_args(args: argparse.Namespace):
    """``OrtEngine(MODEL)`` from ``ropekv check``'s arguments; float32 only (the CPU graph's dtype)."""
    from ...errors import UsageError
    from .engine import OrtEngine

    if getattr(args, "dtype", "float32") not in (None, "float32"):
        raise UsageError("--engine ort runs the float32 CPU graph onnxruntime-genai builds (fp32, cpu)")
    return OrtEngine(
        getattr(args, "model", None),
        tier=getattr(args, "ort_tier", None),
        full_buffers=getattr(args, "ort_full_buffers", False),
    )


def default_cases(args: argparse.Namespace) -> list:
    """What ``ropekv check --engine ort`` lists without case flags: the default matrix for a model without
    sliding layers, :func:`~ropekv.parity.cases.window_matrix` of its window for one with them (the graph
    applies the model's own windows only). Cases it cannot honour (case windows, sinks, cache
    operations) stay in the list and are reported as not applicable, with the reason."""
    from ...models import load_config
    from ...parity.cases import default_matrix, model_window, window_matrix

    window = model_window(load_config(getattr(args, "model", None)).layer_attentions)
    return default_matrix() if window is None else window_matrix(window)


def engine_tolerance(adapter: Any) -> None:
    """ropekv's per-dtype default (float32: 2e-3): the float32 CPU graph stays far below it
    (docs/engines/ort.md)."""
    return None
