"""The confusion table of ropekv's engine faults: each catalogued fault run through ``ropekv.check`` at
the logits, attention and forensics tiers, and the bug class the forensics named.

    .venv/bin/python scripts/fault_confusion.py            # a tiny random llama (seconds per fault)
    .venv/bin/python scripts/fault_confusion.py --default  # the embedded SmolLM2-135M (minutes)

A fault runs on its own exposing cases (``NativeFault.exposing``) where it has them, an operation
fault on a plain and a wrapped case of its operation, the others on a small matrix that exercises
every class of the default tiny cases. Faults needing a model feature the model lacks (M-RoPE,
latent attention, ...) are listed as such, not run. A row is right when every tier fails and the
forensics name the fault's own kind.
"""

from __future__ import annotations

import argparse
import sys
import time

from ropekv import check
from ropekv.bugs.registry import ARCH_FAULTS, FAULTS
from ropekv.faults.native import OpFault
from ropekv.models.default import default_checkpoint
from ropekv.parity.cases import Case
from ropekv.parity.protocol import Tier
from ropekv.testing.tiers import at_tier
from ropekv.testing.tiny import tiny_checkpoint

TINY_CASES = [
    Case(length=1),
    Case(length=17, block_size=7),
    Case(length=30, prefix=13, block_size=7, chunk=9),
    Case(length=40, block_size=5, window=13, sink_tokens=2, chunk=9),
    Case(length=200, chunk=64, decode_steps=2),
]


def cases_for(fault) -> list[Case]:
    if fault.exposing:
        return list(fault.exposing)
    if isinstance(fault, OpFault):
        wrapped = Case(length=40, block_size=5, window=13, sink_tokens=2, op=fault.op)
        return [wrapped] if fault.needs_window else [Case(length=30, block_size=7, op=fault.op), wrapped]
    return TINY_CASES


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--default", action="store_true", help="the embedded SmolLM2-135M instead of a tiny llama")
    ap.add_argument("--only", default="", help="comma-separated fault names (default: every one)")
    args = ap.parse_args()
    ckpt = default_checkpoint() if args.default else tiny_checkpoint("llama")
    only = {n for n in args.only.split(",") if n}
    faults = {**FAULTS, **ARCH_FAULTS}
    wrong = 0
    print(f"{'fault':34s} {'expected':28s} {'named':28s} logits attention  s")
    for name, fault in faults.items():
        if only and name not in only:
            continue
        if fault.applies is not None and not fault.applies(ckpt.config):
            print(f"{name:34s} {fault.kind:28s} {'(needs ' + fault.needs + ')'}")
            continue
        start = time.perf_counter()
        adapter = fault.adapter(ckpt)
        cases = cases_for(fault)
        caught = [not check(at_tier(adapter, tier), cases=cases).passed for tier in (Tier.LOGITS, Tier.ATTENTION)]
        report = check(adapter, cases=cases)
        named = report.diagnosis.kind if report.diagnosis is not None else ("-" if report.passed else "none")
        ok = all(caught) and not report.passed and named == fault.kind
        wrong += not ok
        marks = " ".join(f"{'caught' if c else 'MISSED':9s}" for c in caught)
        print(
            f"{name:34s} {fault.kind:28s} {named:28s} {marks} {time.perf_counter() - start:4.0f}{'' if ok else '  <-'}"
        )
    print(f"{wrong} fault(s) missed or misnamed")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
