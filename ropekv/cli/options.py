"""Argument types shared by the subcommands: each bad value is a one-line UsageError (exit 2)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..argtypes import add_model_argument, int_list, positive_int, positive_int_list  # noqa: F401 -- re-exported
from ..errors import UsageError


def seed(text: str) -> int:
    """An integer torch's generator accepts: ``-2**63 <= seed < 2**64``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"seed {text} is out of range [-2**63, 2**64)")
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
        raise UsageError(
            f"{flag} {path}: folder {folder} {'is not a directory' if folder.exists() else 'does not exist'}"
        )
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")
    return p
