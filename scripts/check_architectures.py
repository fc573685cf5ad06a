"""``ropekv check`` with the default matrix on a tiny checkpoint of every architecture ropekv runs.

One line per configuration: the variants of tests/test_architectures.py (every architecture in
docs/architectures.md, windowed ones with their own sliding window), each windowed one again without
its window, and a few extra windows (mistral with window 12 on every layer, qwen2 with
``use_sliding_window``). A configuration passes when every judged case passes; the n/a cases are
counted and their reasons printed. Exit 1 if any configuration fails or errors.

    .venv/bin/python scripts/check_architectures.py [--only ID[,ID...]]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import build_arch_model  # noqa: E402  (the tests' tiny checkpoints)
from test_architectures import VARIANTS  # noqa: E402

from ropekv import check  # noqa: E402
from ropekv.errors import RopeKVError  # noqa: E402
from ropekv.models import load_checkpoint  # noqa: E402

WINDOW_FIELDS = ("sliding_window", "layer_types", "use_sliding_window", "max_window_layers")
EXTRA = [
    ("mistral-window-12", "mistral", {"sliding_window": 12}),
    ("qwen2-use-sliding-window", "qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
]


def configurations() -> list[tuple[str, str, dict]]:
    out = []
    for vid, arch, overrides in [*VARIANTS, *EXTRA]:
        out.append((vid, arch, overrides))
        if any(k in overrides for k in WINDOW_FIELDS):
            out.append((f"{vid} (no window)", arch, {k: v for k, v in overrides.items() if k not in WINDOW_FIELDS}))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated configuration ids")
    args = p.parse_args()
    only = set(args.only.split(",")) if args.only else None
    bad = 0
    with tempfile.TemporaryDirectory(prefix="ropekv-archs-") as tmp:
        for n, (vid, arch, overrides) in enumerate(configurations()):
            if only and vid not in only:
                continue
            t0 = time.perf_counter()
            try:
                path = Path(tmp) / f"c{n}"
                build_arch_model(arch, overrides).save_pretrained(path)
                report = check(load_checkpoint(path))
            except RopeKVError as exc:
                bad += 1
                print(f"{vid:<42} ERROR {type(exc).__name__}: {exc}", flush=True)
                continue
            na = report.not_applicable
            worst = max((r.max_attn_error or 0.0 for r in report.judged), default=0.0)
            verdict = "PASS" if report.passed else "FAIL"
            bad += not report.passed
            reasons = "; ".join(
                sorted(
                    {f"{r.case.op.label() if r.case.op else 'L=' + str(r.case.length)}: {r.not_applicable}" for r in na}
                )
            )
            print(
                f"{vid:<42} {verdict} judged {len(report.judged):>2} n/a {len(na)} worst attn {worst:.1e} "
                f"{time.perf_counter() - t0:5.1f} s" + (f"  [{reasons}]" if reasons else ""),
                flush=True,
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
