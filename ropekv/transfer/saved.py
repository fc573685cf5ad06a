"""Save and restore one cached sequence as a file: the handoff payload, written to disk.

A saved cache is exactly a :mod:`ropekv.transfer.payload` (safetensors: token ids, the logical
position of every token, per-layer keys and values; the contract JSON and a sha256 checksum over
everything in its header). Loading reuses the handoff import, so a file written under another
contract is refused with :class:`~ropekv.errors.ContractMismatch` (exit 3), a corrupted or truncated
one with :class:`~ropekv.errors.PayloadError`, and in both cases nothing is imported.

A saved file is whatever a user hands over, so it is read in this order, believing nothing early:
it must be a regular file (a FIFO, a device, a directory are refused before a byte is read); its
8-byte header length and JSON header are read and validated (a length past 4 MiB, tensors that do not
tile the rest of the file exactly, a contract the engine's differs from, more tokens than the model has
positions: all refused before any tensor byte is read or allocated); then its tensors are read
straight into tensors of exactly the declared size, the checksum is verified, and the content is
checked against the model (positions below its limit, token ids below its vocabulary,
:class:`~ropekv.transfer.importer.ModelLimits`). Only then does the import touch the cache. Restoring the
positions with the keys is the point: a restore that loads keys but restarts the offset at 0 rotates
the next token at position 0 (vllm-metal #144).

:func:`save_sequence` and :func:`load_sequence` work through the engine's public API (its cache, and
:meth:`~ropekv.engine.Engine.adopt` for a loaded sequence), so the engine knows nothing of files.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

from ..engine import Engine
from ..errors import CacheError, PayloadError, UsageError
from ..files import open_regular, read_exactly
from .importer import ModelLimits, export_handoff, import_handoff, plan_import
from .payload import (
    Handoff,
    PayloadHeader,
    assemble,
    empty_tensor,
    header_length,
    read_header,
    tensor_bytes,
    write_payload,
)


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

    limits = ModelLimits.of(engine.config)

    def accept(header: PayloadHeader) -> None:
        plan_import(engine.cache.contract, header.contract)  # ContractMismatch, before any tensor is read
        limits.check_count(header.num_tokens, "saved cache")

    handoff = read_saved(path, accept)
    limits.check(handoff.tokens, handoff.positions, "saved cache")
    sid = import_handoff(engine.cache, handoff, seq_id=seq_id, limits=limits)  # all or nothing
    tokens = handoff.tokens.clone()
    engine.adopt(sid, restored=int(tokens.numel()))
    return sid, tokens


def read_saved(path: str | os.PathLike, accept: Callable[[PayloadHeader], None] | None = None) -> Handoff:
    """The handoff saved at ``path``: a regular file, its header validated (then ``accept(header)``,
    which may refuse it by raising) before its tensors are read. Raises ``UsageError`` for a path that
    is not a readable regular file, ``PayloadError`` for anything wrong inside it."""
    f, size = open_regular(path, "saved cache")
    with f:
        header_len = header_length(_read(f, 8, path), size)
        header = read_header(_read(f, header_len, path), header_len, size)
        if accept is not None:
            accept(header)
        tensors = read_tensors(f, header, path)
    return assemble(header, tensors)


def read_tensors(f: io.RawIOBase, header: PayloadHeader, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read the data section of an open payload file (positioned after its header) into one tensor per
    entry, in file order. Nothing is allocated beyond what the validated header declares, which the
    file's size bounds."""
    tensors = {}
    for name, (dtype, shape, _) in sorted(header.entries.items(), key=lambda kv: kv[1][2]):
        t = empty_tensor(dtype, shape)
        read_exactly(f, tensor_bytes(t), f"saved cache {os.fspath(path)}, tensor {name!r}", PayloadError)
        tensors[name] = t
    return tensors


def _read(f: io.RawIOBase, n: int, path: str | os.PathLike) -> bytes:
    buffer = bytearray(n)
    read_exactly(f, memoryview(buffer), f"saved cache {os.fspath(path)}", PayloadError)
    return bytes(buffer)
