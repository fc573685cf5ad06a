"""Parity cases: what one cached run does, and the default matrix.

A case: the first ``prefix`` tokens come from a prefix-cache hit (a parent sequence prefilled earlier,
then forked at ``prefix``), the next ``length`` tokens are prefilled (in chunks of ``chunk`` tokens if
set), then ``decode_steps`` tokens are decoded one at a time. Decode step ``s`` feeds the token at
logical position ``t = prefix + length + s`` and is compared with row ``t`` of a full forward.

A case without a window of its own runs under the model's own windows and chunks; :meth:`Case.for_model`
records them (:class:`ModelAttention`) so that the case's operations choose only positions the model's
layers still cache, and its label says which window it ran under (``W=12(model)``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Literal

import torch

from ..argtypes import MAX_SHIFT, MAX_TOKENS, strict_int
from ..attention_kind import LayerAttention
from ..errors import ConfigError, UsageError
from ..rope import PositionStreams, image_streams


class OpKind(StrEnum):
    """The cache operations a case can run between prefill and decode (docs/ops.md); each member is
    the string it is spelled as on the command line (``--ops rollback:3``) and in the report."""

    ROLLBACK = "rollback"
    EVICT = "evict"
    SHIFT = "shift"
    BATCH = "batch"
    RESTORE = "restore"
    SPEC = "spec"


OP_KINDS: tuple[str, ...] = tuple(k.value for k in OpKind)
_DRAFT_SHIFT = 7  # draft token ids: the real ones shifted, so a key left behind is a different token's
MAX_SPEC_DRAFT = 16  # draft tokens of one speculative step (real drafters propose 1 to about 10)
SpecRole = Literal["draft", "verify", "redraft", "decode"]


@dataclass(frozen=True)
class CacheOp:
    """A cache operation between prefill and decode (docs/ops.md).

    - ``rollback`` (``amount`` = rejected draft tokens): a draft of ``amount`` tokens is prefilled
      after the prompt, then rolled back; decoding continues at the prompt's end.
    - ``evict`` (``amount`` = tokens): interior tokens are evicted after prefill
      (:attr:`Case.evicted_positions`); survivors keep their positions.
    - ``shift`` (``amount`` = delta): the whole cached sequence moves by ``+delta`` positions.
    - ``batch`` (``amount`` = rows): that many sequences of different lengths are decoded together
      in left-padded batches (:attr:`Case.batch_lengths`).
    - ``restore`` (``amount`` unused, 0): the cache is saved to a file and loaded into a fresh engine.
    - ``spec`` (``amount`` = draft tokens K, 2..:data:`MAX_SPEC_DRAFT`): one speculative decoding step
      (:attr:`Case.spec_records`): a drafter with its own cache drafts K tokens, the target verifies
      them in one forward, accepts ``M = K // 2`` (:attr:`Case.spec_accepted`), both roll the rest
      back, and decoding continues after the accepted tokens.
    """

    kind: OpKind
    amount: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in OP_KINDS:
            raise UsageError(f"unknown cache operation {self.kind!r}; choose one of {', '.join(OP_KINDS)}")
        object.__setattr__(self, "kind", OpKind(self.kind))
        if not isinstance(self.amount, int) or isinstance(self.amount, bool):
            raise UsageError(f"{self.kind}: amount must be an integer, got {self.amount!r}")
        low = {
            OpKind.ROLLBACK: 1,
            OpKind.EVICT: 1,
            OpKind.SHIFT: 1,
            OpKind.BATCH: 2,
            OpKind.RESTORE: 0,
            OpKind.SPEC: 2,
        }[self.kind]
        if self.amount < low or (self.kind == OpKind.RESTORE and self.amount != 0):
            want = "no amount" if self.kind == OpKind.RESTORE else f"an amount >= {low}"
            if self.kind == OpKind.SPEC:
                want = f"a draft of {low}..{MAX_SPEC_DRAFT} tokens (one accepted, one rejected at least)"
            raise UsageError(f"{self.kind} needs {want}, got {self.amount}")
        if self.kind == OpKind.SPEC and self.amount > MAX_SPEC_DRAFT:
            raise UsageError(
                f"spec needs a draft of {low}..{MAX_SPEC_DRAFT} tokens, got {self.amount} (a longer draft is "
                "no longer one speculative step)"
            )
        # Bounded as on the command line (parse_ops): a count of tokens for every kind but a shift, whose
        # amount is a position (its rows start at the shift: RefRow.origin) up to MAX_SHIFT.
        limit = max_amount(self.kind)
        if self.amount > limit:
            raise UsageError(f"{self.kind}: the amount must be at most {limit}, got {self.amount}")

    def label(self) -> str:
        return self.kind.value if self.kind == OpKind.RESTORE else f"{self.kind.value}:{self.amount}"


def max_amount(kind: OpKind) -> int:
    """The largest amount of an operation: :data:`MAX_SHIFT` positions for a shift, else
    :data:`~ropekv.argtypes.MAX_TOKENS` tokens."""
    return MAX_SHIFT if kind == OpKind.SHIFT else MAX_TOKENS


def parse_ops(text: str) -> list[CacheOp]:
    """``"rollback:3,evict:5,shift:1000,batch:3,restore,spec:3"`` -> operations; one-line UsageError otherwise."""
    # Amounts are ASCII digits with an optional minus (str.isdigit() takes "²", which int() refuses),
    # bounded like every token count of the command line.
    ops = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            raise UsageError(f"--ops {text!r}: empty item; write e.g. rollback:3,evict:5,shift:1000,batch:3,restore")
        kind, sep, amount = item.partition(":")
        if kind not in OP_KINDS:
            raise UsageError(f"--ops: unknown operation {kind!r}; choose from {', '.join(OP_KINDS)}")
        value = strict_int(amount) if sep else 0
        limit = max_amount(OpKind(kind))
        if value is None or abs(value) > limit:
            raise UsageError(f"--ops: {item!r}: the amount must be an integer of at most {limit}")
        if kind != OpKind.RESTORE and not sep:
            raise UsageError(f"--ops: {kind} needs an amount, e.g. {kind}:3")
        ops.append(CacheOp(OpKind(kind), value))
    return ops


@dataclass(frozen=True)
class ModelAttention:
    """The model's own windows and chunks, as a case without a window of its own runs under them.

    ``window``: the sliding window of the model's sliding layers (the narrowest, should they differ),
    None without any; ``chunk``: the chunk size of its chunked layers, None without any;
    ``every_layer_slides``: no layer keeps every key, so a position older than the window is no
    longer cached anywhere (only then does the window limit which positions an operation can touch).
    """

    window: int | None = None
    chunk: int | None = None
    every_layer_slides: bool = False

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise UsageError(f"ModelAttention.{name} must be a positive integer or None, got {v!r}")
        if self.every_layer_slides and self.window is None:
            raise UsageError("ModelAttention: every layer slides, but no window is given")

    @classmethod
    def of(cls, layers: Sequence[LayerAttention]) -> ModelAttention | None:
        """The record of a model's per-layer attention (``ModelConfig.layer_attentions``); None when
        every layer attends to every earlier key (nothing to record)."""
        windows = [a.size for a in layers if a.kind == "sliding" and a.size is not None]
        chunks = [a.size for a in layers if a.kind == "chunked" and a.size is not None]
        if not windows and not chunks:
            return None
        return cls(
            window=min(windows) if windows else None,
            chunk=min(chunks) if chunks else None,
            every_layer_slides=bool(layers) and len(windows) == len(layers),
        )

    def label(self) -> str:
        """``W=12(model)`` (every layer slides), ``W=4|full(model)`` (sliding and full layers),
        ``C=8|full(model)`` (chunked and full layers)."""
        parts = ([f"W={self.window}"] if self.window else []) + ([f"C={self.chunk}"] if self.chunk else [])
        if not self.every_layer_slides:
            parts.append("full")
        return "|".join(parts) + "(model)"


@dataclass(frozen=True)
class ImageGrid:
    """An image-like span of a prompt for an mRoPE model: ``rows x cols`` tokens from token ``start`` on,
    at the positions Qwen2-VL's ``get_rope_index`` gives an image (``ropekv.rope.image_streams``).
    No vision tower: the tokens are ordinary ids, only their three position streams are an image's."""

    start: int
    rows: int
    cols: int

    def __post_init__(self) -> None:
        try:
            image_streams(self.start + self.rows * self.cols, self.start, self.rows, self.cols)
        except (ConfigError, TypeError) as e:
            raise UsageError(f"image grid {self.start}/{self.rows}x{self.cols}: {e}") from None
        if self.rows == 1 and self.cols == 1:
            raise UsageError("an image grid of 1x1 tokens has h = w = t: it exposes nothing; give at least 2 tokens")

    def label(self) -> str:
        return f"img={self.rows}x{self.cols}@{self.start}"


