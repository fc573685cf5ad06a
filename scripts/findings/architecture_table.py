"""The measured table of docs/architectures.md: the worst error per architecture over its swept
variants, from the figures the sweep (tests/test_architectures.py) asserts on.

    ROPEKV_ARCH_FIGURES=/tmp/arch.json .venv/bin/python -m pytest tests/test_architectures.py -k match_transformers
    .venv/bin/python scripts/findings/architecture_table.py /tmp/arch.json

Prints a markdown table; every figure is scale-aware ``max |a - b| / max(1, max |b|)`` on tiny float32
models, and each is below the sweep's 1e-5 (the test asserts it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (
    ("reference_vs_transformers", "reference vs transformers"),
    ("engine_decode_vs_reference", "engine decode vs reference"),
    ("check_attention_engine", "check attention (engine)"),
    ("check_attention_hf", "check attention (HFEngine)"),
    ("cross_engine", "cross-engine (HFEngine)"),
)


def main(path: str) -> None:
    figures = json.loads(Path(path).read_text())
    by_arch: dict[str, list[dict]] = {}
    for variant in figures.values():
        by_arch.setdefault(variant["arch"], []).append(variant)
    print("| architecture | variants | " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for arch in sorted(by_arch):
        rows = by_arch[arch]
        cells = []
        for key, _ in COLUMNS:
            values = [r[key] for r in rows if key in r]
            cells.append(f"{max(values):.1e}" if values else "-")
        print(f"| {arch} | {len(rows)} | " + " | ".join(cells) + " |")
    worst = {key: max(r.get(key, 0.0) for r in figures.values()) for key, _ in COLUMNS}
    print(
        f"\n{len(figures)} variants of {len(by_arch)} architectures; worst: "
        + ", ".join(f"{title} {worst[key]:.1e}" for key, title in COLUMNS)
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/arch.json")
