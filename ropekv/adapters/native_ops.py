"""How ropekv's own engine runs a case's cache operation (``Case.op``), for :class:`NativeAdapter`.

Each runner does the prefix hit and prefill of the plain case, then the operation, then the decode
steps the harness compares (positions from ``case.decode_positions``, as the engine reports them).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..engine import Engine, StepOutput
from ..errors import UsageError
from ..parity.cases import Case, OpKind
from ..parity.protocol import CaseRun, StepRecord
from ..transfer.saved import load_sequence, save_sequence
from .native_steps import prefill_case


def run_op_case(make_engine: Callable[[Case], Engine], engine: Engine, case: Case, tokens: torch.Tensor) -> CaseRun:
    """Run ``case`` (``case.op`` set) on ``engine``; ``make_engine(case)`` builds the fresh engine a
    restore loads into."""
    if case.op is None:
        raise UsageError(f"case {case.label()} has no cache operation to run")
    kind, amount = case.op.kind, case.op.amount
    if kind == OpKind.BATCH:
        return _batch(engine, case, tokens)
    if kind == OpKind.SPEC:
        return _spec(engine, case, tokens)
    prefill_case(engine, case, tokens, "prompt")
    notes: tuple[str, ...] = ()
    if kind == OpKind.ROLLBACK:
        draft = case.draft_tokens(tokens, engine.config.vocab_size)
        engine.prefill("prompt", draft)  # a speculative verify step over the draft, then all of it rejected
        engine.rollback("prompt", amount)
        notes = (f"a {amount}-token draft was prefilled after the prompt and rolled back",)
    elif kind == OpKind.EVICT:
        engine.evict("prompt", case.evicted_positions)
        notes = (f"evicted positions {case.evicted_positions} after prefill",)
    elif kind == OpKind.SHIFT:
        engine.shift("prompt", amount, 0)
        notes = (f"the whole cached sequence was shifted by {amount:+d} positions",)
    elif kind == OpKind.RESTORE:
        n = case.prefix + case.length
        with tempfile.TemporaryDirectory(prefix="ropekv-restore-") as tmp:
            path = Path(tmp) / "prompt.safetensors"
            size = save_sequence(engine, "prompt", path, tokens[:n])
            engine = make_engine(case)  # a fresh engine: nothing survives but the file
            load_sequence(engine, path)
        notes = (f"saved to a {size}-byte safetensors file and restored into a fresh engine",)
    steps = []
    for t in case.decode_positions:
        out = engine.decode("prompt", tokens[t - case.shift], probe=True)
        steps.append(StepRecord(position=int(out.positions[0]), logits=out.logits[0], layers=out.layers))
    return CaseRun(tuple(steps), notes=notes)


def _batch(engine: Engine, case: Case, tokens: torch.Tensor) -> CaseRun:
    lengths = case.batch_lengths
    ids = [f"row{r}" for r in range(len(lengths))]
    for sid, L in zip(ids, lengths):
        engine.prefill(sid, tokens[:L], chunk_size=case.chunk)
    steps: list[StepRecord] = []
    for s in range(case.decode_steps):
        outs = engine.decode_batch(ids, torch.stack([tokens[L + s] for L in lengths]), probe=True)
        steps.extend(StepRecord(position=int(o.positions[0]), logits=o.logits[0], layers=o.layers) for o in outs)
    return CaseRun(
        tuple(steps), notes=(f"{len(lengths)} sequences of lengths {lengths} decoded in left-padded batches",)
    )


def _record(out: StepOutput) -> StepRecord:
    return StepRecord(position=int(out.positions[0]), logits=out.logits[0], layers=out.layers)


def _spec(engine: Engine, case: Case, tokens: torch.Tensor) -> CaseRun:
    """One speculative step (``Case.spec_records``): the drafter (the same model, a sequence of its
    own in the same engine, so its own block table and ring) decodes the draft one token at a time;
    the target verifies all ``K`` in one forward; ``M`` are accepted, both caches give the rest back;
    the drafter drafts the next token and the target decodes on."""
    if case.op is None or case.op.kind != OpKind.SPEC:
        raise UsageError(f"case {case.label()} runs no speculative step")
    k, m, n = case.op.amount, case.spec_accepted, case.prefix + case.length
    draft = case.spec_draft(tokens, engine.config.vocab_size)
    prefill_case(engine, case, tokens, "prompt")
    engine.prefill("drafter", tokens[:n], chunk_size=case.chunk)
    # The drafter feeds d_0..d_{K-2} (the prompt's last logits proposed d_0); the rows of the accepted
    # tokens are compared, the rejected ones read tokens the stream does not hold.
    drafted = [engine.decode("drafter", draft[j], probe=j < m) for j in range(k - 1)]
    verified = engine.verify("prompt", draft, probe=True)
    engine.rollback("prompt", k - m)
    if k - 1 > m:
        engine.rollback("drafter", k - 1 - m)
    redraft = engine.decode("drafter", tokens[n + m], probe=True)
    steps = [_record(o) for o in drafted[:m]] + [_record(o) for o in verified[:m]] + [_record(redraft)]
    for _, t in case.spec_records[2 * m + 1 :]:
        steps.append(_record(engine.decode("prompt", tokens[t], probe=True)))
    notes = (
        f"speculative step: a {k}-token draft (drafter: same model, own cache) verified in one forward at "
        f"positions {n}..{n + k - 1}, {m} accepted, {k - m} rolled back in the target and "
        f"{max(0, k - 1 - m)} in the drafter; records: drafter rows {n}..{n + m - 1}, verify rows "
        f"{n}..{n + m - 1}, drafter row {n + m} after its rollback, target decode from {n + m}",
    )
    return CaseRun(tuple(steps), notes=notes)
