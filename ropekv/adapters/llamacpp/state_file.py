"""ropekv's file for one llama.cpp sequence state: llama.cpp's bytes with the contract they were written under.

llama.cpp's own state (``llama_state_seq_get_data``, and the session files of
``llama_state_seq_save_file`` / ``llama_state_save_file``) holds cell positions, keys and values, and is
checked on restore only for layer count, tensor types and row sizes: nothing says which RoPE turned the
keys (docs/engines/llamacpp.md, "Sequence state"). This file wraps those bytes unchanged:

    8 bytes   magic b"RKVLSEQ\\n"
    4 bytes   header length H, little-endian uint32, at most MAX_HEADER_BYTES
    H bytes   JSON header: format, version, the writer's CacheContract, the token ids, the first and
              last position they sit at, the state's size and sha256, what wrote it
    N bytes   llama.cpp's sequence state, exactly as ``llama_state_seq_get_data`` returned it

Read in this order, believing nothing early: a regular file (:func:`ropekv.files.open_regular`), the
magic, a bounded header length, a header whose every field is checked and whose state size is exactly
what the file has left; then ``accept(header)`` (the reader's contract and capacity, which may refuse
before any state byte is read); then the state bytes and their checksum. Only then may a caller hand
them to llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...argtypes import MAX_TOKENS
from ...contract import CacheContract
from ...errors import ConfigError, PayloadError, UsageError
from ...files import open_regular, read_exactly

MAGIC = b"RKVLSEQ\n"
FORMAT = "ropekv.llamacpp-seq-state"
VERSION = 1
MAX_HEADER_BYTES = 16 << 20  # the header holds the token ids: 2**20 tokens as JSON fit well below this
_PREFIX = len(MAGIC) + 4
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"format", "version", "contract", "tokens", "first_position", "state_bytes", "state_sha256", "writer"}


@dataclass(frozen=True)
class StateHeader:
    """What a state file says about its bytes. ``tokens [n]`` sit at ``first_position ..
    first_position + n - 1`` (one sequence, contiguous); ``writer``: free-form facts (engine, version)."""

    contract: CacheContract
    tokens: tuple[int, ...]
    first_position: int
    state_bytes: int
    state_sha256: str
    writer: dict[str, Any]

    @property
    def positions(self) -> tuple[int, int]:
        """``(first, last)`` position of the sequence."""
        return self.first_position, self.first_position + len(self.tokens) - 1

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "contract": self.contract.to_dict(),
            "tokens": list(self.tokens),
            "first_position": self.first_position,
            "state_bytes": self.state_bytes,
            "state_sha256": self.state_sha256,
            "writer": self.writer,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write_state_file(
    path: str | os.PathLike,
    contract: CacheContract,
    tokens: list[int],
    first_position: int,
    state: bytes,
    writer: dict[str, Any],
) -> int:
    """Write ``state`` with its header to ``path`` (a temporary sibling, then a rename); returns bytes."""
    header = StateHeader(
        contract=contract,
        tokens=tuple(int(t) for t in tokens),
        first_position=int(first_position),
        state_bytes=len(state),
        state_sha256=hashlib.sha256(state).hexdigest(),
        writer=dict(writer),
    )
    blob = header.to_json()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(blob)) + blob)
            f.write(state)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write the llama.cpp state file {path}: {exc.strerror or exc}") from None
    return _PREFIX + len(blob) + len(state)


def read_state_file(
    path: str | os.PathLike, accept: Callable[[StateHeader], None] | None = None
) -> tuple[StateHeader, bytes]:
    """The header and state bytes of ``path``. ``UsageError`` for a path that is not a readable regular
    file, ``PayloadError`` for anything wrong inside it; ``accept(header)`` runs before the state bytes
    are read and may refuse by raising (a :class:`~ropekv.errors.ContractMismatch`)."""
    where = f"llama.cpp state file {os.fspath(path)}"
    f, size = open_regular(path, "llama.cpp state file")
    with f:
        if size < _PREFIX:
            raise PayloadError(f"{where}: {size} bytes, shorter than its {_PREFIX}-byte prefix (truncated?)")
        prefix = _read(f, _PREFIX, where)
        if prefix[: len(MAGIC)] != MAGIC:
            raise PayloadError(f"{where}: not a ropekv llama.cpp state file (magic {prefix[:8]!r})")
        (header_len,) = struct.unpack("<I", prefix[len(MAGIC) :])
        if header_len > min(MAX_HEADER_BYTES, size - _PREFIX):
            raise PayloadError(
                f"{where}: header of {header_len} bytes in a file of {size} (at most {MAX_HEADER_BYTES}): truncated "
                "or corrupt"
            )
        header = parse_header(_read(f, header_len, where), where)
        left = size - _PREFIX - header_len
        if header.state_bytes != left:
            raise PayloadError(
                f"{where}: the header declares {header.state_bytes} state bytes, the file holds {left} after it "
                "(truncated or corrupt)"
            )
        if accept is not None:
            accept(header)
        state = _read(f, header.state_bytes, where)
    if hashlib.sha256(state).hexdigest() != header.state_sha256:
        raise PayloadError(f"{where}: the state bytes do not match their sha256 (corrupt)")
    return header, state


def parse_header(blob: bytes, where: str) -> StateHeader:
    """A :class:`StateHeader` from its JSON, every field checked (``PayloadError`` naming the first bad one)."""
    try:
        doc = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PayloadError(f"{where}: the header is not JSON ({exc})") from None
    if not isinstance(doc, dict) or set(doc) != _FIELDS:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise PayloadError(f"{where}: the header must hold exactly {sorted(_FIELDS)}, got {got}")
    if doc["format"] != FORMAT or doc["version"] != VERSION or isinstance(doc["version"], bool):
        raise PayloadError(
            f"{where}: format {doc['format']!r} version {doc['version']!r}; this ropekv reads {FORMAT!r} {VERSION}"
        )
    tokens, first, nbytes, sha = doc["tokens"], doc["first_position"], doc["state_bytes"], doc["state_sha256"]
    if not isinstance(tokens, list) or not 1 <= len(tokens) <= MAX_TOKENS or not all(_is_index(t) for t in tokens):
        raise PayloadError(f"{where}: tokens must be 1 to {MAX_TOKENS} non-negative integers")
    if not _is_index(first) or first + len(tokens) > MAX_TOKENS:
        raise PayloadError(f"{where}: first_position must be an integer in [0, {MAX_TOKENS} - tokens], got {first!r}")
    if not _is_index(nbytes) or nbytes == 0:
        raise PayloadError(f"{where}: state_bytes must be a positive integer, got {nbytes!r}")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise PayloadError(f"{where}: state_sha256 must be 64 lowercase hex digits")
    if not isinstance(doc["writer"], dict):
        raise PayloadError(f"{where}: writer must be an object")
    try:
        contract = CacheContract.from_json(json.dumps(doc["contract"]))
    except ConfigError as exc:
        raise PayloadError(f"{where}: its contract is malformed: {exc}") from None
    return StateHeader(contract, tuple(tokens), first, nbytes, sha, doc["writer"])


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**62


def _read(f, n: int, where: str) -> bytes:
    buffer = bytearray(n)
    read_exactly(f, memoryview(buffer), where, PayloadError)
    return bytes(buffer)