@dataclass(frozen=True)
class Case:
    """One cached run (module doc). ``window``: a window forced on every layer (None: the model's own,
    recorded in ``model_attention`` by :meth:`for_model`); ``sink_tokens`` need a case window."""

    length: int
    prefix: int = 0
    block_size: int = 16
    window: int | None = None
    sink_tokens: int = 0
    chunk: int | None = None
    decode_steps: int = 3
    op: CacheOp | None = None
    model_attention: ModelAttention | None = None
    image: ImageGrid | None = None  # image-like mRoPE positions inside the prompt (mRoPE models only)

    def __post_init__(self) -> None:
        for name, low in (("length", 1), ("prefix", 0), ("block_size", 1), ("decode_steps", 1), ("sink_tokens", 0)):
            _check_int(f"case {name}", getattr(self, name), low)
        for name in ("chunk", "window"):
            if getattr(self, name) is not None:
                _check_int(f"case {name}", getattr(self, name), 1)
        if self.sink_tokens and self.window is None:
            raise UsageError("sink tokens need a window")
        if self.model_attention is not None:
            if not isinstance(self.model_attention, ModelAttention):
                raise UsageError(f"case model_attention must be a ModelAttention, got {self.model_attention!r}")
            if self.window is not None:
                raise UsageError("a case with a window of its own does not run under the model's windows")
        if self.op is not None:
            self._check_op()
        if self.image is not None:
            self._check_image()

    def _check_image(self) -> None:
        im = self.image
        if not isinstance(im, ImageGrid):
            raise UsageError(f"case image must be an ImageGrid, got {type(im).__name__}")
        end = im.start + im.rows * im.cols
        if end > self.prefix + self.length:
            raise UsageError(
                f"case image {im.label()}: it ends at token {end}, past the {self.prefix + self.length}-token prompt"
            )
        if self.op is not None:  # the streams are keyed by token index; no operation is defined on them here
            raise UsageError(f"case image {im.label()}: image-like positions are checked without cache operations")

    def position_streams(self) -> PositionStreams | None:
        """The mRoPE streams of the case's tokens (None: text, one position per token)."""
        im = self.image
        return None if im is None else image_streams(self.total, im.start, im.rows, im.cols)

    def for_model(self, layers: Sequence[LayerAttention]) -> Case:
        """This case as it runs on a model with per-layer attention ``layers``
        (``ModelConfig.layer_attentions``): a case without a window of its own records the model's."""
        if self.window is not None:
            return self
        return dataclasses.replace(self, model_attention=ModelAttention.of(layers))

    @property
    def live_window(self) -> int | None:
        """The most recent positions every layer keeps cached (besides the sinks): the case's window,
        else the model's when every layer slides; None when some layer keeps every key."""
        if self.window is not None:
            return self.window
        m = self.model_attention
        return m.window if m is not None and m.every_layer_slides else None

    def _check_op(self) -> None:
        op = self.op
        if not isinstance(op, CacheOp):
            raise UsageError(f"case op must be a CacheOp, got {type(op).__name__}")
        if op.kind == OpKind.BATCH and (self.prefix or self.length < op.amount):
            raise UsageError(f"batch:{op.amount} needs prefix 0 and length >= {op.amount} (rows of different lengths)")
        # The case's own window is checked here; the model's (``live_window``) where the case meets
        # the model (ropekv.parity.applicable), so that a model window too small for it is n/a.
        if op.kind == OpKind.EVICT and len(self._evict_candidates(self.window)) < op.amount:
            raise UsageError(self.evict_shortfall(self.window))

    # ------------------------------------------------------------------ operations

    def _evict_candidates(self, window: int | None) -> list[int]:
        n = self.prefix + self.length
        low = max(self.sink_tokens, 1, n - window + 1 if window else 1)
        return list(range(low, n - 1))  # never the first (sink-like) nor the newest token

    def evict_shortfall(self, window: int | None) -> str | None:
        """Why an ``evict`` case cannot evict its amount under ``window`` (None: it can)."""
        if self.op is None or self.op.kind != OpKind.EVICT:
            return None
        have = len(self._evict_candidates(window))
        if have >= self.op.amount:
            return None
        own = (
            ""
            if window is None
            else (f" under window {window}" if window == self.window else f" under the model's window {window}")
        )
        return (
            f"evict:{self.op.amount}: a {self.prefix + self.length}-token prompt{own} has only {have} interior "
            "live tokens to evict"
        )

    @property
    def evicted_positions(self) -> list[int]:
        """Positions an ``evict`` case drops after prefill: evenly spread over the interior live tokens."""
        if self.op is None or self.op.kind != OpKind.EVICT:
            return []
        cand, k = self._evict_candidates(self.live_window), self.op.amount
        if len(cand) < k:
            raise UsageError(f"case {self.label()}: {self.evict_shortfall(self.live_window)}")
        if k == 1:
            return [cand[len(cand) // 2]]
        return [cand[round(i * (len(cand) - 1) / (k - 1))] for i in range(k)]

    @property
    def shift(self) -> int:
        """Positions the cached sequence moved by (``shift`` cases), else 0."""
        return self.op.amount if self.op is not None and self.op.kind == OpKind.SHIFT else 0

    @property
    def batch_lengths(self) -> list[int]:
        """Prompt lengths of the rows of a ``batch`` case (row 0 is the longest), else ``[length]``."""
        if self.op is None or self.op.kind != OpKind.BATCH:
            return [self.length]
        rows = self.op.amount
        gap = max(1, (self.length - 1) // rows)
        return [self.length - r * gap for r in range(rows)]

    def draft_tokens(self, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The rejected draft of a ``rollback`` case: ids that differ from the real continuation."""
        if self.op is None:
            raise UsageError(f"case {self.label()} runs no cache operation: it has no draft")
        n, amount = self.prefix + self.length, self.op.amount
        real = tokens[n : n + amount]
        if real.numel() < amount:
            real = torch.cat([real, tokens[: amount - real.numel()]])
        return (real + _DRAFT_SHIFT) % vocab_size

    @property
    def spec_accepted(self) -> int:
        """Draft tokens a ``spec`` case accepts: ``M = K // 2`` (at least one accepted, one rejected),
        fixed by the case so that the run is reproducible (a greedy agreement would depend on the
        model and on rounding ties); 0 for any other case."""
        return self.op.amount // 2 if self.op is not None and self.op.kind == OpKind.SPEC else 0

    def spec_draft(self, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The ``K`` tokens a ``spec`` case's drafter proposes: the stream's next ``M`` tokens (the
        drafter guessed them; they are accepted and become part of the stream) then ``K - M`` others
        (shifted ids, so a rejected key left behind is a different token's)."""
        if self.op is None or self.op.kind != OpKind.SPEC:
            raise UsageError(f"case {self.label()} runs no speculative step: it has no draft")
        n, k, m = self.prefix + self.length, self.op.amount, self.spec_accepted
        rejected = tokens[n + m : n + k]
        if rejected.numel() < k - m:
            rejected = torch.cat([rejected, tokens[: k - m - rejected.numel()]])
        return torch.cat([tokens[n : n + m], (rejected + _DRAFT_SHIFT) % vocab_size])

    @property
    def spec_records(self) -> list[tuple[SpecRole, int]]:
        """The records a ``spec`` case compares, in order, with their query positions (``n`` = prompt
        end, ``M`` accepted): the drafter's decode steps over the accepted draft tokens (``draft``,
        ``n..n+M-1``), the target's verify rows of the accepted tokens (``verify``, ``n..n+M-1``;
        the rejected rows read other tokens than the stream), the drafter's first step after its
        rollback (``redraft``, ``n+M``), then the target's decode steps (``decode``, from ``n+M``)."""
        if self.op is None or self.op.kind != OpKind.SPEC:
            return []
        n, m = self.prefix + self.length, self.spec_accepted
        accepted = range(n, n + m)
        return [
            *(("draft", t) for t in accepted),
            *(("verify", t) for t in accepted),
            ("redraft", n + m),
            *(("decode", n + m + s) for s in range(self.decode_steps)),
        ]

    @property
    def positions_needed(self) -> int:
        """Positions the case reaches (its highest position + 1), draft and shift included."""
        need = self.total + self.shift
        if self.op is not None and self.op.kind in (OpKind.ROLLBACK, OpKind.SPEC):  # the draft's positions
            need = max(need, self.prefix + self.length + self.op.amount)
        return need

    @property
    def total(self) -> int:
        """Tokens the case touches: prefix + prompt (+ a ``spec`` case's accepted draft) + decoded."""
        return self.prefix + self.length + self.spec_accepted + self.decode_steps

    @property
    def decode_positions(self) -> list[int]:
        """Position of every decode step in order: ``P + L + s``, plus the shift of a ``shift`` case;
        a ``batch`` case lists step ``s`` of every row before step ``s + 1`` (rows in order)."""
        if self.op is not None and self.op.kind == OpKind.BATCH:
            return [L + s for s in range(self.decode_steps) for L in self.batch_lengths]
        if self.op is not None and self.op.kind == OpKind.SPEC:
            return [t for _, t in self.spec_records]
        start = self.prefix + self.length + self.shift
        return list(range(start, start + self.decode_steps))

    @property
    def window_wrapped(self) -> bool:
        return self.window is not None and self.total - 1 > self.window + self.sink_tokens

    def label(self) -> str:
        parts = [f"L={self.length}", f"P={self.prefix}", f"B={self.block_size}"]
        if self.window is not None:
            parts.append(f"W={self.window}" + (f"+{self.sink_tokens}s" if self.sink_tokens else ""))
        elif self.model_attention is not None:
            parts.append(self.model_attention.label())
        if self.chunk is not None:
            parts.append(f"chunk={self.chunk}")
        parts.append(f"S={self.decode_steps}")
        if self.op is not None:
            parts.append(self.op.label())
        if self.image is not None:
            parts.append(self.image.label())
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_matrix(max_positions: int | None = None) -> list[Case]:
    """The default cases: length 1; one below / at / one above a block boundary; an odd block size; a
    prefix offset that is not a multiple of the block size; chunked prefill with an odd chunk; a
    wrapped odd-size window with and without sinks; and one context over 1,000 tokens. With
    ``max_positions``, only those that fit a model of that many positions; without, every one (the
    harness reports those a model is too short for as not applicable, with the reason)."""
    cases = [
        Case(length=1),
        Case(length=15, block_size=16),
        Case(length=16, block_size=16),
        Case(length=17, block_size=16),
        Case(length=20, block_size=7),
        Case(length=30, prefix=13, block_size=7),
        Case(length=61, prefix=13, block_size=16, chunk=17),
        Case(length=48, block_size=7, window=37),
        Case(length=40, block_size=5, window=13, sink_tokens=2, chunk=9),
        Case(length=1100, prefix=0, block_size=16, chunk=256),
        *default_op_cases(),
    ]
    return cases if max_positions is None else [c for c in cases if c.positions_needed <= max_positions]


LONG_CONTEXT = 8192  # the long case of a windowed model (ropekv check --long): a 512 ring wraps 16 times


def window_matrix(window: int, *, long: bool = False) -> list[Case]:
    """The default cases of a model whose sliding layers keep ``window`` keys (gemma3: 512), under
    the model's own windows: the window crossed by one token, by a fraction and twice over (the
    rings wrap while full-attention layers keep every key); a prefix-cache hit that ends just below
    the window edge, so the suffix crosses it; a chunked prefill whose middle chunk straddles the
    edge; and, with ``long``, one case of :data:`LONG_CONTEXT` tokens."""
    w = window
    cases = [  # for w = 512: 513, 600, 1,100 tokens
        Case(length=w + 1),
        Case(length=w + 88, block_size=16),
        Case(length=2 * w + 76, block_size=16, chunk=256),  # two wraps, chunked
        Case(length=91, prefix=w - 3, block_size=16),  # the hit stops 3 keys short of the edge; 600 in all
        Case(length=w + 88, block_size=32, chunk=w // 2 + 45),  # chunk 2 covers [301, 602): the edge inside
    ]
    if long:
        cases.append(Case(length=LONG_CONTEXT, block_size=32, chunk=1024, decode_steps=2))
    return cases


def model_window(layers: Sequence[LayerAttention]) -> int | None:
    """The window of a model's sliding layers (the largest, where they differ), or None without any."""
    sizes = [la.window for la in layers if la.kind == "sliding" and la.window is not None]
    return max(sizes) if sizes else None


def slide_note(case: Case, layers: Sequence[LayerAttention]) -> str | None:
    """Which layers slid in ``case`` under the model's own windows (None when the model has no sliding
    layer, or the case forces a window of its own): the sliding layers that dropped keys by the last
    decode step, how many, and the full layers that read every key."""
    if case.window is not None:
        return None
    sliding = [i for i, la in enumerate(layers) if la.kind == "sliding" and la.window is not None]
    if not sliding:
        return None
    seen = case.total  # the keys in context at the last decode step, its own included
    window = min(layers[i].window or 0 for i in sliding)
    full = [i for i, la in enumerate(layers) if la.kind == "full"]
    full_text = f"; full layers {_ranges(full)} read all {seen:,}" if full else ""
    if seen <= window:
        return f"no layer slid: {seen:,} keys fit the {window:,}-key window{full_text}"
    return (
        f"sliding layers {_ranges(sliding)} dropped {seen - window:,} of {seen:,} keys at the last decode "
        f"(each {window:,}-slot ring wrapped {(seen - 1) // window}x){full_text}"
    )


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 4]`` -> ``"0-2,4"``."""
    out: list[str] = []
    for i in indices:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def too_long(case: Case, max_positions: int) -> str | None:
    """Why ``case`` cannot run on a model of ``max_positions`` positions (None: it fits).

    A ``shift`` case needs its span (its tokens) within the model's positions, not its highest
    position: a shift exists only for shift-invariant RoPE (``ropekv.parity.applicable`` refuses the
    others), whose scores depend on ``i - j`` alone, so a sequence shifted past the model's positions
    sees the distances it was trained on while its absolute positions test the engine's index types
    (a position held in 16 bits wraps past 32,767)."""
    need = case.positions_needed - case.shift
    if need <= max_positions:
        return None
    return f"needs {need} positions; the model has {max_positions}"


def check_numbers(case: Case, max_positions: int) -> None:
    """UsageError unless the case's block size, window (with its sinks) and chunk fit in the model's
    ``max_positions`` positions: a block, ring or chunk larger than every position a case can reach
    holds nothing more, and would only allocate memory (a block of 10^7 slots is 12.8 GB on the
    default model)."""
    for what, value in (
        ("block size", case.block_size),
        ("window", None if case.window is None else case.window + case.sink_tokens),
        ("chunk", case.chunk),
    ):
        if value is not None and value > max_positions:
            shown = f"{case.window}+{case.sink_tokens} sinks" if what == "window" and case.sink_tokens else value
            raise UsageError(
                f"case {case.label()}: {what} {shown} is larger than the model's {max_positions} positions "
                f"(no case can reach more; give at most {max_positions})"
            )


def default_op_cases() -> list[Case]:
    """One case per cache operation (docs/ops.md): a rollback whose draft overwrites slots of a wrapped
    odd-size ring, an eviction after a prefix-cache hit, a shift by 1,000 across blocks, a batch of three
    lengths, and a restore of a wrapped window with sinks."""
    # Two decode steps each: the second reads the key the first wrote after the operation; a third
    # adds comparison time (about a tenth of the default matrix per op case) and no new evidence.
    return [
        Case(length=48, block_size=7, window=37, decode_steps=2, op=CacheOp(OpKind.ROLLBACK, 3)),
        Case(length=30, prefix=13, block_size=7, decode_steps=2, op=CacheOp(OpKind.EVICT, 5)),
        Case(length=20, block_size=7, decode_steps=2, op=CacheOp(OpKind.SHIFT, 1000)),
        Case(length=20, block_size=7, decode_steps=2, op=CacheOp(OpKind.BATCH, 3)),
        Case(length=40, block_size=5, window=13, sink_tokens=2, chunk=9, decode_steps=2, op=CacheOp(OpKind.RESTORE)),
    ]


def default_spec_case() -> Case:
    """The case ``--ops spec:K`` runs without other flags (not in the default matrix: a speculative
    step is asked for): an odd-size window that has wrapped, so the verify pass overwrites ring slots
    and the rejected tokens' rollback must restore them."""
    return Case(length=48, block_size=7, window=37, decode_steps=2, op=CacheOp(OpKind.SPEC, 3))


def op_matrix(ops: list[CacheOp], base: list[Case] | None) -> list[Case]:
    """Cases for ``ops``: each operation on every ``base`` case, or on its own default case
    (:func:`default_op_cases`, with the given amount) when there is no base."""
    if base is None:
        defaults = {c.op.kind: c for c in [*default_op_cases(), default_spec_case()] if c.op is not None}
        return [dataclasses.replace(defaults[op.kind], op=op) for op in ops]
    return [dataclasses.replace(c, op=op) for op in ops for c in base]


def build_matrix(
    *,
    lengths: list[int] | None = None,
    block_sizes: list[int] | None = None,
    prefix_offsets: list[int] | None = None,
    window: int | None = None,
    sink_tokens: int = 0,
    chunk: int | None = None,
    decode_steps: int | None = None,
    max_positions: int,
    ops: list[CacheOp] | None = None,
    windowed: int | None = None,
    long: bool = False,
) -> list[Case]:
    """The cartesian product of the given values, or the default matrix when nothing is given.

    Cases the model is too short for are refused when asked for (lengths, block sizes or prefix
    offsets given), and kept when they come from the default matrix (the report lists them as not
    applicable, with the reason). A block size, window or chunk larger than the model's positions is
    refused (:func:`check_numbers`). ``window``/``chunk``/``decode_steps`` given alone modify every
    default case. An empty list is
    refused (it would otherwise quietly mean the defaults). ``ops`` (``--ops``): the cases are then the
    operations, each on every case the other flags give, or on its default case when none are given.
    ``windowed``: the model's own sliding window (:func:`model_window`); the default matrix is then
    :func:`window_matrix` (``long`` adds its long case), and the operations run on its second (600 tokens for w=512).
    """
    if long and windowed is None:
        raise UsageError("--long is the long case of a model with sliding layers; this model has none")
    for flag, values in (("lengths", lengths), ("block_sizes", block_sizes), ("prefix_offsets", prefix_offsets)):
        if values is not None and len(values) == 0:
            raise UsageError(f"{flag} is empty: give at least one value, or None for the default matrix")
    if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 1:
        raise UsageError(f"max_positions must be a positive integer, got {max_positions!r}")
    explicit_lengths = not (lengths is None and block_sizes is None and prefix_offsets is None)
    if not explicit_lengths:
        # Every default case, those too long for the model included: the harness lists them as n/a.
        cases = default_matrix() if windowed is None else window_matrix(windowed, long=long)
        if window is not None or chunk is not None or decode_steps is not None or sink_tokens:
            cases = [
                Case(
                    length=c.length,
                    prefix=c.prefix,
                    block_size=c.block_size,
                    window=window if window is not None else c.window,
                    sink_tokens=sink_tokens if window is not None else c.sink_tokens,
                    chunk=chunk if chunk is not None else c.chunk,
                    decode_steps=decode_steps or c.decode_steps,
                )
                for c in cases
            ]
    else:
        cases = [
            Case(
                length=L,
                prefix=P,
                block_size=B,
                window=window,
                sink_tokens=sink_tokens,
                chunk=chunk,
                decode_steps=decode_steps or 3,
            )
            for L, B, P in itertools.product(lengths or [1, 17, 513], block_sizes or [16], prefix_offsets or [0])
        ]
    if ops:
        explicit = not (lengths is None and block_sizes is None and prefix_offsets is None)
        if windowed is not None and not explicit:  # the model's windows, not a case window: ops on its rings
            cases = op_matrix(ops, [dataclasses.replace(window_matrix(windowed)[1], decode_steps=2)])
        else:
            cases = op_matrix(ops, cases if explicit else None)
        if not explicit and (window is not None or chunk is not None or decode_steps is not None):
            cases = [
                dataclasses.replace(
                    c,
                    window=window if window is not None else c.window,
                    sink_tokens=sink_tokens if window is not None else c.sink_tokens,
                    chunk=chunk if chunk is not None else c.chunk,
                    decode_steps=decode_steps or c.decode_steps,
                )
                for c in cases
            ]
    for c in cases:
        why = too_long(c, max_positions)
        if why is None:
            check_numbers(c, max_positions)
        elif explicit_lengths:  # asked for: refused before any weight is read
            raise UsageError(f"case {c.label()} {why}")
    return cases


def token_stream(vocab_size: int, n: int, seed: int = 0) -> torch.Tensor:
    """A deterministic token sequence ``[n]`` (seeded uniform ids, skipping the first few special ids)."""
    g = torch.Generator().manual_seed(seed)
    low = min(16, vocab_size - 1)
    return torch.randint(low, vocab_size, (n,), generator=g, dtype=torch.int64)


def _check_int(what: str, value: Any, low: int) -> None:
    """UsageError unless ``value`` is an int (not a bool) >= ``low``; one message for every value
    out of range (0 and -5 alike)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UsageError(f"{what} must be an integer >= {low}, got {value!r}")
