"""Save and restore one cached sequence as a file: the handoff payload, written to disk.

A saved cache is exactly a :mod:`ropekv.transfer.payload` (safetensors: token ids, the logical
position of every token, per-layer keys and values; the contract JSON and a sha256 checksum over
everything in its header). Loading reuses the handoff import, so a file written under another
contract is refused with :class:`~ropekv.errors.ContractMismatch` (exit 3), a corrupted or truncated
one with :class:`~ropekv.errors.PayloadError`, and in both cases nothing is imported. Restoring the
positions with the keys is the point: a restore that loads keys but restarts the offset at 0 rotates
the next token at position 0 (vllm-metal #144).

:func:`save_sequence` and :func:`load_sequence` work through the engine's public API (its cache, and
:meth:`~ropekv.engine.Engine.adopt` for a loaded sequence), so the engine knows nothing of files.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from pathlib import Path

import torch

from ..engine import Engine
from ..errors import CacheError, UsageError
from .importer import export_handoff, import_handoff
from .payload import read_payload, write_payload


def save_sequence(engine: Engine, seq_id: str | int, path: str | os.PathLike, tokens: torch.Tensor) -> int:
    """Write ``seq_id`` to ``path`` (atomically: a temporary file, then a rename); returns bytes written.
    ``tokens [n]`` are the ids the sequence consumed. A sequence with evicted tokens is refused (the
    payload holds every token of a full-attention layer)."""

    holes = engine.cache.holes(seq_id)  # CacheError for an unknown sequence
    if holes:
        raise CacheError(
            f"save of {seq_id!r}: {holes} token(s) were evicted; the payload format stores every "
            "token of a full-attention layer, so a sequence with holes cannot be saved"
        )
    data = write_payload(export_handoff(engine.cache, seq_id, tokens))
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write the saved cache to {path}: {exc.strerror or exc}") from None
    return len(data)


def load_sequence(
    engine: Engine, path: str | os.PathLike, seq_id: Hashable | None = None
) -> tuple[Hashable, torch.Tensor]:
    """Import the sequence saved at ``path`` into ``engine`` (all or nothing); returns ``(seq_id,
    tokens [n])``. The sequence starts afresh (no fork offset; its op facts note the restore)."""

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read the saved cache {path}: {exc.strerror or exc}") from None
    handoff = read_payload(data)  # PayloadError on any corruption, before anything is allocated
    sid = import_handoff(engine.cache, handoff, seq_id=seq_id)  # ContractMismatch / CacheError, all or nothing
    tokens = handoff.tokens.clone()
    engine.adopt(sid, restored=int(tokens.numel()))
    return sid, tokens
