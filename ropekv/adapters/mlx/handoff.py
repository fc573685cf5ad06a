"""``ropekv handoff --engine mlx``: an mlx-lm prompt cache saved by one model and loaded by another.

A writer (the model directory as mlx-lm loads it, optionally with sliding layers) prefills
``--mlx-length`` tokens and saves its prompt cache with :func:`~.prompt_cache.save_checked`; a reader
(the same weights, optionally under another ``rope_theta``, ``rope_scaling`` or sliding window) loads
it with :func:`~.prompt_cache.load_checked` and decodes ``--mlx-decode-steps`` tokens from it. Each
decode step's logits are compared with ropekv's float64 reference and with mlx-lm's own uncached
forward of the reader. A reader whose contract differs is refused (ContractMismatch, exit 3) before
anything is loaded; ``--mlx-unchecked`` first shows what mlx-lm's own ``load_prompt_cache`` does with
the same file (it loads it and decodes).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...argtypes import positive_int, rope_theta
from ...errors import ContractMismatch, UsageError
from ...parity.compare import scaled_error, tolerance_for

MAX_LENGTH = 4096  # MLX on CPU: a longer prompt is a benchmark, not a check
MAX_STEPS = 64
_SCALINGS = ("linear", "dynamic")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """``ropekv handoff --engine mlx`` flags."""
    group.add_argument(
        "--mlx-length", type=positive_int, default=40, metavar="N", help="prompt tokens prefilled and saved (40)"
    )
    group.add_argument(
        "--mlx-decode-steps", type=positive_int, default=3, metavar="N", help="tokens decoded after the load (3)"
    )
    group.add_argument(
        "--mlx-sliding-window",
        type=positive_int,
        default=None,
        metavar="W",
        help="writer and reader run every odd layer as sliding attention with window W (layer_types)",
    )
    group.add_argument(
        "--mlx-reader-rope-theta", type=rope_theta, default=None, metavar="THETA", help="the reader's rope_theta"
    )
    group.add_argument(
        "--mlx-reader-rope-scaling",
        type=rope_scaling,
        default=None,
        metavar="TYPE:FACTOR",
        help="the reader's rope_scaling, e.g. linear:2 or dynamic:2",
    )
    group.add_argument(
        "--mlx-reader-sliding-window",
        type=positive_int,
        default=None,
        metavar="W",
        help="the reader's sliding window (needs --mlx-sliding-window)",
    )
    group.add_argument(
        "--mlx-unchecked",
        action="store_true",
        help="also decode from mlx-lm's own load_prompt_cache of the same file (no contract check)",
    )
    group.add_argument("--mlx-save", default=None, metavar="PATH", help="keep the prompt-cache file (*.safetensors)")
    group.add_argument(
        "--mlx-blas", choices=("openblas", "bundled"), default="openblas", help="BLAS under mlx (see ropekv check)"
    )


def rope_scaling(text: str) -> dict[str, Any]:
    """argparse type: ``linear:2`` -> ``{"type": "linear", "factor": 2.0}`` (config.json's rope_scaling)."""
    kind, _, factor = text.partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = float("nan")
    if kind not in _SCALINGS or not 1.0 <= value <= 1e6:
        raise argparse.ArgumentTypeError(
            f"expected TYPE:FACTOR with TYPE one of {', '.join(_SCALINGS)} and FACTOR in [1, 1e6], got {text!r}"
        )
    return {"type": kind, "factor": value}


@dataclass(frozen=True)
class StepResult:
    """One decode step from the loaded cache: its logits against the float64 reference (scale-aware
    error and max|dlogit|) and against mlx-lm's uncached forward of the reader."""

    position: int
    max_abs: float
    vs_reference: float
    vs_full: float


def writer_overrides(args: argparse.Namespace, num_layers: int) -> dict[str, Any]:
    if args.mlx_sliding_window is None:
        return {}
    kinds = ["sliding_attention" if i % 2 else "full_attention" for i in range(num_layers)]
    return {"layer_types": kinds, "sliding_window": args.mlx_sliding_window}


def reader_overrides(args: argparse.Namespace, writer: dict[str, Any]) -> dict[str, Any]:
    out = dict(writer)
    if args.mlx_reader_rope_theta is not None:
        out["rope_theta"] = args.mlx_reader_rope_theta
    if args.mlx_reader_rope_scaling is not None:
        out["rope_scaling"] = args.mlx_reader_rope_scaling
    if args.mlx_reader_sliding_window is not None:
        if args.mlx_sliding_window is None:
            raise UsageError("--mlx-reader-sliding-window needs --mlx-sliding-window (the writer's)")
        out["sliding_window"] = args.mlx_reader_sliding_window
    return out


def decode_steps(
    reader: Any, caches: list[Any], tokens: torch.Tensor, length: int, expected: torch.Tensor
) -> list[StepResult]:
    """Decode ``tokens[length:]`` one by one from ``caches`` with ``reader`` (an MLXEngine); ``expected
    [T, vocab]``: float64 logits of the whole sequence."""
    from mlx_lm.models.cache import ConcatenateKVCache

    full = reader.forward(tokens, [ConcatenateKVCache() for _ in reader.model.layers])  # [T, vocab]
    out = []
    for t in range(length, int(tokens.shape[0])):
        logits = reader.forward(tokens[t : t + 1], caches)[-1]
        out.append(
            StepResult(
                position=t,
                max_abs=float((logits.double() - expected[t]).abs().max()),
                vs_reference=scaled_error(logits, expected[t]),
                vs_full=scaled_error(logits, full[t]),
            )
        )
    return out


def table(steps: list[StepResult], tolerance: float | None) -> str:
    lines = [f"{'step':<5} {'position':>8}  {'max|dlogit|':>11}  {'vs float64':>10}  {'vs mlx full':>11}  result"]
    for i, s in enumerate(steps):
        verdict = "" if tolerance is None else ("PASS" if max(s.vs_reference, s.vs_full) < tolerance else "FAIL")
        lines.append(
            f"{i:<5} {s.position:>8}  {s.max_abs:>11.3g}  {s.vs_reference:>10.3g}  {s.vs_full:>11.3g}  {verdict}".rstrip()
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Prefill, save_checked, load_checked into the reader, decode, compare. 0 parity, 1 no parity; a
    refused contract raises ContractMismatch (exit 3), a bad file PayloadError (exit 2)."""
    from ...models.safetensors_dir import read_dir_config
    from ...parity.cases import token_stream
    from .engine import MLXEngine, model_directory
    from .prompt_cache import load_checked, save_checked
    from .runtime import import_mlx

    length, steps = args.mlx_length, args.mlx_decode_steps
    if length > MAX_LENGTH or steps > MAX_STEPS:
        raise UsageError(f"--mlx-length is at most {MAX_LENGTH} and --mlx-decode-steps at most {MAX_STEPS}")
    save = None if args.mlx_save is None else Path(args.mlx_save)
    if save is not None and (save.suffix != ".safetensors" or not save.parent.is_dir()):
        raise UsageError(f"--mlx-save {save}: a *.safetensors path in an existing folder is needed")
    rt = import_mlx(args.mlx_blas)
    model_dir = model_directory(getattr(args, "model", None))
    w_over = writer_overrides(args, read_dir_config(model_dir).num_layers)
    r_over = reader_overrides(args, w_over)
    writer = MLXEngine(model_dir, blas=args.mlx_blas, overrides=w_over)
    reader = writer if r_over == w_over else MLXEngine(model_dir, blas=args.mlx_blas, overrides=r_over)
    if length + steps > writer.config.rope.max_position_embeddings:
        raise UsageError(
            f"{length} + {steps} tokens exceed the model's {writer.config.rope.max_position_embeddings} positions"
        )
    tokens = token_stream(writer.config.vocab_size, length + steps)
    caches = rt.cache.make_prompt_cache(writer.model)
    writer.forward(tokens[:length], caches)
    ref: list[torch.Tensor] = []  # the float64 logits, computed once, only where something decodes

    def expected() -> torch.Tensor:
        if not ref:
            ref.append(reference(writer, tokens))
        return ref[0]

    with tempfile.TemporaryDirectory(prefix="ropekv-mlx-handoff-") as tmp:
        path = save if save is not None else Path(tmp) / "prompt_cache.safetensors"
        size = save_checked(path, caches, writer.model)
        print(f"writer: {_describe(writer)}; {_cache_kinds(caches)}")
        print(f"reader: {_describe(reader)}")
        print(f"prompt cache: {length} tokens (positions 0..{length - 1}), {size} bytes, written by save_checked")
        if args.mlx_unchecked:
            raw = rt.cache.load_prompt_cache(str(path))
            print("\nmlx-lm load_prompt_cache (no contract): loaded, decoding")
            print(table(decode_steps(reader, raw, tokens, length, expected()), None))
        try:
            loaded = load_checked(path, reader.model)
        except ContractMismatch as exc:
            shown = ", ".join(exc.fields[:4]) + (f", ... ({len(exc.fields)} fields)" if len(exc.fields) > 4 else "")
            print(f"\nload_checked: refused ({shown})")
            raise
    print(f"\nload_checked: contract {loaded.contract.fingerprint()} accepted; decoding")
    results = decode_steps(reader, loaded.caches, tokens, length, expected())
    tol = tolerance_for(writer.dtype).logits
    print(table(results, tol))
    failed = sum(max(s.vs_reference, s.vs_full) >= tol for s in results)
    if failed:
        print(f"parity FAILS in {failed} of {len(results)} decode steps (tolerance {tol:g})")
        return 1
    print(f"parity holds in all {len(results)} decode steps after the load (tolerance {tol:g})")
    return 0


def reference(writer: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Float64 logits ``[T, vocab]`` of ``tokens`` under the writer's model (its weights as mlx holds them,
    its config with the overrides), windows as the config says."""
    from ...models.reference import ReferenceDecoder

    return ReferenceDecoder(writer.checkpoint).forward(tokens).logits


def _describe(engine: Any) -> str:
    rope = engine.config.rope
    scaling = rope.scaling.rope_type + ("" if rope.scaling.factor is None else f" x{rope.scaling.factor:g}")
    window = engine.overrides.get("sliding_window")
    return f"mlx-lm {engine.rt.versions['mlx-lm']} {engine.path.name}, rope_theta {rope.theta:g}, scaling {scaling}" + (
        "" if window is None else f", sliding window {window} on odd layers"
    )


def _cache_kinds(caches: list[Any]) -> str:
    kinds = [type(c).__name__ + (f"({c.max_size})" if hasattr(c, "max_size") else "") for c in caches]
    return ", ".join(f"{kinds.count(k)} x {k}" for k in dict.fromkeys(kinds))


def main(argv: list[str] | None = None) -> int:
    """``python -m ropekv.adapters.mlx.handoff [MODEL] [--mlx-...]``: :func:`run` with the CLI's error
    mapping (one line on stderr, the error's exit code), for use before and beside the subcommand."""
    import sys

    from ...errors import RopeKVError

    parser = argparse.ArgumentParser(prog="python -m ropekv.adapters.mlx.handoff", description=__doc__)
    parser.add_argument("model", nargs="?", default=None, help="model directory (default: the embedded model)")
    add_arguments(parser.add_argument_group("mlx-lm prompt cache"))
    args = parser.parse_args(argv)
    try:
        return run(args)
    except RopeKVError as exc:
        print(f"ropekv: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
