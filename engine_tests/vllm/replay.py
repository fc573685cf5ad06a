"""An adapter that replays one engine's recorded results at a chosen tier, so one vLLM run of a case
can be judged by the harness at the logits, attention and forensics tiers without running it three
times. Below the attention tier the per-layer probes are dropped, as a logits-only adapter has none.
"""

from __future__ import annotations

import dataclasses

from ropekv.parity.protocol import Tier


class Replay:
    def __init__(self, engine, tier: Tier):
        self.engine, self.tier = engine, tier
        self.name = f"{engine.name} replayed at the {tier.value} tier"
        self.checkpoint, self.dtype = engine.checkpoint, engine.dtype
        self._runs: dict = {}
        self._full: dict = {}

    def with_tier(self, tier: Tier) -> Replay:
        other = Replay(self.engine, tier)
        other._runs, other._full = self._runs, self._full
        return other

    def describe(self):
        return self.engine.describe()

    def ignored(self, case):
        return self.engine.ignored(case)

    def run_case(self, case, tokens):
        if case not in self._runs:
            self._runs[case] = self.engine.run_case(case, tokens)
        run = self._runs[case]
        if self.tier == Tier.LOGITS:
            run = dataclasses.replace(run, steps=tuple(dataclasses.replace(s, layers=()) for s in run.steps))
        return run

    def full_forward(self, tokens, rows, case):
        key = (int(tokens.numel()), tuple(rows))
        if key not in self._full:
            self._full[key] = self.engine.full_forward(tokens, rows, case)
        full = self._full[key]
        return dataclasses.replace(full, layers=()) if self.tier == Tier.LOGITS else full
