"""llama.cpp through llama-cpp-python (``ropekv check --engine llamacpp``; run from ``.venv-llamacpp``).

``add_arguments`` imports nothing of the engine; :func:`from_args` does, and raises
:class:`~ropekv.errors.EngineUnavailable` where llama-cpp-python is not installed.
See docs/engines/llamacpp.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...errors import UsageError

EMBEDDED = "embedded"  # --gguf embedded: the embedded model's original quantized file (its package's)


def add_arguments(group) -> None:
    group.add_argument(
        "--gguf",
        dest="llamacpp_gguf",
        metavar="PATH",
        help="GGUF file for llama.cpp (default: the embedded model written as an all-float32 GGUF; "
        f"'{EMBEDDED}': the embedded model's quantized file itself (SmolLM2's Q4_1, Gemma 3's Q4_K_M), "
        "checked with its own noise tolerance)",
    )
    group.add_argument(
        "--type-k",
        dest="llamacpp_type_k",
        choices=("f32", "f16"),
        default="f32",
        help="llama.cpp K cache type (default f32)",
    )
    group.add_argument(
        "--type-v",
        dest="llamacpp_type_v",
        choices=("f32", "f16"),
        default="f32",
        help="llama.cpp V cache type (default f32)",
    )
    group.add_argument(
        "--n-batch",
        dest="llamacpp_n_batch",
        type=int,
        default=512,
        help="llama.cpp batch size; a longer prompt is split into ubatches (default 512)",
    )
    group.add_argument(
        "--n-ctx", dest="llamacpp_n_ctx", type=int, default=2048, help="llama.cpp KV cells (default 2048)"
    )
    group.add_argument(
        "--n-threads",
        dest="llamacpp_n_threads",
        type=int,
        default=1,
        help="llama.cpp threads (default 1: ggml's spinning workers are slow on a shared machine)",
    )


def gguf_from_args(args: argparse.Namespace) -> Path | None:
    """The GGUF to run: ``--gguf PATH`` (or a MODEL path ending in .gguf); for an embedded model (MODEL
    or ``--model NAME``) its all-float32 conversion, or with ``--gguf embedded`` its original quantized
    file; None for the default model's float32 file."""
    from ...models.embedded import is_embedded_name

    value = getattr(args, "llamacpp_gguf", None) or None
    model = getattr(args, "model", None)
    name = model if is_embedded_name(model) else None
    if value == EMBEDDED:
        from ...models.default import default_gguf_path

        return default_gguf_path(name)
    if value is not None:
        return Path(value)
    if name is not None:
        from .f32_gguf import default_f32_gguf

        return default_f32_gguf(name)
    if model is None:
        return None
    if not str(model).endswith(".gguf"):
        raise UsageError(f"--engine llamacpp runs GGUF files; {model} is not one (use --gguf PATH)")
    return Path(model)


def from_args(args: argparse.Namespace):
    from .engine import LlamaCppEngine  # raises EngineUnavailable without llama-cpp-python

    return LlamaCppEngine(
        gguf_from_args(args),
        type_k=args.llamacpp_type_k,
        type_v=args.llamacpp_type_v,
        n_batch=args.llamacpp_n_batch,
        n_ctx=args.llamacpp_n_ctx,
        n_threads=args.llamacpp_n_threads,
    )


def __getattr__(name: str):
    if name == "LlamaCppEngine":  # lazy: keeps add_arguments free of the engine's imports
        from .engine import LlamaCppEngine

        return LlamaCppEngine
    raise AttributeError(name)


def llamacpp_cases(max_positions: int):
    """The default matrix without its windowed cases: llama.cpp applies only a model's own sliding
    window (none for llama), so a case window cannot be honoured (``ignored`` says so)."""
    from ...parity.cases import default_matrix

    # (cache operations are not run through llama.cpp: its shift has its own check, shift.py)
    return [c for c in default_matrix(max_positions) if c.window is None and c.op is None]


def default_cases(args: argparse.Namespace):
    """The cases ``ropekv check --engine llamacpp`` lists when no case flag is given (same hook as the
    vLLM adapter's): ropekv's own default for the GGUF's model. A model with sliding layers (gemma3:
    five of six slide over 512 keys) gets :func:`~ropekv.parity.cases.window_matrix` of its window,
    run under the model's own windows, which llama.cpp applies itself; any other model the whole
    default matrix. What llama.cpp cannot honour is reported in its row as not applicable, with the
    reason, never dropped silently: case windows and sinks (``ignored``), cache operations (none
    declared), cases longer than the context's ``--n-ctx`` cells or the model."""
    from ...models.gguf_file import read_gguf_config
    from ...parity.cases import default_matrix, model_window, window_matrix

    gguf = gguf_from_args(args)  # None: the embedded default model, which has no sliding layers
    window = None if gguf is None else model_window(read_gguf_config(gguf).layer_attentions)
    return default_matrix() if window is None else window_matrix(window)


def engine_tolerance(adapter):
    """The run's own tolerance, per weight type and KV type (:mod:`.tolerance`)."""
    return adapter.tolerance
