"""What ``ropekv check --engine E`` costs, against its parts, for each engine in a row.

The parts of a check are what no check of that engine can skip:
- the engine's start: building its adapter (reading the model, starting the engine), once per check;
- the engine's own forwards for the cases: the report's ``cached_runs`` and ``engine_full_forwards``;
- the float64 reference: the report's ``float64_reference_forwards`` (0 on a reference-cache hit).

Each engine's check runs in its own venv (``.venv`` for ropekv and hf, ``.venv-vllm``, ``.venv-mlx``,
``.venv-llamacpp``), as a process of its own, timed on the wall. A second process in the same venv
builds the engine alone: its in-process time is the start; the rest of its wall time is the
interpreter and the imports, which the check pays as well and which are taken out of the check's time
(as the long-context bench does). With ``--reference-cache DIR`` (one folder for every engine) the
first check computes the reference and the others read it back.

``python -m ropekv.bench.engine_checks [MODEL] [--engines ropekv,hf,vllm,mlx,llamacpp]
[--reference-cache DIR] [--check-args "--lengths 33,100 ..."] [--json PATH]``; ``--start-only ENGINE`` is the child that builds one engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..adapters.registry import ENGINES
from .table import grid

TARGET_OVER_PARTS = 1.5
ROOT = Path(__file__).resolve().parents[2]


def _python(engine: str) -> Path:
    venv = ENGINES[engine].venv or ".venv"
    return ROOT / venv / "bin" / "python"


def start_engine(engine: str, model: str | None) -> float:
    """Seconds to build ``engine``'s adapter as ``ropekv check --engine ENGINE [MODEL]`` builds it."""
    from ..adapters.registry import engine_module
    from ..cli.check_cmd import build_adapter
    from ..cli.main import build_parser

    args = build_parser().parse_args(["check", "--engine", engine, *([model] if model else [])])
    module = engine_module(engine) if ENGINES[engine].venv is not None else None
    t0 = time.perf_counter()
    build_adapter(args, module=module)
    return time.perf_counter() - t0


def _timed(argv: list[str], log: Path) -> tuple[float, int]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    return time.perf_counter() - t0, code


def measure_engine(
    engine: str, model: str | None, work: Path, store: str | None, check_args: list[str] | None = None
) -> dict[str, Any]:
    py = str(_python(engine))
    if not Path(py).exists():
        return {"engine": engine, "error": f"{py} not found (make setup-{engine})"}
    report = work / f"check-{engine}.json"
    argv = [py, "-m", "ropekv.cli.main", "check", "--engine", engine, *([model] if model else [])]
    argv += [*(check_args or []), "--json", str(report), "--no-progress"]
    argv += ["--reference-cache", store] if store else []
    wall, code = _timed(argv, work / f"check-{engine}.log")
    doc = json.loads(report.read_text()) if report.exists() else {}
    start_json = work / f"start-{engine}.json"
    start_argv = [py, "-m", "ropekv.bench.engine_checks", *([model] if model else [])]
    start_wall, start_code = _timed(
        start_argv + ["--start-only", engine, "--json", str(start_json)], work / f"start-{engine}.log"
    )
    start = json.loads(start_json.read_text())["seconds"] if start_json.exists() else None
    phases = doc.get("phase_seconds", {})
    cases = doc.get("cases", [])
    entry: dict[str, Any] = {
        "engine": engine,
        "check_seconds": wall,
        "check_exit_code": code,
        "passed": doc.get("passed"),
        "cases": len(cases),
        "judged": sum(1 for c in cases if c.get("not_applicable") is None),
        "engine_start_seconds": start,
        "start_exit_code": start_code,
        "interpreter_and_imports_seconds": None if start is None else start_wall - start,
        "phase_seconds": phases,
        "reference_cache": doc.get("reference_cache"),
        "harness_seconds": None if not doc else doc["seconds"] - sum(phases.values()),
    }
    if start is not None and phases:
        parts = start + sum(phases.values())
        work_s = wall - entry["interpreter_and_imports_seconds"]
        entry.update(parts_seconds=parts, check_over_parts=work_s / parts)
    return entry


def format_table(runs: list[dict[str, Any]]) -> str:
    header = ["engine", "result", "check s", "imports s", "start s", "ref s", "cached s", "full s", "harness s"]
    header += ["(check - imports)/parts", "reference"]
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([r["engine"], r["error"]] + [""] * (len(header) - 2))
            continue
        p = r["phase_seconds"]
        cache = r["reference_cache"]
        source = "-" if cache is None else f"{cache['hits']} hit(s), {cache['computed'] + cache['recomputed']} computed"
        result = {True: "PASS", False: "FAIL", None: f"exit {r['check_exit_code']}"}[r["passed"]]

        def s(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        rows.append(
            [
                r["engine"],
                f"{result} ({r['judged']}/{r['cases']})",
                s(r["check_seconds"]),
                s(r["interpreter_and_imports_seconds"]),
                s(r["engine_start_seconds"]),
                s(p.get("float64_reference_forwards")),
                s(p.get("cached_runs")),
                s(p.get("engine_full_forwards")),
                s(r["harness_seconds"]),
                f"{r['check_over_parts']:.2f}x" if "check_over_parts" in r else "-",
                source,
            ]
        )
    lines = grid(header, rows, first_left=False)
    ratios = [r["check_over_parts"] for r in runs if "check_over_parts" in r]
    if ratios:
        worst = max(ratios)
        verdict = "met" if worst <= TARGET_OVER_PARTS else "MISSED"
        lines.append(f"check over its parts at worst {worst:.2f}x (target <= {TARGET_OVER_PARTS}x): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ropekv.bench.engine_checks", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--engines", default="ropekv,hf,vllm,mlx,llamacpp")
    p.add_argument("--reference-cache", default=None, help="one folder shared by every engine's check")
    p.add_argument("--check-args", default="", help="case flags given to every engine's check (default: none)")
    p.add_argument("--json", default=None)
    p.add_argument("--start-only", choices=list(ENGINES), default=None)
    args = p.parse_args(argv)
    if args.start_only is not None:
        seconds = start_engine(args.start_only, args.model)
        Path(args.json).write_text(json.dumps({"seconds": seconds}))
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="ropekv-engines-") as tmp:
        for engine in engines:
            print(f"ropekv check --engine {engine}", file=sys.stderr, flush=True)
            runs.append(
                measure_engine(engine, args.model, Path(tmp), args.reference_cache, shlex.split(args.check_args))
            )
            r = runs[-1]
            print(f"  {r.get('check_seconds', float('nan')):.1f} s, exit {r.get('check_exit_code')}", file=sys.stderr)
    print(format_table(runs))
    if args.json:
        doc = {"format": "ropekv.engine-checks", "version": 1, "model": args.model, "check_args": args.check_args}
        doc["runs"] = runs
        doc["target_over_parts"] = TARGET_OVER_PARTS
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
