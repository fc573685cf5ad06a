"""Decode speed of one sequence at several contexts: ropekv's engine and transformers' cached decode.

Every engine (ropekv with rotated keys, ropekv with raw keys, transformers, and the matvec floor
below) holds its own sequence of the same token stream, teacher-forced (the next token is fed
whatever the logits say, so no sampling is timed), on the same checkpoint, dtype and thread count.
At each context every sequence is prefilled up to it (chunked, untimed), ``warmup`` steps run
untimed, then the timed steps are *interleaved*: one step of each engine in turn, ``steps`` rounds,
the order rotating every round. A burst of other work on the machine then slows every engine alike
instead of whichever happened to run at that moment. The figure is each engine's median step.
Everything runs under ``torch.no_grad()`` (what ``generate`` uses).

:func:`step_bytes` is what one decode step must read at least: every weight once (the embedding
table only for its one row, unless it doubles as the LM head) plus each layer's cached keys and
values up to the context (a sliding layer only its window).

The matvec floor runs the step's matrix-vector products and nothing else (every projection of every
layer and the LM head, in step order, on a zero input row). Both engines run these same kernels over
the same bytes, so no engine built on them can step faster; ``step / floor`` of transformers is the
most any such engine could gain on it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..contract import CacheContract, KeyForm
from ..engine import Engine
from ..engine.transformer import DecoderWeights, LayerWeights
from ..models.config import Checkpoint

PREFILL_CHUNK = 512


@dataclass
class DecodeRun:
    """Timed decode steps of one engine at one context."""

    context: int  # cached tokens before the first warmup step
    step_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0  # not part of the figure; shows what reaching the context cost

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.median_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "tokens_per_s": self.tokens_per_s,
            "median_step_seconds": self.median_seconds,
            "min_step_seconds": min(self.step_seconds),
            "step_seconds": self.step_seconds,
            "prefill_seconds_to_reach_context": self.prefill_seconds,
        }


@dataclass
class Driver:
    """One engine's sequence: ``prefill(start, end)`` appends tokens ``start..end-1``, ``decode(p)``
    decodes the token at position ``p``; ``keep`` holds whatever must outlive the run (the engine)."""

    prefill: Callable[[int, int], object]  # what they return is not used
    decode: Callable[[int], object]
    keep: Any = None


def step_bytes(
    checkpoint: Checkpoint, contract: CacheContract, weights: DecoderWeights, context: int
) -> dict[str, int]:
    """Bytes a decode step at ``context`` cached tokens must read: weights and KV cache."""
    cfg = checkpoint.config
    embed_bytes = weights.embed.numel() * weights.embed.element_size()
    weight_bytes = weights.nbytes()
    if not cfg.tie_word_embeddings:  # the embedding table is only gathered (one row), never streamed
        weight_bytes -= embed_bytes - cfg.hidden_size * weights.embed.element_size()
    itemsize = torch.empty(0, dtype=contract.torch_dtype).element_size()
    per_token_layer = 2 * contract.num_kv_heads * contract.head_dim * itemsize
    kv = 0
    for layer in range(contract.num_layers):
        live = context
        if layer in contract.window_layers and contract.window is not None:
            live = min(context, contract.window + contract.sink_tokens)
        kv += live * per_token_layer
    return {"weights": weight_bytes, "kv_cache": kv, "total": weight_bytes + kv}


def time_interleaved(
    drivers: dict[str, Driver],
    contexts: list[int],
    *,
    warmup: int,
    steps: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[DecodeRun]]:
    """Drive every engine's sequence through ``contexts`` (ascending) with interleaved timed steps."""
    runs: dict[str, list[DecodeRun]] = {name: [] for name in drivers}
    names = list(drivers)
    length = 0
    with torch.no_grad():
        for context in contexts:
            if context < length:
                raise ValueError(f"contexts must ascend with room for {warmup + steps} decode steps each: {contexts}")
            current = {}
            for name, d in drivers.items():
                t0 = time.perf_counter()
                for start in range(length, context, PREFILL_CHUNK):
                    d.prefill(start, min(context, start + PREFILL_CHUNK))
                current[name] = DecodeRun(context, prefill_seconds=time.perf_counter() - t0)
                for i in range(warmup):
                    d.decode(context + i)
            for step in range(steps):
                position = context + warmup + step
                shift = step % len(names)
                for name in names[shift:] + names[:shift]:
                    t0 = time.perf_counter()
                    drivers[name].decode(position)
                    current[name].step_seconds.append(time.perf_counter() - t0)
            length = context + warmup + steps
            for name, run in current.items():
                runs[name].append(run)
            if progress:
                progress(
                    f"  {context:>6} tokens: "
                    + ", ".join(f"{name} {run.tokens_per_s:.2f}/s" for name, run in current.items())
                )
    return runs


