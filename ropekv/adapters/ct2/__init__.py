"""CTranslate2 (``ropekv check --engine ct2``; run from ``.venv-ct2``: ``make setup-ct2``), logits tier.

``add_arguments`` imports nothing of the engine; :func:`from_args` does, and raises
:class:`~ropekv.errors.EngineUnavailable` where ctranslate2 is not installed.
See docs/engines/ct2.md.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["CT2Engine", "add_arguments", "from_args", "default_cases", "engine_tolerance"]


def __getattr__(name: str) -> Any:
    if name == "CT2Engine":  # lazy: keeps add_arguments free of the engine's imports
        from .engine import CT2Engine

        return CT2Engine
    raise AttributeError(name)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """``ropekv check --engine ct2`` flags."""
    group.add_argument(
        "--ct2-threads", type=int, default=2, metavar="N", help="CTranslate2 intra-op threads (default 2)"
    )


def from_args(args: argparse.Namespace):
    """``CT2Engine(MODEL)`` from ``ropekv check``'s arguments; float32 only."""
    from ...errors import UsageError
    from .engine import CT2Engine

    if getattr(args, "dtype", "float32") not in (None, "float32"):
        raise UsageError("--engine ct2 runs the float32 conversion (compute_type float32)")
    return CT2Engine(getattr(args, "model", None), threads=args.ct2_threads)


def default_cases(args: argparse.Namespace) -> list:
    """The default matrix for a model without sliding layers, :func:`~ropekv.parity.cases.window_matrix`
    of its window for one with them; what CTranslate2 cannot honour is reported as not applicable."""
    from ...models import load_config
    from ...parity.cases import default_matrix, model_window, window_matrix

    window = model_window(load_config(getattr(args, "model", None)).layer_attentions)
    return default_matrix() if window is None else window_matrix(window)


def engine_tolerance(adapter: Any) -> None:
    """ropekv's per-dtype default (float32: 2e-3); float32 CTranslate2 stays far below it."""
    return None
