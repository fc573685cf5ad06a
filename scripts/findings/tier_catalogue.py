"""What each tier concludes on the fault catalogue: every catalogued fault of ropekv's engine run
through the harness three times, as a logits-tier adapter (next-token logits only), an attention-tier
adapter (plus the layers) and at the forensics tier, on a tiny random llama (or --model).

    .venv/bin/python scripts/findings/tier_catalogue.py [--model DIR]
"""

from __future__ import annotations

import argparse
import dataclasses

from ropekv import check
from ropekv.bugs.registry import FAULTS, OP_FAULTS
from ropekv.models import load_checkpoint
from ropekv.models.config import Checkpoint
from ropekv.parity.cases import Case
from ropekv.parity.protocol import Tier
from ropekv.testing.tiny import tiny_checkpoint


class AtTier:
    """Any adapter, seen through a lower tier: the records the tier does not carry are dropped."""

    def __init__(self, inner, tier: Tier):
        self.inner, self.tier = inner, tier
        self.name, self.checkpoint, self.dtype = f"{inner.name} at the {tier} tier", inner.checkpoint, inner.dtype

    def describe(self):
        return self.inner.describe()

    def ignored(self, case):
        return self.inner.ignored(case)

    def run_case(self, case, tokens):
        run = self.inner.run_case(case, tokens)
        if self.tier == Tier.LOGITS:
            run = dataclasses.replace(run, steps=tuple(dataclasses.replace(s, layers=()) for s in run.steps))
        return run

    def full_forward(self, tokens, rows, case):
        run = self.inner.full_forward(tokens, rows, case)
        return dataclasses.replace(run, layers=()) if self.tier == Tier.LOGITS else run


def cases_for(fault) -> list[Case]:
    if fault.name == "slot-as-position":
        return [Case(length=30, block_size=4, window=7)]
    if fault.name == "ignored-prefix-offset":
        return [Case(length=20, prefix=13, block_size=4)]
    if fault.name == "low-precision-angles":
        return [Case(length=200, chunk=64, decode_steps=2)]
    if fault.name == "stale-dynamic-scaling":
        return [Case(length=63, block_size=16, decode_steps=3)]
    return [Case(length=17, block_size=4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: a tiny random llama)")
    args = ap.parse_args()
    if args.model:
        ckpt = load_checkpoint(args.model)
    else:
        tiny = tiny_checkpoint("llama", max_position_embeddings=1024)
        assert isinstance(tiny, Checkpoint)  # no save_to: the checkpoint in memory
        ckpt = tiny
    print(f"{'fault':<28} {'logits tier':<30} {'attention tier':<30} forensics tier")
    for fault in (f for name, f in FAULTS.items() if name not in OP_FAULTS):  # op faults need op cases
        adapter = fault.adapter(ckpt)
        cells = []
        for tier in (Tier.LOGITS, Tier.ATTENTION, Tier.FORENSICS):
            report = check(AtTier(adapter, tier) if tier != Tier.FORENSICS else adapter, cases=cases_for(fault))
            fd = next((r.first_divergence for r in report.cases if r.first_divergence), None)
            if report.passed:
                cells.append("not detected")
            elif tier == Tier.LOGITS:
                cells.append(f"detected at step {fd.step}" if fd else "detected")
            elif tier == Tier.ATTENTION:
                cells.append(f"step {fd.step}, layer {fd.layer}" if fd else "detected")
            else:
                cells.append(report.diagnosis.kind if report.diagnosis else "detected, unnamed")
        print(f"{fault.name:<28} {cells[0]:<30} {cells[1]:<30} {cells[2]}", flush=True)


if __name__ == "__main__":
    main()
