"""Parity cases: what one cached run does, and the default matrix.

A case: the first ``prefix`` tokens come from a prefix-cache hit (a parent sequence prefilled earlier,
then forked at ``prefix``), the next ``length`` tokens are prefilled (in chunks of ``chunk`` tokens if
set), then ``decode_steps`` tokens are decoded one at a time. Decode step ``s`` feeds the token at
logical position ``t = prefix + length + s`` and is compared with row ``t`` of a full forward.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch

from ..errors import UsageError


@dataclass(frozen=True)
class Case:
    length: int
    prefix: int = 0
    block_size: int = 16
    window: int | None = None
    sink_tokens: int = 0
    chunk: int | None = None
    decode_steps: int = 3

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

    @property
    def total(self) -> int:
        """Tokens the case touches: prefix + prompt + decoded."""
        return self.prefix + self.length + self.decode_steps

    @property
    def decode_positions(self) -> list[int]:
        start = self.prefix + self.length
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
        return " ".join(parts)

    def to_dict(self) -> dict:
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
    ]
    return [c for c in cases if c.total <= max_positions]


def build_matrix(*, lengths=None, block_sizes=None, prefix_offsets=None, window=None, sink_tokens=0,
                 chunk=None, decode_steps=None, max_positions: int) -> list[Case]:
    """The cartesian product of the given values, or the default matrix when nothing is given.

    ``window``/``chunk``/``decode_steps`` given alone modify every default case. An empty list is
    refused (it would otherwise quietly mean the defaults).
    """
    for flag, values in (("lengths", lengths), ("block_sizes", block_sizes), ("prefix_offsets", prefix_offsets)):
        if values is not None and len(values) == 0:
            raise UsageError(f"{flag} is empty: give at least one value, or None for the default matrix")
    if lengths is None and block_sizes is None and prefix_offsets is None:
        cases = default_matrix(max_positions)
        if window is not None or chunk is not None or decode_steps is not None or sink_tokens:
            cases = [Case(length=c.length, prefix=c.prefix, block_size=c.block_size,
                          window=window if window is not None else c.window,
                          sink_tokens=sink_tokens if window is not None else c.sink_tokens,
                          chunk=chunk if chunk is not None else c.chunk,
                          decode_steps=decode_steps or c.decode_steps) for c in cases]
    else:
        cases = [
            Case(length=L, prefix=P, block_size=B, window=window, sink_tokens=sink_tokens, chunk=chunk,
                 decode_steps=decode_steps or 3)
            for L, B, P in itertools.product(lengths or [1, 17, 513], block_sizes or [16], prefix_offsets or [0])
        ]
    too_long = [c for c in cases if c.total > max_positions]
    if too_long:
        c = too_long[0]
        raise UsageError(f"case {c.label()} needs {c.total} positions; the model has {max_positions}")
    return cases


def token_stream(vocab_size: int, n: int, seed: int = 0) -> torch.Tensor:
    """A deterministic token sequence ``[n]`` (seeded uniform ids, skipping the first few special ids)."""
    g = torch.Generator().manual_seed(seed)
    low = min(16, vocab_size - 1)
    return torch.randint(low, vocab_size, (n,), generator=g, dtype=torch.int64)
