"""``ropekv bench``: decode speed against transformers and the bandwidth limit, rotate-on-read cost,
parity sweep cost, handoff throughput and cache memory, in one run (see docs/performance.md).

Prints a table; ``--json`` writes every raw figure, the machine, and the goal ratios under ``goals``.
Exit code 0 whether or not the goals are met (they are figures, not a verdict); 2 on bad input.
``--big-models 1b,3b`` runs instead the check at real model sizes (:mod:`ropekv.bench.big_model`:
minutes, and memory for the float32 model and a third more).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..argtypes import BoundedInt
from ..errors import UsageError
from .options import add_model_argument, positive_int_list, thread_count, writable_path

MAX_STEPS = 100_000  # timed decode steps per context
MAX_BANDWIDTH_MIB = 65_536  # 64 GiB: the buffer is allocated twice


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure decode speed, rotate-on-read cost, parity sweep cost, handoff and memory",
        description="Measure, in one run on one checkpoint, dtype and thread count: decode tokens/s of ropekv "
        "(both key forms) and of transformers' cached decode at several contexts, against the "
        "memory-bandwidth limit measured in the same run; the cost of the default parity sweep; "
        "handoff throughput between two local ranks against a bare send/recv; cache bytes per token.",
    )
    add_model_argument(p)
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure here as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of tokens/s against context here")
    p.add_argument(
        "--quick",
        action="store_true",
        help="contexts 128 and 1024, fewer steps, the short parity cases, no naive sweep "
        "(a smoke run; under a minute on a quiet 2-core machine)",
    )
    p.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        help="torch threads for every engine (default: torch's default, usually the core count)",
    )
    p.add_argument("--contexts", type=positive_int_list, default=None, help="decode contexts (default 128,1024,4096)")
    p.add_argument(
        "--steps",
        type=BoundedInt(1, MAX_STEPS),
        default=None,
        help=f"timed decode steps per context (at most {MAX_STEPS})",
    )
    p.add_argument(
        "--bandwidth-mib",
        type=BoundedInt(1, MAX_BANDWIDTH_MIB),
        default=None,
        help="buffer size of the bandwidth measurement (default 1024, --quick 512; keep it well "
        "above the last-level cache)",
    )
    p.add_argument(
        "--compile-rotation",
        action="store_true",
        help="rotate_on_read turns cached keys with one torch.compile'd pass (needs a C++ compiler; "
        "compiling adds 10-30 s once)",
    )
    p.add_argument(
        "--big-models",
        type=_shapes,
        default=None,
        metavar="SHAPES",
        help="instead: write random-weight checkpoints of Llama-3.2 shapes (1b, 3b; e.g. 1b,3b) and measure "
        "`ropekv check` on them (peak RSS against the engine's weights, the float64 reference's own peak); "
        "minutes, and about 7 GiB (1b) or 17 GiB (3b) of memory",
    )
    p.set_defaults(handler=run)


def _shapes(text: str) -> list[str]:
    from ..bench.big_model import shape_list

    try:
        return shape_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from ..bench.run import BenchSettings, format_table, plot, run_bench

    json_path = writable_path(args.json, "--json")
    plot_path = writable_path(args.plot, "--plot")
    if args.big_models is not None:
        from ..bench import big_model

        given = [
            flag for flag, value in (("MODEL", args.model), ("--quick", args.quick), ("--plot", args.plot)) if value
        ]
        if given:
            raise UsageError(
                f"--big-models writes and measures its own checkpoints; {', '.join(given)} "
                + ("does" if len(given) == 1 else "do")
                + " not apply"
            )
        big_model.run(args.big_models, json_path, args.threads or 2)
        return 0
    settings = BenchSettings.for_run(
        args.model,
        quick=args.quick,
        threads=args.threads,
        contexts=args.contexts,
        steps=args.steps,
        bandwidth_mib=args.bandwidth_mib,
        compile_rotation=args.compile_rotation,
    )
    doc = run_bench(settings, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(doc))
    if json_path is not None:
        json_path.write_text(json.dumps(doc, indent=1, allow_nan=False))
    if plot_path is not None:
        plot(doc, plot_path)
    return 0
