"""Parity cases: what one cached run does, and the default matrix.

A case: the first ``prefix`` tokens come from a prefix-cache hit (a parent sequence prefilled earlier,
then forked at ``prefix``), the next ``length`` tokens are prefilled (in chunks of ``chunk`` tokens if
set), then ``decode_steps`` tokens are decoded one at a time. Decode step ``s`` feeds the token at
logical position ``t = prefix + length + s`` and is compared with row ``t`` of a full forward.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import asdict, dataclass
from typing import Any, Literal, cast, get_args

import torch

from ..errors import UsageError

OpKind = Literal["rollback", "evict", "shift", "batch", "restore"]
OP_KINDS: tuple[str, ...] = get_args(OpKind)
_DRAFT_SHIFT = 7  # draft token ids: the real ones shifted, so a key left behind is a different token's


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
    """

    kind: OpKind
    amount: int = 0

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise UsageError(f"unknown cache operation {self.kind!r}; choose one of {', '.join(OP_KINDS)}")
        if not isinstance(self.amount, int) or isinstance(self.amount, bool):
            raise UsageError(f"{self.kind}: amount must be an integer, got {self.amount!r}")
        low = {"rollback": 1, "evict": 1, "shift": 1, "batch": 2, "restore": 0}[self.kind]
        if self.amount < low or (self.kind == "restore" and self.amount != 0):
            want = "no amount" if self.kind == "restore" else f"an amount >= {low}"
            raise UsageError(f"{self.kind} needs {want}, got {self.amount}")

    def label(self) -> str:
        return self.kind if self.kind == "restore" else f"{self.kind}:{self.amount}"


def parse_ops(text: str) -> list[CacheOp]:
    """``"rollback:3,evict:5,shift:1000,batch:3,restore"`` -> operations; one-line UsageError otherwise."""
    # Amounts are ASCII digits with an optional minus (str.isdigit() takes "²", which int() refuses),
    # bounded like every token count of the command line.
    from ..argtypes import MAX_TOKENS, strict_int

    ops = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            raise UsageError(f"--ops {text!r}: empty item; write e.g. rollback:3,evict:5,shift:1000,batch:3,restore")
        kind, sep, amount = item.partition(":")
        if kind not in OP_KINDS:
            raise UsageError(f"--ops: unknown operation {kind!r}; choose from {', '.join(OP_KINDS)}")
        value = strict_int(amount) if sep else 0
        if value is None or abs(value) > MAX_TOKENS:
            raise UsageError(f"--ops: {item!r}: the amount must be an integer of at most {MAX_TOKENS}")
        if kind != "restore" and not sep:
            raise UsageError(f"--ops: {kind} needs an amount, e.g. {kind}:3")
        ops.append(CacheOp(cast(OpKind, kind), value))
    return ops


