"""An engine's own conversion of a transformers folder, made once per folder and kept in ropekv's cache.

onnxruntime-genai's model builder and CTranslate2's converter each turn ropekv's converted float32
folder into the format their runtime reads. :func:`converted` runs the conversion in a child process
(both print hundreds of progress lines and import torch and transformers, which a check does not
need) into ``$XDG_CACHE_HOME/ropekv/<engine>/<name>-<key>``, where ``key`` hashes the folder's
``config.json``, its weight files' names, sizes and modification times, and the converter's version.
A conversion goes to a temporary folder renamed into place when complete, so an interrupted one
leaves nothing a later check would read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError, EngineUnavailable
from ..models.embedded import cache_root

CONVERT_TIMEOUT_S = 900  # the largest model ropekv embeds converts in ~30 s; a hung converter is stopped


def folder_key(folder: Path, version: str) -> str:
    """A hash of what a conversion reads: config.json's bytes, each weight file's name, size and
    mtime, and the converter's ``version``."""
    h = hashlib.sha256(version.encode())
    config = folder / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{folder}: no config.json (a transformers folder is converted)")
    h.update(config.read_bytes())
    weights = sorted(p for p in folder.iterdir() if p.name.endswith(".safetensors"))
    if not weights:
        raise CheckpointError(f"{folder}: no .safetensors weights to convert")
    for p in weights:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def converted(
    folder: Path, *, engine: str, version: str, command: Callable[[Path, Path], list[str]], done: str
) -> Path:
    """The folder ``command(src, out)`` writes from ``folder`` (complete once it holds ``done``); run now
    if not yet. EngineUnavailable names the converter's last lines when it fails."""
    folder = Path(folder).resolve()
    final = cache_root() / engine / f"{folder.name}-{folder_key(folder, version)}"
    if (final / done).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    log = final.parent / f".{final.name}.log"
    try:
        with open(log, "w") as out:
            proc = subprocess.run(
                command(folder, tmp),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                timeout=CONVERT_TIMEOUT_S,
                check=False,
            )
        if proc.returncode != 0 or not (tmp / done).is_file():
            text = log.read_text(errors="replace").splitlines()
            tail = [line for line in text if "Saving " not in line and "Loading weights" not in line][-6:]
            raise EngineUnavailable(
                f"{engine}: converting {folder} failed (exit {proc.returncode}): " + " | ".join(tail)
            )
        try:
            os.rename(tmp, final)
        except OSError:  # another process converted it first: keep its folder
            if not (final / done).is_file():
                raise
    except subprocess.TimeoutExpired:
        raise EngineUnavailable(f"{engine}: converting {folder} ran over {CONVERT_TIMEOUT_S} s") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.unlink(missing_ok=True)
    return final
