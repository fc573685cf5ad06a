"""``ropekv handoff --engine llamacpp``: a llama.cpp sequence moved from a writer context to a fresh reader.

The writer context prefills the prompt, its sequence state goes through ropekv's checked pair
(:func:`~.state.save_state` / :func:`~.state.load_state`: the state file carries the writer's cache
contract, a reader whose contract differs is refused) or, with ``--llamacpp-unchecked``, through
llama.cpp's own ``llama_state_seq_get_data`` / ``set_data``; the reader decodes and is compared with the
float64 reference, its own full forward and the writer itself (:mod:`.state_check`). Each context's
RoPE can be set (``--llamacpp-writer-rope-freq-base``, ``--llamacpp-reader-rope-scaling yarn``, ...).

Exit codes as ``ropekv check``: 0 parity, 1 no parity (an unchecked restore under another RoPE),
2 bad input, 3 the reader's contract refused (:class:`~ropekv.errors.ContractMismatch`).
:func:`add_arguments` imports nothing of the engine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ...argtypes import BoundedInt, seed, strict_float
from ...errors import UsageError

_SIDES = ("writer", "reader")
MAX_PROMPT = 4096  # prompt tokens: the contexts' cells bound it further (--n-ctx)
MAX_STEPS = 64


def _number(low: float, high: float):
    def parse(text: str) -> float:
        value = strict_float(text)
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a finite number in [{low:g}, {high:g}], got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def add_arguments(group) -> None:
    """The handoff's flags, each prefixed ``--llamacpp-`` (the model and KV flags are the adapter's own)."""
    group.add_argument(
        "--llamacpp-prompt-tokens",
        type=BoundedInt(1, MAX_PROMPT),
        default=64,
        metavar="N",
        help="prompt tokens the writer context prefills (default 64)",
    )
    group.add_argument(
        "--llamacpp-decode-steps",
        type=BoundedInt(1, MAX_STEPS),
        default=3,
        metavar="N",
        help="tokens the reader context decodes after the restore (default 3)",
    )
    group.add_argument(
        "--llamacpp-seed", type=seed, default=1, metavar="N", help="seed of the random prompt (default 1)"
    )
    group.add_argument(
        "--llamacpp-unchecked",
        action="store_true",
        help="move the state with llama.cpp's own llama_state_seq_get_data/set_data (no contract): shows what "
        "llama.cpp accepts",
    )
    group.add_argument(
        "--llamacpp-state-file",
        metavar="PATH",
        default=None,
        help="where the checked pair writes the state (default: a temporary file, removed)",
    )
    for side in _SIDES:
        group.add_argument(
            f"--llamacpp-{side}-rope-freq-base",
            type=_number(1.0, 1e12),
            default=None,
            metavar="BASE",
            help=f"the {side} context's rope_freq_base (default: the model's)",
        )
        group.add_argument(
            f"--llamacpp-{side}-rope-freq-scale",
            type=_number(1e-6, 1e6),
            default=None,
            metavar="SCALE",
            help=f"the {side} context's rope_freq_scale (linear or YaRN factor = 1/SCALE; default: the model's)",
        )
        group.add_argument(
            f"--llamacpp-{side}-rope-scaling",
            choices=("none", "linear", "yarn"),
            default=None,
            help=f"the {side} context's rope_scaling_type (default: the model's)",
        )
        group.add_argument(
            f"--llamacpp-{side}-yarn-orig-ctx",
            type=BoundedInt(1, 2**24),
            default=None,
            metavar="N",
            help=f"the {side} context's yarn_orig_ctx (default: the model's)",
        )


def rope_from_args(args: argparse.Namespace, side: str):
    from .rope_params import RopeOverrides

    def get(name: str):
        return getattr(args, f"llamacpp_{side}_{name}", None)

    return RopeOverrides(
        freq_base=get("rope_freq_base"),
        freq_scale=get("rope_freq_scale"),
        scaling_type=get("rope_scaling"),
        yarn_orig_ctx=get("yarn_orig_ctx"),
    )


def run(args: argparse.Namespace) -> int:
    """Run one transfer and print its table; 0 parity, 1 none; ContractMismatch (exit 3) when refused."""
    from ...parity.cases import token_stream
    from . import from_args
    from .state_check import References, check_transfer, table

    n, steps = args.llamacpp_prompt_tokens, args.llamacpp_decode_steps
    engine = from_args(_with_engine_defaults(args))
    if n + steps > engine.n_ctx:
        raise UsageError(f"{n} prompt tokens and {steps} decode steps need n_ctx >= {n + steps}, got {engine.n_ctx}")
    tokens = token_stream(engine.config.vocab_size, n + steps, seed=args.llamacpp_seed).tolist()
    writer, reader = rope_from_args(args, "writer"), rope_from_args(args, "reader")
    with tempfile.TemporaryDirectory(prefix="ropekv-llamacpp-state-") as tmp:
        path = Path(args.llamacpp_state_file or Path(tmp) / "seq0.ropekv-state")
        check = check_transfer(
            engine,
            References(engine),
            tokens,
            n,
            steps,
            writer_rope=writer,
            reader_rope=reader,
            checked=not args.llamacpp_unchecked,
            state_path=path,
        )  # ContractMismatch propagates: the CLI's exit 3
    print(table(check))
    json_path = getattr(args, "json", None)
    if json_path:
        doc = {"format": "ropekv.llamacpp-state-report", "version": 1, **check.to_dict()}
        Path(json_path).write_text(json.dumps(doc, indent=2, allow_nan=False))
    return 0 if check.passed else 1


def _with_engine_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The llama.cpp adapter's flags (``--gguf``, ``--type-k``, ...) where the parser did not add them."""
    defaults = {
        "llamacpp_gguf": None,
        "llamacpp_type_k": "f32",
        "llamacpp_type_v": "f32",
        "llamacpp_n_batch": 512,
        "llamacpp_n_ctx": 2048,
        "llamacpp_n_threads": 1,
        "model": None,
    }
    merged = argparse.Namespace(**{**defaults, **vars(args)})
    return merged