@dataclass(frozen=True)
class Case:
    length: int
    prefix: int = 0
    block_size: int = 16
    window: int | None = None
    sink_tokens: int = 0
    chunk: int | None = None
    decode_steps: int = 3
    op: CacheOp | None = None

    def __post_init__(self) -> None:
        if self.length < 1:
            raise UsageError(f"case length must be >= 1, got {self.length}")
        if self.prefix < 0 or self.block_size < 1 or self.decode_steps < 1:
            raise UsageError(f"bad case {self}")
        if self.chunk is not None and self.chunk < 1:
            raise UsageError(f"chunk must be >= 1, got {self.chunk}")
        if self.window is not None and self.window < 1:
            raise UsageError(f"window must be >= 1, got {self.window}")
        if self.sink_tokens and self.window is None:
            raise UsageError("sink tokens need a window")
        if self.op is not None:
            self._check_op()

    def _check_op(self) -> None:
        op = self.op
        if not isinstance(op, CacheOp):
            raise UsageError(f"case op must be a CacheOp, got {type(op).__name__}")
        if op.kind == "batch" and (self.prefix or self.length < op.amount):
            raise UsageError(f"batch:{op.amount} needs prefix 0 and length >= {op.amount} (rows of different lengths)")
        if op.kind == "evict" and len(self._evict_candidates()) < op.amount:
            raise UsageError(
                f"evict:{op.amount}: a {self.prefix + self.length}-token prompt"
                + (f" under window {self.window}" if self.window else "")
                + f" has only {len(self._evict_candidates())} interior live tokens to evict"
            )

    # ------------------------------------------------------------------ operations

    def _evict_candidates(self) -> list[int]:
        n = self.prefix + self.length
        low = max(self.sink_tokens, 1, n - self.window + 1 if self.window else 1)
        return list(range(low, n - 1))  # never the first (sink-like) nor the newest token

    @property
    def evicted_positions(self) -> list[int]:
        """Positions an ``evict`` case drops after prefill: evenly spread over the interior live tokens."""
        if self.op is None or self.op.kind != "evict":
            return []
        cand, k = self._evict_candidates(), self.op.amount
        if k == 1:
            return [cand[len(cand) // 2]]
        return [cand[round(i * (len(cand) - 1) / (k - 1))] for i in range(k)]

    @property
    def shift(self) -> int:
        """Positions the cached sequence moved by (``shift`` cases), else 0."""
        return self.op.amount if self.op is not None and self.op.kind == "shift" else 0

    @property
    def batch_lengths(self) -> list[int]:
        """Prompt lengths of the rows of a ``batch`` case (row 0 is the longest), else ``[length]``."""
        if self.op is None or self.op.kind != "batch":
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
    def positions_needed(self) -> int:
        """Positions the case reaches (its highest position + 1), draft and shift included."""
        need = self.total + self.shift
        if self.op is not None and self.op.kind == "rollback":
            need = max(need, self.prefix + self.length + self.op.amount)
        return need

    @property
    def total(self) -> int:
        """Tokens the case touches: prefix + prompt + decoded."""
        return self.prefix + self.length + self.decode_steps

    @property
    def decode_positions(self) -> list[int]:
        """Position of every decode step in order: ``P + L + s``, plus the shift of a ``shift`` case;
        a ``batch`` case lists step ``s`` of every row before step ``s + 1`` (rows in order)."""
        if self.op is not None and self.op.kind == "batch":
            return [L + s for s in range(self.decode_steps) for L in self.batch_lengths]
        start = self.prefix + self.length + self.shift
        return list(range(start, start + self.decode_steps))

    @property
    def window_wrapped(self) -> bool:
        return self.window is not None and self.total - 1 > self.window + self.sink_tokens

    def label(self) -> str:
        parts = [f"L={self.length}", f"P={self.prefix}", f"B={self.block_size}"]
        if self.window is not None:
            parts.append(f"W={self.window}" + (f"+{self.sink_tokens}s" if self.sink_tokens else ""))
        if self.chunk is not None:
            parts.append(f"chunk={self.chunk}")
        parts.append(f"S={self.decode_steps}")
        if self.op is not None:
            parts.append(self.op.label())
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_matrix(max_positions: int) -> list[Case]:
    """The default cases: length 1; one below / at / one above a block boundary; an odd block size; a
    prefix offset that is not a multiple of the block size; chunked prefill with an odd chunk; a
    wrapped odd-size window with and without sinks; and one context over 1,000 tokens."""
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
    return [c for c in cases if c.positions_needed <= max_positions]


def default_op_cases() -> list[Case]:
    """One case per cache operation (docs/ops.md): a rollback whose draft overwrites slots of a wrapped
    odd-size ring, an eviction after a prefix-cache hit, a shift by 1,000 across blocks, a batch of three
    lengths, and a restore of a wrapped window with sinks."""
    # Two decode steps each: the second reads the key the first wrote after the operation; a third
    # adds comparison time (about a tenth of the default matrix per op case) and no new evidence.
    return [
        Case(length=48, block_size=7, window=37, decode_steps=2, op=CacheOp("rollback", 3)),
        Case(length=30, prefix=13, block_size=7, decode_steps=2, op=CacheOp("evict", 5)),
        Case(length=20, block_size=7, decode_steps=2, op=CacheOp("shift", 1000)),
        Case(length=20, block_size=7, decode_steps=2, op=CacheOp("batch", 3)),
        Case(length=40, block_size=5, window=13, sink_tokens=2, chunk=9, decode_steps=2, op=CacheOp("restore")),
    ]


def op_matrix(ops: list[CacheOp], base: list[Case] | None) -> list[Case]:
    """Cases for ``ops``: each operation on every ``base`` case, or on its own default case
    (:func:`default_op_cases`, with the given amount) when there is no base."""
    if base is None:
        defaults = {c.op.kind: c for c in default_op_cases() if c.op is not None}
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
) -> list[Case]:
    """The cartesian product of the given values, or the default matrix when nothing is given.

    ``window``/``chunk``/``decode_steps`` given alone modify every default case. An empty list is
    refused (it would otherwise quietly mean the defaults). ``ops`` (``--ops``): the cases are then the
    operations, each on every case the other flags give, or on its default case when none are given.
    """
    for flag, values in (("lengths", lengths), ("block_sizes", block_sizes), ("prefix_offsets", prefix_offsets)):
        if values is not None and len(values) == 0:
            raise UsageError(f"{flag} is empty: give at least one value, or None for the default matrix")
    if lengths is None and block_sizes is None and prefix_offsets is None:
        cases = default_matrix(max_positions)
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
    too_long = [c for c in cases if c.positions_needed > max_positions]
    if too_long:
        c = too_long[0]
        raise UsageError(f"case {c.label()} needs {c.positions_needed} positions; the model has {max_positions}")
    return cases


def token_stream(vocab_size: int, n: int, seed: int = 0) -> torch.Tensor:
    """A deterministic token sequence ``[n]`` (seeded uniform ids, skipping the first few special ids)."""
    g = torch.Generator().manual_seed(seed)
    low = min(16, vocab_size - 1)
    return torch.randint(low, vocab_size, (n,), generator=g, dtype=torch.int64)
