"""The machine a benchmark ran on, and how busy it was: every figure is only as good as these facts."""

from __future__ import annotations

import os
import platform
import resource
import sys
from pathlib import Path
from typing import Any

import torch


def machine_facts(threads: int) -> dict[str, Any]:
    """CPU model, cores, memory, caches, library versions and the thread count every engine used."""
    import psutil

    facts: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "caches": _caches(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
    }
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except ImportError:  # the baseline is then skipped, and says so
        facts["transformers"] = None
    return facts


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: a busy machine (other processes on the same cores) slows every
    engine, and oversubscribed OpenMP threads slow them very unevenly; the report keeps this beside
    the figures."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _caches() -> dict[str, int]:
    """Cache sizes in bytes by level/type from sysfs (cpu0), e.g. ``{"L1d": 49152, "L3": 314572800}``."""
    out: dict[str, int] = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return out
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            level, kind, size = (
                Path(f"{base}/{entry}/{leaf}").read_text().strip() for leaf in ("level", "type", "size")
            )
        except OSError:
            continue
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        out[name] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return out
