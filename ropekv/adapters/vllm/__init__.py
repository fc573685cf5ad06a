"""The vLLM adapter: ``ropekv check --engine vllm`` on the real vLLM engine (CPU build), in process.

``VLLMEngine`` (:mod:`.engine`) drives ``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so ropekv's hooks, and any patch a user applies to vLLM's modules before or during a check, act on
the engine that runs. Run it from ``.venv-vllm`` (``make setup-vllm``): vLLM pins torch and
transformers versions that ropekv's own ``.venv`` does not use. This module imports nothing from
vLLM; :func:`from_args` does, through the engine. See docs/engines/vllm.md.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ...parity.cases import Case

if TYPE_CHECKING:  # pragma: no cover
    from .engine import VLLMEngine

__all__ = ["VLLMEngine", "add_arguments", "default_cases", "from_args", "vllm_cases"]

DEFAULT_BLOCK_SIZE = 32


def __getattr__(name: str):
    if name == "VLLMEngine":  # lazily: importing the engine module is cheap, starting vLLM is not
        from .engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """``ropekv check --engine vllm`` flags (the dtype comes from the common ``--dtype``)."""
    group.add_argument(
        "--vllm-block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="vLLM KV cache block size (a multiple of 32 on CPU; default 32)",
    )
    group.add_argument(
        "--vllm-max-num-batched-tokens",
        type=int,
        default=None,
        help="vLLM's token budget per forward; small values split prompts (chunked prefill)",
    )
    group.add_argument("--vllm-no-prefix-caching", action="store_true", help="turn vLLM's prefix cache off")
    group.add_argument("--vllm-top-k", type=int, default=20, help="log-probabilities vLLM returns per row (k)")


def from_args(args: argparse.Namespace) -> VLLMEngine:
    from .engine import VLLMEngine

    return VLLMEngine(
        getattr(args, "model", None),
        dtype=getattr(args, "dtype", None) or "float32",
        block_size=args.vllm_block_size,
        enable_prefix_caching=not args.vllm_no_prefix_caching,
        max_num_batched_tokens=args.vllm_max_num_batched_tokens,
        top_k=args.vllm_top_k,
    )


def vllm_cases(
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    max_num_batched_tokens: int | None = None,
    long_context: int = 600,
    decode_steps: int = 3,
) -> list[Case]:
    """The default matrix for one vLLM engine: length 1; one below / at / one above a block; prefix hits
    of one and two blocks and of a prefix that is not a block multiple; a long context (chunked when
    ``max_num_batched_tokens`` is smaller); several decode steps. No windows: vLLM runs the model's own."""
    B, chunk = block_size, max_num_batched_tokens
    cases = [
        Case(length=1, block_size=B, decode_steps=decode_steps),
        Case(length=B - 1, block_size=B, decode_steps=decode_steps),
        Case(length=B, block_size=B, decode_steps=decode_steps),
        Case(length=B + 1, block_size=B, decode_steps=decode_steps),
        Case(length=17, prefix=B, block_size=B, decode_steps=decode_steps),
        Case(length=9, prefix=2 * B, block_size=B, decode_steps=decode_steps),
        Case(length=20, prefix=B + 13, block_size=B, decode_steps=decode_steps),
        Case(length=long_context, block_size=B, chunk=chunk, decode_steps=decode_steps),
    ]
    return cases


def default_cases(args: argparse.Namespace) -> list[Case]:
    """The cases ``ropekv check --engine vllm`` runs when no case flag is given: a model with sliding
    layers (Gemma 3) gets ropekv's windowed matrix, :func:`~ropekv.parity.cases.window_matrix`, under
    the model's own windows (its block sizes and chunks that vLLM does not run are reported per case
    as ignored); any other model :func:`vllm_cases` for the engine's block size and token budget
    (ropekv's default matrix has case windows and block sizes vLLM cannot run)."""
    from ...models import load_config
    from ...parity.cases import model_window, window_matrix

    window = model_window(load_config(getattr(args, "model", None)).layer_attentions)
    if window is not None:
        return window_matrix(window)
    return vllm_cases(
        args.vllm_block_size,
        max_num_batched_tokens=args.vllm_max_num_batched_tokens,
        decode_steps=getattr(args, "decode_steps", None) or 3,
    )


def engine_tolerance(adapter) -> None:
    """None: ropekv's per-dtype default. float32 runs stay 50x below it (log-probabilities 1.9e-5 to
    3.5e-5 against the float64 reference); bfloat16 runs sit at 0.10-0.15, from bfloat16 activations
    through 30 layers, while vLLM's cached decode equals its own cache-free forward exactly (docs/engines/vllm.md)."""
    return None
