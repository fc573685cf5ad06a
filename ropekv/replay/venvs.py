"""One cached virtual environment per engine release, sharing one torch.

Layout under the replay folder (``ropekv replay --venvs DIR``; default ``$XDG_CACHE_HOME/ropekv/replay``)::

    base/                     torch and ropekv's other dependencies, pinned (BASE_PINS), installed once
    src/ropekv -> ...         a link to the ropekv package that runs the replay
    transformers-4.51.3/      the release, pinned, and what its own metadata requires beyond base
    mlx-lm-0.26.3/            mlx and mlx-cpu (MLX_PINS), the release, and the rest of its requirements

Each release venv sees ``base`` and ``src`` through a ``.pth`` file: its own site-packages come first,
so a release that needs another tokenizers or huggingface-hub gets its own copy and the rest (torch
above all, about 1 GB) is shared. pip installs from its cache and the package index only; nothing is
fetched when a check runs. A venv is complete only once its stamp (the pins it was built from) is
written; an interrupted build is rebuilt from scratch the next time, never used half-made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

# ropekv's own run-time dependencies, at the versions requirements-ci.txt pins for its .venv
# (tests/test_replay.py holds them equal). torch is the CPU build: an unpinned torch pulls a CUDA one.
BASE_PINS = (
    "torch==2.13.0",
    "numpy==2.4.6",
    "safetensors==0.8.0",
    "tqdm==4.70.1",
    "psutil==7.2.2",
    "xxhash==4.1.0",
    "gguf==0.19.0",
)
MLX_PINS = ("mlx==0.32.4", "mlx-cpu==0.32.4")  # old mlx-lm model code runs on the current mlx
PACKAGES = {"transformers": "transformers", "mlx-lm": "mlx-lm"}
STAMP = ".ropekv-replay"
INSTALL_TIMEOUT_S = 1800  # one pip install; a cold torch download is the slowest step


class InstallFailed(Exception):
    """A venv could not be built; the message is one line saying which pins and why."""


@dataclass(frozen=True)
class Venv:
    """A ready environment: its interpreter, the pins it was built from, and how long it took (0: cached)."""

    path: Path
    pins: tuple[str, ...]
    seconds: float

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def default_root() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "ropekv" / "replay"


def release_pins(engine: str, version: str) -> tuple[str, ...]:
    if engine not in PACKAGES:
        raise UsageError(f"no venv recipe for engine {engine!r}")
    pins = (f"{PACKAGES[engine]}=={version}",)
    return (*MLX_PINS, *pins) if engine == "mlx-lm" else pins


class VenvStore:
    """The replay folder: builds what is missing, reuses what is stamped with the same pins."""

    def __init__(self, root: Path, log: Callable[[str], None] = lambda _: None):
        self.root = Path(root)
        self.log = log

    def base(self) -> Venv:
        return self._ensure(self.root / "base", BASE_PINS, layered=False)

    def release(self, engine: str, version: str) -> Venv:
        self.base()
        self._link_source()
        return self._ensure(self.root / f"{engine}-{version}", release_pins(engine, version), layered=True)

    def _link_source(self) -> None:
        """``src/ropekv``: the ropekv that runs the replay, so each venv runs this very code."""
        import ropekv

        target = Path(ropekv.__file__).resolve().parent
        link = self.root / "src" / "ropekv"
        if link.is_symlink() and link.resolve() == target:
            return
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)

    def _ensure(self, path: Path, pins: tuple[str, ...], *, layered: bool) -> Venv:
        stamp = path / STAMP
        wanted = "\n".join(pins) + "\n"
        if stamp.is_file() and stamp.read_text() == wanted and (path / "bin" / "python").is_file():
            return Venv(path, pins, 0.0)
        start = time.monotonic()
        if path.exists():
            shutil.rmtree(path)  # a venv without its stamp was left half-built
        self.log(f"installing {' '.join(pins)} into {path}")
        self.root.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", str(path)], pins, timeout=300)
        if layered:
            site = _site_packages(path)
            base_site = _site_packages(self.root / "base")
            (site / "_ropekv_replay.pth").write_text(
                f"import site; site.addsitedir({str(base_site)!r})\n{self.root / 'src'}\n"
            )
        python = str(path / "bin" / "python")
        _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins], pins, INSTALL_TIMEOUT_S)
        stamp.write_text(wanted)
        return Venv(path, pins, time.monotonic() - start)


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _run(command: list[str], pins: tuple[str, ...], timeout: float) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise InstallFailed(f"installing {' '.join(pins)} ran past {timeout:.0f} s") from None
    if done.returncode != 0:
        lines = [
            line for line in (done.stderr or done.stdout).splitlines() if line.strip() and "is ignored" not in line
        ]
        reason = next((line for line in reversed(lines) if "ERROR" in line), lines[-1] if lines else "no output")
        raise InstallFailed(f"installing {' '.join(pins)} failed: {reason.strip()}")
