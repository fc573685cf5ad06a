"""argparse pieces that library entry points below ``cli/`` share with it (the handoff workers' own
command line): value types whose bad values are one-line errors, and a parser that raises
:class:`~ropekv.errors.UsageError` instead of exiting."""

from __future__ import annotations

import argparse

from .errors import UsageError


class RaisingParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, so usage errors share the one-line path."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}")


def int_list(text: str) -> list[int]:
    """``"1,17,513"`` -> ``[1, 17, 513]``; every entry a non-negative integer."""
    try:
        values = [int(v) for v in text.split(",") if v.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers, got {text!r}")
    return values


def positive_int_list(text: str) -> list[int]:
    """``"1,17,513"`` -> ``[1, 17, 513]``; every entry a positive integer (lengths, block sizes)."""
    values = int_list(text)
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a transformers directory or a .gguf file (default: the embedded SmolLM2-135M)",
    )
