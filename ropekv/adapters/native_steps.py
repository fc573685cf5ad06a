"""The plain part of a case on ropekv's own engine: the prefill (prefix hit included) and the probed
decode steps. Shared by :class:`~ropekv.adapters.native.NativeAdapter`, its cache-operation runners
(:mod:`ropekv.adapters.native_ops`) and the handoff adapter (:mod:`ropekv.handoff.adapter`)."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..engine import Engine
from ..parity.cases import Case
from ..parity.protocol import StepRecord


def prefill_case(engine: Engine, case: Case, tokens: torch.Tensor, seq_id: Hashable) -> None:
    """The cached part of ``case`` before decoding: a prefix-cache hit at ``case.prefix`` (an earlier
    request cached the prefix and, where no window can have overwritten it, a different continuation
    that must not leak into this one), then ``case.length`` tokens prefilled in ``case.chunk`` pieces."""
    end = case.prefix + case.length
    streams = case.position_streams()  # image-like mRoPE positions, or None
    if case.prefix:
        parent = tokens[: case.prefix]
        if engine.contract.window is None:  # no ring (neither the case nor the model has a window)
            parent = torch.cat([parent, (tokens[:3] + 1) % engine.config.vocab_size])
        engine.prefill("earlier-request", parent, chunk_size=case.chunk, streams=streams)
        engine.fork(seq_id, "earlier-request", case.prefix)
        engine.prefill(seq_id, tokens[case.prefix : end], chunk_size=case.chunk, streams=streams)
    else:
        engine.prefill(seq_id, tokens[:end], chunk_size=case.chunk, streams=streams)


def decode_steps(engine: Engine, seq_id: Hashable, case: Case, tokens: torch.Tensor) -> tuple[StepRecord, ...]:
    """Decode ``case.decode_steps`` tokens on ``seq_id`` with probes, as the harness expects them."""
    steps = []
    for t in case.decode_positions:
        out = engine.decode(seq_id, tokens[t], probe=True)
        steps.append(StepRecord(position=int(out.positions[0]), logits=out.logits[0], layers=out.layers))
    return tuple(steps)
