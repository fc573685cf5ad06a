"""An attention-tier adapter: the logits-tier one plus what its attention kernel multiplied."""

import dataclasses

import torch
from logits_tier import MyEngine
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ropekv.parity.protocol import Tier
from ropekv.parity.recorder import AttentionRecorder


class MyAttentionEngine(MyEngine):
    tier = Tier.ATTENTION  # ropekv now names the first divergent layer

    def __init__(self, model, name="my-engine"):
        kinds = set(getattr(model.config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
        if kinds:  # chunked or linear layers: their keys are not the last N positions; refuse, never mislabel
            raise NotImplementedError(f"this example labels full and sliding layers only, not {sorted(kinds)}")
        super().__init__(model, name)
        self.recorder = AttentionRecorder(model.config.num_hidden_layers)
        name = f"recorded_{id(self)}"  # one name per engine; the mask builder must be registered too, or a
        AttentionInterface.register(name, self.attention)  # chunked prefill gets sdpa's top-left causal mask
        AttentionMaskInterface.register(name, sdpa_mask)
        model.set_attn_implementation(name)

    def attention(self, module, query, key, value, mask, **kwargs):
        # query [1, H, n, D], key [1, KVH, N, D]: exactly what the kernel gets (after RoPE and the cache
        # update). A DynamicCache layer hands over the last N of the tokens it has seen, in order: all of
        # them (a full layer) or its window's (a sliding layer). Label them so, never 0..N-1.
        q, k = query[0].transpose(0, 1), key[0].transpose(0, 1)  # [n, H, D], [N, KVH, D]
        seen = k.shape[0] if self.cache is None else self.cache.get_seq_length(module.layer_idx)
        positions = torch.arange(seen - k.shape[0], seen)
        if q.shape[0] == 1 and mask is not None:  # a decode row records only the keys its mask shows
            if mask.dtype != torch.bool or mask.shape[-1] != k.shape[0]:
                raise NotImplementedError(f"expected sdpa_mask's boolean [.., {k.shape[0]}] mask, got {mask.dtype}")
            shown = mask[0, 0, -1]  # [N]
            k, positions = k[shown], positions[shown]
        self.recorder.record(module.layer_idx, q=q, k=k, key_positions=positions)
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    def forward(self, ids, start, cache):
        self.cache = cache  # the attention hook reads how many tokens each layer has seen
        return super().forward(ids, start, cache)

    def decode(self, token, t, cache):
        self.recorder.clear()
        step = super().decode(token, t, cache)
        return dataclasses.replace(step, layers=self.recorder.take())

    def full_forward(self, tokens, rows, case):
        self.recorder.clear()
        run = super().full_forward(tokens, rows, case)
        layers = tuple(dataclasses.replace(p, q=p.q[rows]) for p in self.recorder.take())  # q at the rows
        return dataclasses.replace(run, layers=layers)
