"""Bytes the paged cache holds per cached token, against the ideal.

Ideal: ``layers x 2 x kv_heads x head_dim x dtype size`` per token (keys and values, nothing else).
Held: every block a sequence occupies (a partly filled last block counts whole) in every layer of
its group, plus the per-slot logical positions (int64) of those blocks. The bound docs/performance.md sets is
5% over the ideal plus one partly filled block per sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine import Engine


def cache_bytes(engine: Engine, seq_id) -> dict[str, Any]:
    cache, c = engine.cache, engine.contract
    n = cache.num_tokens(seq_id)
    itemsize = torch.empty(0, dtype=c.torch_dtype).element_size()
    per_token_layer = 2 * c.num_kv_heads * c.head_dim * itemsize
    ideal = 0
    held = 0
    one_block = 0
    position_bytes = torch.empty(0, dtype=torch.int64).element_size()
    for group in cache.groups:
        blocks = len(cache.block_table(seq_id, group))
        layers = [i for i in range(c.num_layers) if cache.layer_group(i) == group]
        live = n if group == "full" else min(n, (c.window or n) + c.sink_tokens)
        ideal += live * per_token_layer * len(layers)
        held += blocks * c.block_size * (per_token_layer * len(layers) + position_bytes)
        one_block += c.block_size * per_token_layer * len(layers)
    bound = 1.05 * ideal + one_block
    return {
        "tokens": n,
        "block_size": c.block_size,
        "dtype": c.dtype,
        "ideal_bytes_per_token": ideal / n,
        "held_bytes": held,
        "held_bytes_per_token": held / n,
        "held_over_ideal": held / ideal,
        "bound_bytes": bound,
        "bound_over_ideal": bound / ideal,
        "within_bound": held <= bound,
        "pool_bytes_preallocated": cache.nbytes(),
        "bytes_in_use_by_cache_accounting": cache.bytes_in_use(),
    }
