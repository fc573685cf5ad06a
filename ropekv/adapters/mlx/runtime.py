"""Importing MLX with an optimized BLAS: the one place ropekv touches the engine's packages at import.

The ``mlx-cpu`` wheel links the reference (netlib) BLAS and LAPACK it bundles
(``mlx_cpu.libs/libblas-*.so.3``): on these machines a 600-token SmolLM2 forward takes about 145 s
with it and about 10 s with OpenBLAS. ``libmlx.so`` imports ``cblas_sgemm`` & co. without symbol
versions, so a BLAS loaded into the process's global scope *before* ``mlx.core`` resolves them first
(the dynamic linker searches the global scope before a library's own dependencies). That is what
``LD_PRELOAD`` does; :func:`import_mlx` does the same with ``ctypes.CDLL(..., RTLD_GLOBAL)`` so that
``ropekv check --engine mlx`` is fast without an environment variable.

The OpenBLAS comes from Debian's ``libopenblas0-pthread``, installed by ``scripts/setup-mlx.sh``.
PyPI has no drop-in: ``scipy-openblas32``/``64`` prefix every symbol (``scipy_cblas_sgemm``) and
``cmeel-openblas`` needs a system ``libgfortran.so.5`` it does not ship (docs/engines/mlx.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

from ...errors import EngineUnavailable
from .versions import require_supported

BlasChoice = Literal["openblas", "bundled"]

# Debian's path for the pthread flavour; ld.so.cache's ``libopenblas.so.0`` (alternatives) is the fallback.
DEBIAN_OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
SETUP_HINT = "run `make setup-mlx` (scripts/setup-mlx.sh installs Debian's libopenblas0-pthread)"


@dataclass(frozen=True)
class MLXRuntime:
    """The imported engine modules and the BLAS they run on."""

    mx: ModuleType  # mlx.core
    nn: ModuleType  # mlx.nn
    mlx_lm: ModuleType  # mlx_lm
    cache: ModuleType  # mlx_lm.models.cache
    utils: ModuleType  # mlx_lm.utils
    blas: str  # path of the BLAS library mlx resolves cblas_sgemm to ("bundled": the wheel's netlib)
    versions: dict[str, str]


_RUNTIME: MLXRuntime | None = None


def openblas_path() -> Path | None:
    """Debian's pthread OpenBLAS, else whatever ``libopenblas.so.0`` the loader cache names; None if neither."""
    if DEBIAN_OPENBLAS.is_file():
        return DEBIAN_OPENBLAS
    found = ctypes.util.find_library("openblas")
    return Path(found) if found else None


def import_mlx(blas: BlasChoice = "openblas") -> MLXRuntime:
    """Import mlx and mlx-lm once per process, first loading OpenBLAS globally (``blas="openblas"``).

    Raises :class:`EngineUnavailable` when mlx-lm is missing, when OpenBLAS is asked for but absent, or
    when mlx was already imported by someone else with another BLAS than the one asked for (the choice
    is per process and cannot be undone)."""
    global _RUNTIME
    if blas not in ("openblas", "bundled"):
        raise EngineUnavailable(f"mlx: blas must be 'openblas' or 'bundled', got {blas!r}")
    if _RUNTIME is not None:
        if (blas == "bundled") != (_RUNTIME.blas == "bundled"):
            raise EngineUnavailable(
                f"mlx was already imported in this process with BLAS {_RUNTIME.blas}; blas={blas!r} needs a new process"
            )
        return _RUNTIME
    # mlx itself first: where it is not installed, that is the one thing to say (not a missing BLAS).
    import importlib.util

    missing = [m for m in ("mlx", "mlx_lm") if importlib.util.find_spec(m) is None]
    if missing:
        raise EngineUnavailable(
            f"engine 'mlx' is not available in this environment (run it from .venv-mlx: make setup-mlx): "
            f"{', '.join(missing)} not installed"
        )
    path = "bundled"
    if blas == "openblas" and sys.platform.startswith("linux"):
        if "mlx.core" in sys.modules:
            raise EngineUnavailable(
                "mlx.core was imported before ropekv could load OpenBLAS under it; "
                "import ropekv.adapters.mlx first, or pass blas='bundled'"
            )
        lib = openblas_path()
        if lib is None:
            raise EngineUnavailable(
                f"mlx: no OpenBLAS found ({DEBIAN_OPENBLAS} or libopenblas.so.0); {SETUP_HINT}, "
                "or pass --mlx-blas bundled to accept the wheel's reference BLAS (10-15x slower)"
            )
        try:
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise EngineUnavailable(f"mlx: cannot load {lib}: {exc}; {SETUP_HINT}") from None
        path = str(lib)
    try:
        import mlx.core as mx
        import mlx.nn as nn
        import mlx_lm
        import mlx_lm.models.cache as cache
        import mlx_lm.utils as utils
    except ImportError as exc:
        raise EngineUnavailable(
            f"engine 'mlx' is not available in this environment (run it from .venv-mlx: make setup-mlx): {exc}"
        ) from None
    import importlib.metadata as md

    versions = {name: md.version(name) for name in ("mlx", "mlx-lm")}
    require_supported(versions["mlx-lm"])
    _RUNTIME = MLXRuntime(mx=mx, nn=nn, mlx_lm=mlx_lm, cache=cache, utils=utils, blas=path, versions=versions)
    return _RUNTIME
