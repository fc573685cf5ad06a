"""Where a report came from: versions, machine, the call, the time (docs/report.md, ``provenance``)."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
from typing import Any

import torch


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what platform knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(call: str) -> dict[str, Any]:
    """JSON-able facts: package versions (ropekv, torch, transformers where installed), Python, the
    machine (CPU model, logical CPUs, torch threads), ``call`` (the API call or command line) and a UTC
    timestamp. The CLI adds ``command`` and ``exit_code``."""
    return {
        "ropekv": _version("ropekv"),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "call": call,
        "utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
