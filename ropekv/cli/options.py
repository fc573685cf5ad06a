"""Argument types shared by the subcommands: each bad value is a one-line UsageError (exit 2)."""

from __future__ import annotations

import os
from pathlib import Path

from ..argtypes import (  # noqa: F401 -- re-exported for the subcommands
    add_model_argument,
    block_size,
    block_size_list,
    int_list,
    non_negative_int,
    positive_int,
    positive_int_list,
    seed,
    thread_count,
    timeout_seconds,
    worker_count,
)
from ..errors import UsageError


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
