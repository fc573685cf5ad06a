"""The mlx-lm adapter: ``ropekv check --engine mlx [MODEL]`` (run from ``.venv-mlx``: ``make setup-mlx``).

Importing this package does not import mlx: :class:`MLXEngine` imports it (with OpenBLAS loaded under
it, see :mod:`.runtime`) when constructed.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import MLXEngine

__all__ = ["MLXEngine", "add_arguments", "from_args", "default_cases", "engine_tolerance"]


def __getattr__(name: str) -> Any:
    if name == "MLXEngine":
        from .engine import MLXEngine

        return MLXEngine
    raise AttributeError(name)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """``ropekv check --engine mlx`` flags."""
    group.add_argument(
        "--mlx-max-kv-size",
        type=int,
        default=None,
        metavar="N",
        help="caches from make_prompt_cache(model, max_kv_size=N), as mlx_lm.generate --max-kv-size",
    )
    group.add_argument(
        "--mlx-keep",
        type=int,
        default=None,
        metavar="K",
        help="with --mlx-max-kv-size: RotatingKVCache(max_size=N, keep=K) per layer",
    )
    group.add_argument(
        "--mlx-rollback",
        type=int,
        default=0,
        metavar="N",
        help="after the prefill, feed N rejected draft tokens and trim_prompt_cache them",
    )
    group.add_argument(
        "--mlx-restore", action="store_true", help="decode from a save_prompt_cache / load_prompt_cache round trip"
    )
    group.add_argument(
        "--mlx-blas",
        choices=("openblas", "bundled"),
        default="openblas",
        help="BLAS under mlx: Debian's OpenBLAS (default) or the wheel's reference BLAS",
    )


def from_args(args: argparse.Namespace) -> MLXEngine:
    """``MLXEngine(MODEL, ...)`` from ``ropekv check``'s arguments (``--dtype`` is the shared flag)."""
    from .engine import MLXEngine

    return MLXEngine(
        getattr(args, "model", None),
        max_kv_size=args.mlx_max_kv_size,
        keep=args.mlx_keep,
        dtype=getattr(args, "dtype", "float32"),
        rollback=args.mlx_rollback,
        restore=args.mlx_restore,
        blas=args.mlx_blas,
    )


def default_cases(args: argparse.Namespace) -> list:
    """What ``ropekv check --engine mlx`` lists without case flags.

    A model with sliding layers (gemma3: five sliding layers of window 512, then one global) gets
    ropekv's :func:`~ropekv.parity.cases.window_matrix` of its window, run under the model's own caches
    (``make_prompt_cache``: ``RotatingKVCache(max_size=W)`` on sliding layers, ``KVCache`` on global ones).
    Any other model gets the default matrix with its sink case run without sinks (no mlx-lm cache has
    ropekv's window-with-sinks semantics: ``RotatingKVCache(W + s, keep=s)`` keeps no sinks during
    prefill, docs/engines/mlx.md finding 2); its cache-operation cases and the cases the model is too
    short for stay in the list and are reported as not applicable, with the reason, never dropped.
    The model's config is read from ``args.model`` (config.json only, no weights)."""
    import dataclasses

    from ...models import load_config
    from ...parity.cases import default_matrix, model_window, window_matrix

    window = model_window(load_config(getattr(args, "model", None)).layer_attentions)
    if window is not None:
        return window_matrix(window)
    return [dataclasses.replace(c, sink_tokens=0) if c.sink_tokens else c for c in default_matrix()]


def engine_tolerance(adapter) -> None:
    """ropekv's per-dtype default: float32 mlx-lm stays 15x or more below it (1.25e-4 worst measured
    against 2e-3, docs/engines/mlx.md); no engine-specific tolerance is needed."""
    return None
