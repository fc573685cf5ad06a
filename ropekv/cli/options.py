"""Argument types shared by the subcommands: each bad value is a one-line UsageError (exit 2)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import UsageError


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


def seed(text: str) -> int:
    """An integer torch's generator accepts: ``-2**63 <= seed < 2**64``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"seed {text} is out of range [-2**63, 2**64)")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def writable_path(path: str | None, flag: str) -> Path | None:
    """Check before any heavy work that ``path`` can be written (its folder exists and is writable)."""
    if path is None:
        return None
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: folder {folder} {'is not a directory' if folder.exists() else 'does not exist'}")
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")
    return p


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a transformers directory or a .gguf file (default: the embedded SmolLM2-135M)")
