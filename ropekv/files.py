"""Opening a file a user names, before believing anything in it: a regular file, of a size known first.

``Path.read_bytes()`` on what a user hands over reads whatever is there: a FIFO blocks forever,
``/dev/zero`` reads until the machine kills the process, a 12 GiB sparse file is a MemoryError before
a single header byte is checked. Every reader of a user's file (saved caches, handoff payloads,
checkpoints) opens it here, then reads and validates its header, then reads only what the header
declared and the size allows.

Small JSON files (configs, records) are read whole with :func:`read_json`: a regular file, at most
``max_bytes``, nested at most ``max_depth`` deep (checked before parsing: a document nested 100,000 deep
is a RecursionError inside ``json``), every OS error (a file of another user's, mode 0600) one typed error.

At the bottom of the package (it imports only ``errors``), so readers in every layer can use it.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import stat
from typing import Any

from .errors import RopeKVError, UsageError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What ``st_mode`` describes, in words (``"a FIFO"``); ``"a regular file"`` for one."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def open_regular(path: str | os.PathLike, what: str, error: type[RopeKVError] = UsageError) -> tuple[io.FileIO, int]:
    """Open ``path`` for reading if it is a regular file; returns ``(file, size in bytes)``.

    Opened non-blocking and checked with ``fstat`` on the open descriptor, so a FIFO is refused instead
    of waiting for a writer, and what is checked is what is read (no race between a stat and an open).
    Raises ``error`` (``"cannot read the {what} {path}: ..."``) for anything else, or when it cannot be
    opened at all. The caller closes the file (it is a context manager)."""
    where = f"cannot read the {what} {os.fspath(path)}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{where}: {exc.strerror or exc}") from None
    except (TypeError, ValueError) as exc:  # a path with a NUL byte, a non-path
        raise error(f"{where}: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{where}: not a regular file ({file_kind(st.st_mode)})")
        os.set_blocking(fd, True)
        return io.FileIO(fd, "rb", closefd=True), st.st_size
    except BaseException:
        os.close(fd)
        raise


def regular_file_size(path: str | os.PathLike, what: str, error: type[RopeKVError] = UsageError) -> int:
    """The size of ``path`` if it is a regular file (symlinks followed), else ``error``: for readers that
    open the file through a library (``safetensors.safe_open``, ``mmap``) after this check."""
    where = f"cannot read the {what} {os.fspath(path)}"
    try:
        st = os.stat(path)
    except OSError as exc:
        raise error(f"{where}: {exc.strerror or exc}") from None
    except (TypeError, ValueError) as exc:
        raise error(f"{where}: {exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{where}: not a regular file ({file_kind(st.st_mode)})")
    return st.st_size


def read_exactly(f: io.RawIOBase, buffer: memoryview, where: str, error: type[RopeKVError]) -> None:
    """Fill ``buffer`` from ``f``; a file that ends first (it shrank after its size was taken) is ``error``."""
    done = 0
    while done < len(buffer):
        got = f.readinto(buffer[done:])
        if not got:
            raise error(f"{where}: the file ended after {done} of {len(buffer)} byte(s) (changed while reading?)")
        done += got


MAX_JSON_BYTES = 64 << 20  # 64 MiB: far above any config or record ropekv reads (a tokenizer.json is ~2-10 MB)
MAX_JSON_DEPTH = 100  # a transformers config nests 4 or 5 deep; json's C parser recurses per level

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _DEPTH_STEP)


def read_bounded(path: str | os.PathLike, what: str, error: type[RopeKVError] = UsageError, *, max_bytes: int) -> bytes:
    """The whole of ``path``, a regular file of at most ``max_bytes`` (else ``error``, one line)."""
    f, size = open_regular(path, what, error)
    with f:
        where = f"cannot read the {what} {os.fspath(path)}"
        if size > max_bytes:
            raise error(f"{os.fspath(path)}: implausibly large for a {what} ({size} bytes; at most {max_bytes})")
        buffer = bytearray(size)
        try:
            read_exactly(f, memoryview(buffer), where, error)
        except OSError as exc:
            raise error(f"{where}: {exc.strerror or exc}") from None
        return bytes(buffer)


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``raw`` nest (brackets inside strings ignored)."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(_DEPTH_STEP[b] for b in brackets), default=0)


def read_json(
    path: str | os.PathLike,
    what: str,
    error: type[RopeKVError] = UsageError,
    *,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """The JSON document in ``path``, read by :func:`read_bounded` and nested at most ``max_depth`` deep;
    anything else (not a regular file, unreadable, too large, too deep, not UTF-8 JSON) is ``error``."""
    raw = read_bounded(path, what, error, max_bytes=max_bytes)
    depth = json_depth(raw)
    if depth > max_depth:
        raise error(
            f"{os.fspath(path)}: not valid JSON: nested {depth} deep, more than the {max_depth} a {what} may nest"
        )
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, an int over Python's digit limit
        raise error(f"{os.fspath(path)}: not valid JSON: {' '.join(str(exc).splitlines())[:200]}") from None