def ropekv_driver(
    checkpoint: Checkpoint,
    key_form: KeyForm,
    tokens: torch.Tensor,
    max_tokens: int,
    *,
    dtype: str = "float32",
    weights: DecoderWeights | None = None,
    block_size: int = 16,
    compile_rotation: bool = False,
) -> Driver:
    """ropekv's engine with ``key_form`` keys (its backend follows: rotated / rotate_on_read) and room
    for ``max_tokens``; ``keep`` is ``(engine, seq_id)``."""
    contract = CacheContract.for_model(
        checkpoint.config,
        key_form=key_form,
        block_size=block_size,
        dtype=dtype,
        weights_fingerprint=checkpoint.weights_fingerprint,
    )
    engine = Engine(
        checkpoint,
        contract,
        num_blocks=-(-max_tokens // block_size) + 2,
        weights=weights,
        compile_rotation=compile_rotation,
    )
    seq = "bench"
    return Driver(
        prefill=lambda start, end: engine.prefill(seq, tokens[start:end]),
        decode=lambda position: engine.decode(seq, tokens[position]),
        keep=(engine, seq),
    )


def load_transformers_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' own model for ``model_dir`` (local files only, no remote code), in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, use_safetensors=True, dtype=dtype)
    return model.eval()


def transformers_driver(model, tokens: torch.Tensor) -> Driver:
    """transformers' cached decode: ``model(token, past_key_values=cache)`` one token at a time."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)

    def prefill(start: int, end: int) -> None:
        model(input_ids=tokens[None, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1)

    def decode(position: int) -> None:
        model(input_ids=tokens[None, position : position + 1], past_key_values=cache, use_cache=True)

    return Driver(prefill=prefill, decode=decode, keep=model)


def kernels_floor_driver(weights: DecoderWeights, contract: CacheContract, max_tokens: int, *, seed: int = 0) -> Driver:
    """The step's kernels as a pseudo-engine: the matvec floor's matrices in step order, and after
    each layer's attention projections that layer's two attention matmuls over its own cached keys
    and values (scores ``[KVH, G, N]`` of zero queries, then those scores times the values), nothing
    else. ``N`` is what a step at that position reads: every key, a sliding layer its window. The
    keys and values are random (written, so every page is real memory, not the zero page) and laid
    out head-major like the pool, ``[KVH, max_tokens, D]`` per layer, so each layer's bytes are read
    cold after the rest of the step, as a real step reads them. What this takes above the matvec
    floor is what the attention kernels take to read the KV bytes."""
    layers = [_layer_matrices(lw) for lw in weights.layers]
    kvh, d = contract.num_kv_heads, contract.head_dim
    group = max(1, weights.config.num_heads // kvh)
    g = torch.Generator().manual_seed(seed)
    dtype = weights.lm_head.dtype
    keys = [torch.randn(kvh, max_tokens, d, generator=g).to(dtype) for _ in layers]
    values = [torch.randn(kvh, max_tokens, d, generator=g).to(dtype) for _ in layers]
    queries = torch.zeros(kvh, group, d, dtype=dtype)
    mats = [m for attn, rest in layers for m in (*attn, *rest)] + [weights.lm_head]
    inputs = {m.shape[1]: torch.zeros(1, m.shape[1], dtype=m.dtype) for m in mats}
    windows = [
        contract.window + contract.sink_tokens
        if layer in contract.window_layers and contract.window is not None
        else None
        for layer in range(len(layers))
    ]

    def step(position: int) -> None:
        if not 0 <= position < max_tokens:
            raise ValueError(f"kernels floor: position {position} outside its {max_tokens} cached rows")
        for layer, (attn, rest) in enumerate(layers):
            for m in attn:
                F.linear(inputs[m.shape[1]], m)
            window = windows[layer]
            live = position + 1 if window is None else min(position + 1, window)
            k = keys[layer][:, position + 1 - live : position + 1]  # [KVH, N, D]
            v = values[layer][:, position + 1 - live : position + 1]
            torch.bmm(torch.bmm(queries, k.transpose(1, 2)), v)  # [KVH, G, N] scores, then [KVH, G, D]
            for m in rest:
                F.linear(inputs[m.shape[1]], m)
        F.linear(inputs[weights.lm_head.shape[1]], weights.lm_head)

    info = {
        "matrices": len(mats),
        "attention_matmuls": 2 * len(layers),
        "kv_bytes_allocated": sum(t.numel() * t.element_size() for t in keys + values),
    }
    return Driver(prefill=lambda start, end: None, decode=step, keep=info)


def _layer_matrices(lw: LayerWeights) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """A layer's weight matrices in step order: its attention projections (the fused q/k/v, or MLA's
    latent path), then o, gate/up and down."""
    if lw.mla is None:
        assert lw.qkv is not None  # every layer but MLA's has a fused qkv
        attn: tuple[torch.Tensor, ...] = (lw.qkv,)
    else:
        m = lw.mla
        attn = tuple(t for t in (m.q, m.q_a, m.q_b, m.kv_a, m.kv_b) if t is not None)
    rest = tuple(t for t in (lw.o, lw.gate_up, lw.down) if t is not None)
    return attn, rest


def floor_driver(weights: DecoderWeights) -> Driver:
    """The matvec floor as a pseudo-engine: a "step" is every weight matrix times a zero row."""
    mats = [m for lw in weights.layers for part in _layer_matrices(lw) for m in part] + [weights.lm_head]
    inputs = {m.shape[1]: torch.zeros(1, m.shape[1], dtype=m.dtype) for m in mats}

    def step(position: int) -> None:
        for m in mats:
            F.linear(inputs[m.shape[1]], m)

    info = {"matrices": len(mats), "bytes": sum(m.numel() * m.element_size() for m in mats)}
    return Driver(prefill=lambda start, end: None, decode=step, keep=info)
