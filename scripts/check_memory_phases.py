"""Where a check's memory goes: its resident set sampled through each phase of ``ropekv.check``.

Runs one check in this process under a sampling thread. Every ``--every`` seconds the thread reads the
process's resident set (``/proc/self/statm``) and the main thread's stack, and names the phase by the
innermost harness function on it:

- ``cached_run``: the adapter's ``run_case`` (the engine's cached prefill and decode);
- ``reference``: the float64 reference decoder (its weight copy and its forwards);
- ``engine_full_forward``: the adapter's ``full_forward`` (the engine's own uncached forward);
- ``rows``: the harness taking the probed rows (per layer, attention logits by position) from a forward;
- ``compare``: the harness's comparison of the runs' rows;
- ``setup``: loading the checkpoint and building the engine, before the first case;
- ``other``: anything else (the report, the token stream).

It prints, per phase, the resident set when the phase was first seen, its peak, and where (the
innermost ropekv frame) the peak was sampled. Example (Gemma 3 270M at 32,766 tokens, about half an
hour on 2 cores)::

    python scripts/check_memory_phases.py gemma3-270m --lengths 32766 --json docs/img/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

PAGE = os.sysconf("SC_PAGE_SIZE")
GIB = 2**30

# innermost match wins: (phase, a test on a frame's function name and file)
_PHASES: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("compare", lambda fn, path: fn == "compare_step"),
    ("rows", lambda fn, path: fn == "_row" and path.endswith("harness.py")),
    ("engine_full_forward", lambda fn, path: fn == "full_forward" and "adapters" in path),
    ("reference", lambda fn, path: "reference" in path and "parity" not in path),
    ("reference", lambda fn, path: fn == "decoder" and path.endswith("harness.py")),
    ("cached_run", lambda fn, path: fn == "run_case" and "adapters" in path),
    ("setup", lambda fn, path: fn in ("_as_adapter", "load_checkpoint", "resolve_checkpoint")),
)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def phase_of(frame: FrameType | None) -> tuple[str, str]:
    """The phase of the innermost matching frame and the innermost ropekv frame, as text."""
    phase, where = "other", ""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    for f in frames:  # innermost first
        code = f.f_code
        if not where and "ropekv" in code.co_filename:
            where = f"{os.path.relpath(code.co_filename)}:{f.f_lineno} {code.co_name}"
        for name, test in _PHASES:
            if test(code.co_name, code.co_filename):
                return name, where
    return phase, where


class Sampler(threading.Thread):
    def __init__(self, every: float):
        super().__init__(daemon=True)
        self.every, self.main = every, threading.main_thread().ident
        self.stop = threading.Event()
        self.phases: dict[str, dict[str, object]] = {}
        self.order: list[str] = []
        self.peak = (0, "", "")

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.every)

    def sample(self) -> None:
        frame = sys._current_frames().get(self.main)
        phase, where = phase_of(frame)
        rss = rss_bytes()
        p = self.phases.get(phase)
        if p is None:
            p = self.phases[phase] = {"first_gib": rss / GIB, "peak_gib": 0.0, "peak_at": "", "samples": 0}
            self.order.append(phase)
        p["samples"] = int(p["samples"]) + 1  # type: ignore[call-overload]
        if rss / GIB > float(p["peak_gib"]):  # type: ignore[arg-type]
            p["peak_gib"], p["peak_at"] = rss / GIB, where
        if rss > self.peak[0]:
            self.peak = (rss, phase, where)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a checkpoint name or path, as `ropekv check` takes it")
    ap.add_argument("--lengths", default="32766")
    ap.add_argument("--block-sizes", default="16")
    ap.add_argument("--prefix-offsets", default="0")
    ap.add_argument("--decode-steps", type=int, default=2)
    ap.add_argument("--every", type=float, default=0.1, help="seconds between samples")
    ap.add_argument("--json", help="write the phases here")
    args = ap.parse_args()

    sampler = Sampler(args.every)
    sampler.start()
    t0 = time.perf_counter()
    import ropekv  # imported under the sampler: the import is part of the base
    from ropekv.models import load_checkpoint

    report = ropekv.check(
        load_checkpoint(args.model),
        lengths=[int(x) for x in args.lengths.split(",")],
        block_sizes=[int(x) for x in args.block_sizes.split(",")],
        prefix_offsets=[int(x) for x in args.prefix_offsets.split(",")],
        decode_steps=args.decode_steps,
    )
    seconds = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    print(f"{'PASS' if report.passed else 'FAIL'} in {seconds:.0f} s; phases in the order first seen:")
    print(f"{'phase':<20} {'first GiB':>9} {'peak GiB':>9}  peak sampled at")
    for name in sampler.order:
        p = sampler.phases[name]
        print(f"{name:<20} {p['first_gib']:>9.2f} {p['peak_gib']:>9.2f}  {p['peak_at']}")
    rss, phase, where = sampler.peak
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the kernel's peak (kB), between samples too
    print(f"peak sampled {rss / GIB:.2f} GiB in {phase} at {where}; the process's peak RSS {hwm / GIB:.2f} GiB")
    if args.json:
        out = {
            "model": args.model,
            "lengths": args.lengths,
            "passed": report.passed,
            "seconds": seconds,
            "every_s": args.every,
            "phases": {n: sampler.phases[n] for n in sampler.order},
            "peak_gib": rss / GIB,
            "max_rss_gib": hwm / GIB,
            "peak_phase": phase,
            "peak_at": where,
            "phase_seconds": report.phase_seconds,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
