"""Opening a file a user names, before believing anything in it: a regular file, of a size known first.

``Path.read_bytes()`` on what a user hands over reads whatever is there: a FIFO blocks forever,
``/dev/zero`` reads until the machine kills the process, a 12 GiB sparse file is a MemoryError before
a single header byte is checked. Every reader of a user's file (saved caches, handoff payloads,
checkpoints) opens it here, then reads and validates its header, then reads only what the header
declared and the size allows.

At the bottom of the package (it imports only ``errors``), so readers in every layer can use it.
"""

from __future__ import annotations

import io
import os
import stat

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
