"""What a long-context check costs, against the floor of any independent check at that length.

For each length ``L``: ``ropekv check --lengths L --block-sizes 16 --prefix-offsets 0 --decode-steps S``
in its own process (wall time, peak RSS), then its three unavoidable parts, each in its own process:
the float64 reference forward over the case's tokens (the independent check itself), the engine's own
full forward (self-parity) and the cached run (prefill + probed decode steps). The goal: the check
within 1.5x of the three parts' sum, and under a peak RSS at the longest length (``--peak-rss-gib``:
8 GiB by default, the default model's goal; Gemma 3 270M at 32k has 12). Process start
and model load (paid once by the check, once by each part) are taken out of the check's time: the
least any part paid for them, shown beside it.

``python -m ropekv.bench.long_context [MODEL] --lengths 2048,4096,8190 --json PATH --plot PATH``
prints a table; ``--against OTHER`` measures a second model (an all-global twin of a sliding one, say)
at the same lengths and prints the two side by side: what a check costs where its layers attend a band
of keys against where every layer attends them all. ``--part NAME --length L`` is the per-part child
(internal).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .machine import load_average, peak_rss_bytes
from .table import grid

PARTS = ("float64_reference_forward", "engine_full_forward", "cached_run")
TARGET_OVER_FLOOR = 1.5
TARGET_PEAK_RSS = 8 << 30
MAX_LENGTH = 1 << 20  # tokens of one case; a model's own positions bound it further (the check refuses)


def _child(argv: list[str], log: Path, threads: int) -> tuple[float, int, int]:
    """Run ``argv`` with ``threads`` OpenMP threads (stderr shown: progress bars), returning wall
    seconds, peak RSS bytes and exit code."""
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return time.perf_counter() - t0, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def measure(
    model: str | None,
    lengths: list[int],
    workdir: Path,
    *,
    decode_steps: int = 2,
    peak_rss_target: int = TARGET_PEAK_RSS,
    threads: int = 2,
    progress: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
    base = [] if model is None else [str(model)]
    runs = []
    for length in lengths:
        entry: dict[str, Any] = {"length": length, "load_average_start": load_average()}
        report = workdir / f"check-{length}.json"
        progress(f"ropekv check --lengths {length} --block-sizes 16 --prefix-offsets 0 --decode-steps {decode_steps}")
        argv = [
            sys.executable,
            "-m",
            "ropekv.cli.main",
            "check",
            *base,
            "--lengths",
            str(length),
            "--block-sizes",
            "16",
            "--prefix-offsets",
            "0",
            "--decode-steps",
            str(decode_steps),
            "--json",
            str(report),
        ]
        wall, rss, code = _child(argv, workdir / f"check-{length}.log", threads)
        passed = json.loads(report.read_text()).get("passed") if report.exists() else None
        entry.update(check_seconds=wall, check_peak_rss_bytes=rss, check_exit_code=code, check_passed=passed)
        progress(f"  {wall:.1f} s, peak RSS {rss / 2**30:.2f} GiB, exit {code}")
        parts: dict[str, dict[str, Any]] = {}  # part -> its JSON record
        for part in PARTS:
            progress(f"  {part.replace('_', ' ')} alone")
            out = workdir / f"{part}-{length}.json"
            argv = [
                sys.executable,
                "-m",
                "ropekv.bench.long_context",
                *base,
                "--part",
                part,
                "--length",
                str(length),
                "--decode-steps",
                str(decode_steps),
                "--threads",
                str(threads),
                "--json",
                str(out),
            ]
            wall, rss, code = _child(argv, workdir / f"{part}-{length}.log", threads)
            inner = json.loads(out.read_text()) if out.exists() else {}
            parts[part] = {
                "seconds": inner.get("seconds"),
                "process_seconds": wall,
                "peak_rss_bytes": rss,
                "exit_code": code,
            }
            progress(f"    {inner.get('seconds', float('nan')):.1f} s, peak RSS {rss / 2**30:.2f} GiB")
        floor = sum(p["seconds"] or 0.0 for p in parts.values())
        # Process start and model load, which the check pays once like each part: the least any part paid.
        startup = min(p["process_seconds"] - (p["seconds"] or 0.0) for p in parts.values())
        work = entry["check_seconds"] - startup
        entry.update(
            parts=parts,
            floor_seconds=floor,
            startup_seconds=startup,
            check_over_floor=work / floor if floor else None,
            load_average_end=load_average(),
        )
        runs.append(entry)
    longest = runs[-1]
    return {
        "format": "ropekv.long-context",
        "version": 1,
        "threads": threads,
        "decode_steps": decode_steps,
        "runs": runs,
        "goals": {
            "check_over_floor": max(r["check_over_floor"] or 0.0 for r in runs),
            "peak_rss_bytes_at_longest": longest["check_peak_rss_bytes"],
        },
        "targets": {"check_over_floor": TARGET_OVER_FLOOR, "peak_rss_bytes_at_longest": peak_rss_target},
    }


def run_part(model: str | None, part: str, length: int, decode_steps: int) -> float:
    """One part of the check of ``Case(length, block_size=16, decode_steps)``, timed after the model load."""
    from ..adapters.native import NativeAdapter
    from ..models import load_checkpoint
    from ..models.reference import ReferenceDecoder
    from ..parity.cases import Case, token_stream

    checkpoint = load_checkpoint(model)
    case = Case(length=length, block_size=16, decode_steps=decode_steps)
    tokens = token_stream(checkpoint.config.vocab_size, case.total)
    rows = list(case.decode_positions)
    adapter = NativeAdapter(checkpoint)
    with torch.no_grad():
        if part == "float64_reference_forward":
            reference = ReferenceDecoder(checkpoint, dtype=torch.float64)
            t0 = time.perf_counter()
            reference.forward(tokens[: case.total], probe_rows=rows, logits_for="probed")  # as the check runs it
        elif part == "engine_full_forward":
            t0 = time.perf_counter()
            adapter.full_forward(tokens[: case.total], rows, case)
        else:
            t0 = time.perf_counter()
            adapter.run_case(case, tokens)
        return time.perf_counter() - t0


def format_table(doc: dict[str, Any]) -> str:
    header = [
        "context",
        "check s",
        "of it start+load",
        "check peak RSS",
        "float64 ref s",
        "engine full s",
        "cached run s",
        "floor s",
        "(check - start)/floor",
        "load at start",
    ]
    rows = []
    for r in doc["runs"]:
        p = r["parts"]
        rows.append(
            [
                str(r["length"]),
                f"{r['check_seconds']:.1f}",
                f"{r['startup_seconds']:.1f}",
                f"{r['check_peak_rss_bytes'] / 2**30:.2f} GiB",
                *(f"{p[k]['seconds']:.1f}" if p[k]["seconds"] is not None else "-" for k in PARTS),
                f"{r['floor_seconds']:.1f}",
                f"{r['check_over_floor']:.2f}x" if r["check_over_floor"] else "-",
                str(r["load_average_start"]),
            ]
        )
    lines = grid(header, rows, first_left=False)
    g, t = doc["goals"], doc["targets"]
    lines.append(
        f"check/floor at worst {g['check_over_floor']:.2f}x (target <= {t['check_over_floor']}x); "
        f"peak RSS at the longest {g['peak_rss_bytes_at_longest'] / 2**30:.2f} GiB "
        f"(target < {t['peak_rss_bytes_at_longest'] / 2**30:g} GiB)"
    )
    return "\n".join(lines)


def format_against(doc: dict[str, Any]) -> str:
    """The check's and the float64 reference's seconds per context, the model beside ``doc["against"]``."""
    other = {r["length"]: r for r in doc["against"]["runs"]}
    header = ["context", "check s", "against: check s", "ratio", "float64 ref s", "against: float64 ref s", "ratio"]
    rows = []
    for r in doc["runs"]:
        o = other.get(r["length"])
        if o is None:
            continue
        ref = r["parts"]["float64_reference_forward"]["seconds"]
        oref = o["parts"]["float64_reference_forward"]["seconds"]
        rows.append(
            [
                str(r["length"]),
                f"{r['check_seconds']:.1f}",
                f"{o['check_seconds']:.1f}",
                f"{o['check_seconds'] / r['check_seconds']:.2f}x",
                "-" if ref is None else f"{ref:.1f}",
                "-" if oref is None else f"{oref:.1f}",
                "-" if not ref or oref is None else f"{oref / ref:.2f}x",
            ]
        )
    return "\n".join(grid(header, rows, first_left=False))


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    x = [r["length"] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=120)
    a.plot(x, [r["check_seconds"] for r in runs], "o-", label="ropekv check (whole)")
    for part, style in zip(PARTS, ("s--", "^--", "v--")):
        a.plot(x, [r["parts"][part]["seconds"] for r in runs], style, label=part.replace("_", " "))
    a.plot(x, [TARGET_OVER_FLOOR * r["floor_seconds"] for r in runs], "k:", label="target: 1.5x the three parts")
    against = doc.get("against")  # the second model's whole check, at its own lengths
    o = against["runs"] if against else []
    name = Path(str(against.get("model"))).name if against else ""
    if against:
        a.plot([r["length"] for r in o], [r["check_seconds"] for r in o], "o-", color="0.55", label=f"{name}: check")
    a.set_xlabel("context (tokens)")
    a.set_ylabel("seconds")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    b.plot(x, [r["check_peak_rss_bytes"] / 2**30 for r in runs], "o-", label="ropekv check peak RSS")
    if against:
        b.plot(
            [r["length"] for r in o],
            [r["check_peak_rss_bytes"] / 2**30 for r in o],
            "o-",
            color="0.55",
            label=f"{name}: check",
        )
    b.plot(
        x,
        [r["parts"]["float64_reference_forward"]["peak_rss_bytes"] / 2**30 for r in runs],
        "s--",
        label="float64 reference alone",
    )
    target = doc["targets"]["peak_rss_bytes_at_longest"] / 2**30
    b.axhline(target, color="k", linestyle=":", label=f"target: {target:g} GiB")
    b.set_xlabel("context (tokens)")
    b.set_ylabel("GiB")
    b.set_ylim(bottom=0)
    b.legend(fontsize=7)
    b.grid(alpha=0.3)
    fig.suptitle(f"long-context check, {doc['threads']} thread(s), {doc['decode_steps']} decode steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ropekv.bench.long_context", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--lengths", default="2048,4096,8190")
    p.add_argument("--decode-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--against", default=None, help="a second model measured at the same lengths, shown beside")
    p.add_argument("--part", choices=PARTS, default=None)
    p.add_argument("--length", type=int, default=None)
    p.add_argument("--peak-rss-gib", type=float, default=TARGET_PEAK_RSS / 2**30, help="the peak RSS target (GiB)")
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if not lengths or not all(1 <= n <= MAX_LENGTH for n in lengths):
        p.error(f"--lengths must each be in 1..{MAX_LENGTH}, got {args.lengths!r}")
    if not 1 <= args.decode_steps <= 64 or not 1 <= args.threads <= 256:
        p.error("--decode-steps must be in 1..64 and --threads in 1..256")
    if not 0.1 <= args.peak_rss_gib <= 4096:  # NaN fails both comparisons
        p.error(f"--peak-rss-gib must be in 0.1..4096, got {args.peak_rss_gib}")
    torch.set_num_threads(args.threads)
    if args.part is not None:
        seconds = run_part(args.model, args.part, args.length, args.decode_steps)
        Path(args.json).write_text(json.dumps({"seconds": seconds, "peak_rss_bytes": peak_rss_bytes()}))
        return 0
    import tempfile

    docs = []
    for model in [args.model] + ([args.against] if args.against else []):
        print(f"model: {model or 'the default'}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="ropekv-long-") as tmp:
            one = measure(
                model,
                lengths,
                Path(tmp),
                decode_steps=args.decode_steps,
                peak_rss_target=int(args.peak_rss_gib * 2**30),
                threads=args.threads,
                progress=lambda m: print(m, file=sys.stderr, flush=True),
            )
        docs.append({**one, "model": model})
    doc = docs[0]
    print(format_table(doc))
    if args.against:
        doc["against"] = docs[1]
        print(f"\n{args.against}:")
        print(format_table(docs[1]))
        print()
        print(format_against(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(doc, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
