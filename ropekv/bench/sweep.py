"""What the parity sweep costs, in units of the one thing it cannot avoid: a cached prefill.

Runs in its own process (``python -m ropekv.bench.sweep``) so that its peak resident memory is the
sweep's alone. In order:

1. ``check``: :func:`ropekv.parity.harness.check` of ropekv's engine (``NativeAdapter``, rotated keys,
   the dtype given) on the default matrix, timed; the peak RSS right after is ``ropekv check``'s
   (model load included, as on the command line).
2. ``prefill``: one cached prefill of the matrix's longest case (its prompt, its chunk size), timed
   after the sweep warmed everything up.
3. ``components`` (full mode): the longest case's three parts timed alone: the float64 reference
   forward over its tokens, the engine's own full forward, and its cached run (prefill + probed
   decode steps).
4. ``naive``: the same matrix with nothing shared between cases: ``check`` called once per case, so
   each case gets its own full forwards (float64 reference and the engine's own) over exactly its
   tokens instead of a row of one shared forward per window.

Reports wall times, ``check / its parts`` (the check's time over its own float64 reference forwards,
engine full forwards and cached runs, as the harness timed them: what the checking machinery adds to
the computations no independent check can skip), ``sweep / prefill`` and ``naive / sweep``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .machine import peak_rss_bytes


def measure_sweep(
    model: str | None, *, dtype: str = "float32", naive: bool = True, max_tokens: int | None = None
) -> dict[str, Any]:
    from ..adapters.native import NativeAdapter
    from ..api import check
    from ..attention_kind import MODEL_WINDOWS
    from ..models import load_checkpoint
    from ..models.reference import ReferenceDecoder
    from ..parity.cases import default_matrix, token_stream

    t0 = time.perf_counter()
    checkpoint = load_checkpoint(model)
    load_s = time.perf_counter() - t0
    adapter = NativeAdapter(checkpoint, dtype=dtype)
    cases = default_matrix(checkpoint.config.max_position_embeddings)
    if max_tokens is not None:
        cases = [c for c in cases if c.total <= max_tokens]
    print(f"  checking {len(cases)} cases (longest {max(c.total for c in cases)} tokens)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    report = check(adapter, cases=cases, progress=True)
    check_s = time.perf_counter() - t0
    check_rss = peak_rss_bytes()

    longest = max(cases, key=lambda c: (c.length, c.total))
    engine = adapter.make_engine(longest)
    tokens = token_stream(checkpoint.config.vocab_size, longest.total)
    t0 = time.perf_counter()
    engine.prefill("longest", tokens[: longest.length], chunk_size=longest.chunk)
    prefill_s = time.perf_counter() - t0
    del engine

    components = None
    if naive:  # what the longest case costs inside the sweep, piece by piece (explains the ratio)
        print(f"  the longest case's parts alone ({longest.label()})", file=sys.stderr, flush=True)
        rows = longest.decode_positions
        window = MODEL_WINDOWS if longest.window is None else longest.window
        components = {}
        t0 = time.perf_counter()
        ReferenceDecoder(checkpoint, dtype=torch.float64).forward(
            tokens[: longest.total], probe_rows=rows, window=window, sink_tokens=longest.sink_tokens
        )
        components["float64_reference_forward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        adapter.full_forward(tokens[: longest.total], rows, longest)
        components["engine_full_forward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        adapter.run_case(longest, tokens)
        components["cached_run"] = time.perf_counter() - t0

    naive_s, per_case = None, []
    if naive:
        print(f"  naive sweep: check once per case, {len(cases)} cases", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        for case in cases:
            c0 = time.perf_counter()
            check(adapter, cases=[case])
            per_case.append({"case": case.label(), "seconds": time.perf_counter() - c0})
        naive_s = time.perf_counter() - t0
    return {
        "engine": adapter.describe().name,
        "dtype": dtype,
        "cases": [c.label() for c in cases],
        "num_cases": len(cases),
        "check_passed": report.passed,
        "load_seconds": load_s,
        "check_seconds": check_s,
        "check_case_seconds": {r.case.label(): r.seconds for r in report.cases},
        "longest_case": longest.label(),
        "longest_prefill_tokens": longest.length,
        "longest_prefill_chunk": longest.chunk,
        "longest_prefill_seconds": prefill_s,
        "longest_case_components_seconds": components,
        "naive_seconds": naive_s,
        "naive_case_seconds": per_case,
        "sweep_over_longest_prefill": check_s / prefill_s,
        # the check's own float64 reference forwards, engine full forwards and cached runs, timed inside it
        "check_phase_seconds": report.phase_seconds,
        "check_over_its_parts": check_s / sum(report.phase_seconds.values()),
        "naive_over_sweep": None if naive_s is None else naive_s / check_s,
        "check_peak_rss_bytes": check_rss,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ropekv.bench.sweep", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-naive", action="store_true", help="skip the naive sweep (quick mode)")
    p.add_argument("--max-tokens", type=int, default=None, help="only the default cases up to this many tokens")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = measure_sweep(args.model, dtype=args.dtype, naive=not args.no_naive, max_tokens=args.max_tokens)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
