"""The record of ropekv's forensics on bugs its catalogue does not hold: every generated variant
(:func:`ropekv.faults.variants.generated`: each class's bug in other amounts, functions of position,
subsets of phases, heads and layers) run through ``ropekv.check`` at the forensics tier, and the class
named; then the controls, whose cases cannot show their fault and must pass.

    .venv/bin/python scripts/forensics_confusion.py            # a tiny random llama (about 5 s a variant)
    .venv/bin/python scripts/forensics_confusion.py --default  # the embedded SmolLM2-135M
    .venv/bin/python scripts/forensics_confusion.py --only key_position_offset

A variant is right when the check fails and names its class; a control is right when it passes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from ropekv import check
from ropekv.faults.variants import generated
from ropekv.models.default import default_checkpoint
from ropekv.testing.tiny import tiny_checkpoint


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--default", action="store_true", help="the embedded SmolLM2-135M instead of a tiny llama")
    ap.add_argument("--only", default="", help="run the variants whose name contains this text")
    ap.add_argument("--evidence", action="store_true", help="print each diagnosis's evidence under its row")
    args = ap.parse_args()
    ckpt = default_checkpoint() if args.default else tiny_checkpoint("llama")
    tally: Counter[str] = Counter()
    print(f"{'variant':72s} {'named':28s}    s")
    for v in generated():
        if args.only and args.only not in v.name:
            continue
        start = time.perf_counter()
        report = check(v.fault.adapter(ckpt), cases=list(v.cases))
        d = report.diagnosis
        named = "PASS" if report.passed else (d.kind.value if d is not None else "none")
        want = "PASS" if v.expect is None else v.expect.value
        outcome = (
            ("control passed" if v.expect is None else "named right")
            if named == want
            else ("control FAILED" if v.expect is None else "missed" if report.passed else "misnamed")
        )
        tally[outcome] += 1
        mark = "" if named == want else "  <- " + outcome
        print(f"{v.name[:72]:72s} {named:28s} {time.perf_counter() - start:4.0f}{mark}", flush=True)
        if args.evidence and d is not None:
            print(f"    {d.evidence[:300]}")
    variants = sum(n for k, n in tally.items() if not k.startswith("control"))
    controls = tally["control passed"] + tally["control FAILED"]
    print(
        f"{tally['named right']} of {variants} variants named right ({tally['misnamed']} misnamed, "
        f"{tally['missed']} missed); {tally['control passed']} of {controls} controls passed"
    )
    return 0 if tally["named right"] == variants and tally["control passed"] == controls else 1


if __name__ == "__main__":
    sys.exit(main())
