"""The references of cache-operation cases (``Case.op``), and what their bugs would look like.

Each operation has its own full-forward reference (float64, :class:`ReferenceDecoder`), never the
engine's own output:

- ``rollback``: the sequence without the rejected draft, i.e. the plain reference (the draft must
  leave no trace);
- ``evict``: the full forward with the evicted keys hidden at their true positions from every row
  after the eviction (``key_mask``); rows before it saw them, as the cached prefill did;
- ``shift``: the full forward at the shifted positions (``positions = delta..delta + T - 1``);
- ``batch``: each row against its own unpadded forward; all rows are prefixes of one token stream,
  so by causality one plain forward serves every row;
- ``restore``: the uninterrupted run, i.e. the plain reference;
- ``spec``: the plain reference (the accepted draft tokens are the stream's own; the rejected ones
  must leave no trace), at the drafter's rows, the accepted verify rows and the decode rows.

Self-parity (against the engine's own cache-free forward): plain for rollback, batch and restore; for
a shift the engine's unshifted forward relabelled by ``delta`` (RoPE scores depend on ``i - j`` only);
for an eviction the engine has no masked full forward, so only the float64 reference judges it (said
in the case's notes).
"""

from __future__ import annotations

import dataclasses

import torch

from ..attention_kind import MODEL_WINDOWS
from ..errors import UsageError
from ..models.reference import ReferenceDecoder, ReferenceOutput
from .cases import Case, OpKind
from .compare import RefRow

OWN_REFERENCE = (OpKind.EVICT, OpKind.SHIFT)


def needs_own_reference(case: Case) -> bool:
    return case.op is not None and case.op.kind in OWN_REFERENCE


def own_reference(
    decoder: ReferenceDecoder, case: Case, tokens: torch.Tensor, num_layers: int | None = None
) -> ReferenceOutput:
    """The float64 reference of an ``evict`` or ``shift`` case, probed at its decode positions (its first
    ``num_layers`` only when given: :meth:`ReferenceDecoder.forward`)."""
    if case.op is None or case.op.kind not in OWN_REFERENCE:
        raise UsageError(f"case {case.label()} has no reference of its own (only {', '.join(OWN_REFERENCE)} do)")
    d = case.shift
    rows = [t - d for t in case.decode_positions]  # token indices
    T = max(rows) + 1
    window = MODEL_WINDOWS if case.window is None else case.window
    if case.op.kind == OpKind.SHIFT:
        return decoder.forward(
            tokens[:T],
            probe_rows=rows,
            window=window,
            sink_tokens=case.sink_tokens,
            positions=torch.arange(T) + d,
            num_layers=num_layers,
        )
    mask = torch.ones(T, T, dtype=torch.bool)
    mask[case.prefix + case.length :, case.evicted_positions] = False  # rows after the eviction
    return decoder.forward(
        tokens[:T], probe_rows=rows, window=window, sink_tokens=case.sink_tokens, key_mask=mask, num_layers=num_layers
    )


def hide_evicted(case: Case, row: RefRow) -> RefRow:
    """A decode row of an ``evict`` case with the evicted keys' attention logits at -inf: the forward
    hid them (``key_mask``), and the comparison must not expect the engine to read them."""
    if case.op is None or case.op.kind != OpKind.EVICT:
        return row
    gone = torch.tensor(case.evicted_positions) - row.origin
    attn = []
    for logits in row.attn_logits:  # [H, T] by position from row.origin
        logits = logits.clone()
        logits[:, gone[(gone >= 0) & (gone < logits.shape[1])]] = float("-inf")
        attn.append(logits)
    return dataclasses.replace(row, attn_logits=tuple(attn))


def self_rows(case: Case) -> list[int]:
    """Rows of the engine's own plain full forward that self-parity of ``case`` reads (none for evict)."""
    if case.op is not None and case.op.kind == OpKind.EVICT:
        return []
    return [t - case.shift for t in case.decode_positions]


def self_from_reference(case: Case) -> bool:
    """Whether self-parity of ``case`` can only use the float64 reference (no engine path for it)."""
    return case.op is not None and case.op.kind == OpKind.EVICT


def notes(case: Case) -> tuple[str, ...]:
    if self_from_reference(case):
        return (
            "self-parity: the engine's full forward cannot hide evicted keys; judged against the float64 "
            "reference (with the evicted keys masked) only",
        )
    if case.shift:
        return (f"self-parity: the engine's unshifted full forward, relabelled by {case.shift:+d} positions",)
    return ()
