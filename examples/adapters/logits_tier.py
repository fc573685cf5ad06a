"""A complete logits-tier adapter: a transformers causal LM decoding with its own DynamicCache."""

import torch
from transformers import DynamicCache

from ropekv.models.config import Checkpoint
from ropekv.models.hf_config import read_model_config
from ropekv.parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, StepRecord, Tier


class MyEngine:
    tier = Tier.LOGITS  # next-token logits only: ropekv localizes a divergence to a decode step

    def __init__(self, model, name="my-engine"):
        self.model, self.name, self.dtype = model, name, next(model.parameters()).dtype
        self.checkpoint = Checkpoint.from_tensors(
            read_model_config(model.config.to_dict(), source=name), model.state_dict(), source=name
        )

    def describe(self):  # the facts the harness reads are typed; the rest goes to the report as it is
        return EngineDescription(name=self.name, key_form="rotated", extra={"cache": "DynamicCache"})

    def ignored(self, case):  # what this engine cannot honour is reported, never dropped silently
        prefix = (Ignored("prefix", "prefix served by prefill, no prefix cache"),) if case.prefix else ()
        return (Ignored("block_size"),) + prefix

    @torch.no_grad()
    def forward(self, ids, start, cache):  # logits [n, vocab] of ids at positions start..start+n-1
        positions = torch.arange(start, start + len(ids))[None]
        return self.model(
            input_ids=ids[None], position_ids=positions, past_key_values=cache, use_cache=cache is not None
        ).logits[0]

    def decode(self, token, t, cache):  # one decode step: the token at position t
        return StepRecord(position=t, logits=self.forward(token, t, cache)[-1])

    def new_cache(self):  # as generate() builds it: sliding layers keep only their window
        return DynamicCache(config=self.model.config)

    def run_case(self, case, tokens):
        cache, prompt = self.new_cache(), tokens[: case.prefix + case.length]
        chunk = case.chunk or len(prompt)
        for i in range(0, len(prompt), chunk):  # chunked prefill
            self.forward(prompt[i : i + chunk], i, cache)
        return CaseRun(tuple(self.decode(tokens[t : t + 1], t, cache) for t in case.decode_positions))

    def full_forward(self, tokens, rows, case):
        return FullRun(rows=torch.tensor(rows), logits=self.forward(tokens, 0, None)[rows])
