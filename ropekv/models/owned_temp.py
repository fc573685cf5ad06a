"""Temporary folders that say whether the process that made them is still alive.

A conversion writes into a temporary sibling of its destination and renames it into place. A
process killed on the way (SIGKILL, power loss) leaves the folder behind, up to the size of the
model. Each folder made here holds a lock file that its process keeps locked (``flock``) while it
works; the kernel drops the lock when the process dies, however it dies. :func:`remove_stale`
deletes the folders of a prefix whose lock nobody holds, and leaves alone every folder whose owner
still runs. A folder without a lock file (made by an older ropekv, or caught in the instant between
its creation and its lock) is deleted only when older than ``max_age_s``. Where ``fcntl`` does not
exist (Windows) the age rule is the only one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".ropekv-owner.lock"


class OwnedTemp:
    """A temporary folder ``path`` under ``parent`` whose lock this process holds until :meth:`release`."""

    def __init__(self, parent: Path, prefix: str) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        self._lock: IO[bytes] | None = None
        if fcntl is not None:
            self._lock = open(self.path / LOCK_NAME, "wb")  # noqa: SIM115 -- held for the folder's life
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX)

    def unlock_file(self) -> None:
        """Remove the lock file (still holding the lock) so the folder can be renamed into place clean."""
        (self.path / LOCK_NAME).unlink(missing_ok=True)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def remove_stale(parent: Path, prefixes: tuple[str, ...], max_age_s: float) -> list[Path]:
    """Delete the folders under ``parent`` named by ``prefixes`` whose owner process is gone; the
    folders deleted."""
    removed = []
    for prefix in prefixes:
        for folder in sorted(parent.glob(prefix + "*")):
            try:
                if folder.is_symlink() or not folder.is_dir():
                    continue
                if _owner_gone(folder, max_age_s):
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.append(folder)
            except OSError:
                continue
    return removed


def _owner_gone(folder: Path, max_age_s: float) -> bool:
    lock = folder / LOCK_NAME
    if fcntl is None or not lock.is_file():
        return time.time() - folder.stat().st_mtime > max_age_s
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its process still runs
    finally:
        os.close(fd)  # closing drops the lock taken just above
    return True
