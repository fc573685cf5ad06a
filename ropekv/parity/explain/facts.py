"""What a failing case says about itself, for the explanations: where its phases wrote keys, its
window, blocks, prefix and operation, and what the engine and the comparison reported.

Positions are logical throughout; a ``shift`` case's are the shifted ones (what the engine reads).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...attention_kind import LayerAttention
from ...rope import RopeSpec
from ..cases import Case, OpKind
from ..report import Divergence

SpanName = str  # "the prefix-cache hit", "prefill chunk 2", "the decode steps", ...


@dataclass(frozen=True)
class Span:
    """Positions ``[start, stop)`` one phase of the case wrote (``name`` says which)."""

    name: SpanName
    start: int
    stop: int

    def __contains__(self, position: int) -> bool:
        return self.start <= position < self.stop


@dataclass(frozen=True)
class ModelFacts:
    """The model as the explanations need it: each layer's RoPE (None: NoPE) and attention kind."""

    layer_ropes: tuple[RopeSpec | None, ...]
    layer_attentions: tuple[LayerAttention, ...]
    has_mla: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_ropes)

    def others(self, layer: int) -> tuple[tuple[str, RopeSpec | None], ...]:
        """The other layers' distinct specs, each named by the first layer that has it."""
        out: list[tuple[str, RopeSpec | None]] = []
        seen: list[RopeSpec | None] = [self.layer_ropes[layer]]
        for i, spec in enumerate(self.layer_ropes):
            if spec in seen:
                continue
            seen.append(spec)
            kind = self.layer_attentions[i].kind if i < len(self.layer_attentions) else "full"
            if spec is None:
                out.append((f"layer {i}'s (a NoPE layer: no rotation)", None))
            else:
                out.append((f"layer {i}'s RoPE ({kind}: theta {spec.theta:g}, {spec.scaling.rope_type})", spec))
        return tuple(out)


@dataclass(frozen=True)
class CaseFacts:
    """One failing case at its first divergence (``layer`` None: only the final logits diverged)."""

    case: Case
    model: ModelFacts
    divergence: Divergence
    layer: int | None
    query_position: int
    step: int
    role: str  # "decode"; a spec case's record: "draft", "verify", "redraft", "decode"
    window: int | None  # the layer's window under the case (the case's, else the layer's own)
    chunk_size: int | None  # the layer's attention chunk (llama4), None elsewhere
    handoff_len: int
    key_form: str | None
    engine_dtype: str
    kv_dtype: str | None
    self_passed: bool
    input_matched: bool | None
    logit_errors: tuple[float, ...]
    self_logit_errors: tuple[float, ...]
    attn_error: float | None
    tolerance_attn: float
    tolerance_logits: float

    @property
    def prefix(self) -> int:
        return self.case.prefix

    @property
    def block_size(self) -> int:
        return self.case.block_size

    @property
    def sinks(self) -> int:
        return self.case.sink_tokens

    @property
    def shift(self) -> int:
        return self.case.shift

    @property
    def op(self) -> OpKind | None:
        return None if self.case.op is None else self.case.op.kind

    @property
    def prompt_end(self) -> int:
        """The first position after the prompt (the prefix included), shifted with the sequence."""
        return self.case.prefix + self.case.length + self.case.shift

    def spans(self) -> tuple[Span, ...]:
        """What wrote each range of positions: the prefix-cache hit, the prompt's prefill (each chunk
        when chunked), then the steps after it (decode, and a speculative step's accepted draft)."""
        c, d = self.case, self.case.shift
        out: list[Span] = []
        if c.prefix:
            out.append(Span("the prefix-cache hit", d, d + c.prefix))
        start, end = c.prefix + d, self.prompt_end
        if c.chunk and c.length > c.chunk:
            for k, lo in enumerate(range(start, end, c.chunk)):
                out.append(Span(f"prefill chunk {k + 1}", lo, min(lo + c.chunk, end)))
        else:
            out.append(Span("the prefill", start, end))
        out.append(Span("the decode steps", end, self.query_position + 1))
        return tuple(out)

    def span_of(self, position: int) -> Span | None:
        return next((s for s in self.spans() if position in s), None)
