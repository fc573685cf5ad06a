"""A parity case driven through ``model.generate()``: the cached path users of transformers run.

Some of transformers' cache behaviour lives in ``generate()`` only: the cache class it builds by default
(gemma2/3's ``HybridCache``, ``cache_implementation="sliding_window"``) and what a model's
``prepare_inputs_for_generation`` does to the cache between steps (Phi-3's LongRoPE recomputes the
whole cache when the sequence crosses ``original_max_position_embeddings``). A manual ``forward()`` loop
misses both, so the adapter can drive a case through ``generate()`` itself (``HFEngine(drive="generate")``).

``generate()`` chooses its own tokens; a logits processor forces each one to the case's next token,
so the cached path runs on exactly the case's tokens, and ``output_logits=True`` returns the raw
logits before any processor. Every forward ``generate()`` makes is seen by wrapping the model's
``forward`` for the call: the first one is the prompt's prefill (not recorded), each later one is a
decode step whose last row is recorded. A case with a prefix hit, chunked prefill, a case window or a
cache operation has no ``generate()`` equivalent and is refused.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from ..errors import UsageError
from ..parity.cases import Case
from ..parity.protocol import CaseRun, Ignored, StepRecord


def generate_ignored(case: Case) -> tuple[Ignored, ...]:
    """The case parameters ``generate()`` has no way to run (a case using one is refused)."""
    out = []
    if case.prefix:
        out.append(Ignored("prefix", f"prefix={case.prefix} (generate() drives one request from an empty cache)"))
    if case.chunk:
        out.append(Ignored("chunk", f"chunk={case.chunk} (generate() prefills the prompt in one call)"))
    if case.window is not None:
        out.append(Ignored("window", f"window={case.window} (generate() runs the model's own windows)"))
    if case.op is not None:
        out.append(Ignored("op", f"op: generate() runs no {case.op.label()}"))
    return tuple(out)


def run_generate_case(engine: Any, case: Case, tokens: torch.Tensor) -> CaseRun:
    """The case's prompt through ``generate()`` with ``case.decode_steps`` forced steps after it.
    ``engine`` is the :class:`~ropekv.adapters.hf.HFEngine` (its probes record each forward's call)."""
    refused = generate_ignored(case)
    if refused:
        raise UsageError(f"drive='generate' cannot run case parameters: {'; '.join(i.text for i in refused)}")
    import transformers

    model: Any = engine.model
    length, steps = case.length, len(case.decode_positions)
    # the token generate() must produce at each step: the case's next tokens, then any one (never fed back)
    forced = torch.cat([tokens[length : length + steps], tokens[:1]])

    class ForceTokens(transformers.LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            k = input_ids.shape[1] - length
            out = torch.full_like(scores, -1e9)
            out[:, int(forced[k])] = 0.0
            return out

    records: list[tuple[int, tuple]] = []
    calls = [0]
    original = model.forward

    @functools.wraps(original)  # generate() reads forward's signature to choose its keywords
    def forward(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise UsageError("generate() called the model without input_ids; drive='generate' needs token ids")
        count = int(ids.shape[1])
        positions = _positions(kwargs, count)
        decode = calls[0] > 0  # the first forward is the prompt's prefill
        calls[0] += 1
        call = engine._new_call(positions, torch.tensor([count - 1]) if decode else None)
        engine._call = call
        try:
            out = original(*args, **kwargs)
        finally:
            engine._call = None
        if decode:
            records.append((int(positions[-1]), call.recorder.take()))
        return out

    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.eos_token_id = None  # a forced token equal to the tiny config's eos must not stop the run
    config.pad_token_id = 0
    config.max_new_tokens = steps + 1
    config.min_new_tokens = None
    if engine.cache_implementation is not None:
        config.cache_implementation = engine.cache_implementation
    with engine._session():
        engine._reset_rope()
        model.forward = forward
        try:
            out = model.generate(
                tokens[None, :length],
                attention_mask=torch.ones(1, length, dtype=torch.long),
                generation_config=config,
                logits_processor=transformers.LogitsProcessorList([ForceTokens()]),
                output_logits=True,
                return_dict_in_generate=True,
            )
        finally:
            del model.forward  # the class's forward again
    produced = out.sequences[0, length : length + steps]
    if not torch.equal(produced, forced[:steps].to(produced.dtype)):
        raise UsageError(f"generate() produced {produced.tolist()} where the case forced {forced.tolist()}")
    if len(records) != steps or len(out.logits) != steps + 1:
        raise UsageError(
            f"generate() made {len(records)} decode forwards and {len(out.logits)} logits for {steps} steps"
        )
    layers_of = dict(records)
    run_steps = []
    for k, t in enumerate(case.decode_positions):
        if t not in layers_of:
            raise UsageError(f"generate()'s decode forwards ended at positions {sorted(layers_of)}, not at {t}")
        run_steps.append(StepRecord(position=t, logits=out.logits[k + 1][0].float(), layers=layers_of[t]))
    cache = getattr(out, "past_key_values", None)
    note = f"driven by generate() (cache: {type(cache).__name__ if cache is not None else 'none returned'})"
    return CaseRun(tuple(run_steps), notes=(note,))


def _positions(kwargs: dict[str, Any], count: int) -> torch.Tensor:
    """``[count]`` the logical positions of one forward's tokens, as generate() handed them to the model:
    its ``position_ids`` where given, else ``cache_position``, else counted on from the cache's length.
    (Phi-3's recomputation on 4.45 passes every token with the one-token ``cache_position`` of the step.)"""
    for name in ("position_ids", "cache_position"):
        value = kwargs.get(name)
        if value is not None and value.numel() == count:
            return value.detach().to(torch.int64).reshape(-1)
    past = kwargs.get("past_key_values")
    start = past.get_seq_length() if past is not None and hasattr(past, "get_seq_length") else 0
    return torch.arange(start, start + count)
