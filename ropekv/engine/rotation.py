"""Where positions become rotations: the one place the engine turns positions into RoPE.

:class:`RotationPolicy` is the correct behaviour. Every catalogued bug class is a small subclass
that overrides one method (see the bug classes' modules, ``ropekv.bugs``), so a fault is a named, reviewable variant
and the engine itself has no fault switches. Stored positions are always the logical truth; a policy
only decides how they turn queries and keys.

cos/sin come from tables the engine builds once per step (:class:`RopeTable`, one for the step's
query positions and one per window group's key positions) and hands to every layer in the
:class:`StepContext`, as gpt-fast passes ``freqs_cis[input_pos]`` down its layers; the tables are
rows of one per-engine :class:`RopeTables` (``rope.cos_sin`` of ``0..size-1``). Nothing is memoized
across steps or kept in module state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..contract import CacheContract
from ..errors import ContractMismatch
from ..rope import PositionStreams, RopeSpec, apply_rotation


@dataclass(frozen=True, eq=False)
class RopeTable:
    """cos/sin of one positions tensor under one spec in one working dtype (``[T, 1, rotary_dim / 2]``).

    A key table (``heads > 0``, for a rotate-on-read backend turning a layer's cached keys) also
    holds them head-major: ``cos_wide`` ``[1, T, 2n]`` (cos for both halves) and ``sin_heads``
    ``[1, T, n]``, broadcast over the heads. The pool lays each KV head's keys out contiguously
    (``ropekv.cache.paged``), so a key rotation is three passes, the first over whole contiguous
    rows, and writes keys the attention matmuls read fastest."""

    rope: RopeSpec
    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [T, 1, rotary_dim / 2], rope.cos_sin rows cast to the working dtype
    sin: torch.Tensor
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # compiled neox_rotate
    heads: int = 0  # the KV heads a key table serves (0: a query table)
    cos_wide: torch.Tensor | None = None  # [1, T, 2n] (key tables of the eager path)
    sin_heads: torch.Tensor | None = None  # [1, T, n]
    cos_both: torch.Tensor | None = None  # [T, 1, 2n]: cos for both halves (query tables)
    sin_signed: torch.Tensor | None = None  # [T, 1, 2n]: -sin for the first half, sin for the second

    def serves(self, rope: RopeSpec, positions: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether this table is ``rope.cos_sin(positions)`` for ``x [T, heads, D]`` (the engine hands
        every layer the very ``positions`` tensor it built the table from)."""
        return (
            positions is self.positions
            and (rope is self.rope or rope == self.rope)
            and x.dim() == 3
            and x.shape[0] == self.cos.shape[0]
            and self.heads in (0, x.shape[1])
            and (x.dtype == self.cos.dtype or x.dtype in (torch.bfloat16, torch.float16))
        )

    def rotate(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``rope.rotate(x, positions)`` for ``x [T, heads, D]``, written into ``out`` when given (same
        shape, the working dtype; it must not overlap ``x``). Full-width neox rotary takes the lean
        path below (head-major for a key table); other layouts and partial rotary take
        :func:`~ropekv.rope.apply_rotation`."""
        n = self.cos.shape[-1]
        work = self.cos.dtype
        if self.rope.layout != "neox" or x.shape[-1] != 2 * n:
            result = apply_rotation(x, self.cos[:, 0], self.sin[:, 0], self.rope.layout, self.rope.rotary_offset)
            return result if out is None else out.copy_(result)
        if x.dtype != work:
            x = x.to(work)
        if self.kernel is not None:  # one fused pass (torch.compile); ``out`` would only add a copy
            return self.kernel(x.transpose(0, 1), self.cos.transpose(0, 1), self.sin.transpose(0, 1)).transpose(0, 1)
        if (
            self.cos_wide is not None and self.sin_heads is not None
        ):  # a key table: every operand seen head-major, [heads, T, .]
            if out is None:  # head-major, as the pool
                out = torch.empty((x.shape[1], x.shape[0], x.shape[2]), dtype=work, device=x.device).transpose(0, 1)
            xh, oh = x.transpose(0, 1), out.transpose(0, 1)
            torch.mul(xh, self.cos_wide, out=oh)  # [a * cos, b * cos]
            oh[..., :n].addcmul_(xh[..., n:], self.sin_heads, value=-1.0)  # a * cos - b * sin
            oh[..., n:].addcmul_(xh[..., :n], self.sin_heads)  # b * cos + a * sin
            return out
        if self.cos_both is not None and self.sin_signed is not None:  # a query table: three calls
            # [a, b] * [cos, cos] + [b, a] * [-sin, sin]: the products and sums of the four-call form
            # below, rounded alike (the negation is exact), with a third of the dispatches; a decode
            # step turns a query and a key this way in every layer
            turned = torch.addcmul(x * self.cos_both, x.roll(n, -1), self.sin_signed)
            return turned if out is None else out.copy_(turned)
        if out is None:
            out = torch.empty(x.shape, dtype=work, device=x.device)
        a, b = x[..., :n], x[..., n:]
        first, second = out[..., :n], out[..., n:]
        torch.mul(a, self.cos, out=first)
        first.addcmul_(b, self.sin, value=-1.0)  # a * cos - b * sin
        torch.mul(b, self.cos, out=second)
        second.addcmul_(a, self.sin)  # b * cos + a * sin
        return out


class RopeTables:
    """``rope.cos_sin(arange(size))`` for one spec, dtype and device, grown on demand; owned by an
    engine (not shared between engines or processes). :meth:`table` gathers a step's rows."""

    MAX_POSITIONS = 1 << 20  # beyond this (a buggy position), no table: the policy falls back

    def __init__(self, rope: RopeSpec, dtype: torch.dtype, device: torch.device, *, compile_keys: bool = False):
        self.rope, self.dtype, self.device = rope, dtype, device
        self._cos = self._sin = torch.empty(0, rope.rotary_dim // 2, dtype=dtype, device=device)
        # Key tables rotate with one compiled pass (read keys, write rotated keys) instead of four eager
        # ones: the eager passes dominate a rotate-on-read step at long contexts.
        self._kernel = torch.compile(neox_rotate, dynamic=True) if compile_keys else None

    def table(self, positions: torch.Tensor, heads: int = 1) -> RopeTable | None:
        """The rows of ``positions [T]`` expanded to ``heads``, or None when a table cannot serve them
        (length-dependent RoPE, negative or huge positions, an empty tensor)."""
        if (
            self.rope.length_dependent
            or positions.dim() != 1
            or positions.dtype != torch.int64
            or positions.numel() == 0
        ):
            return None
        lo, hi = (int(v) for v in torch.aminmax(positions))
        if lo < 0 or hi >= self.MAX_POSITIONS:
            return None
        if self._cos.shape[0] <= hi:
            size = max(4096, 1 << hi.bit_length())
            cos, sin = self.rope.cos_sin(torch.arange(size, dtype=torch.int64))  # float64 [size, n]
            self._cos = cos.to(device=self.device, dtype=self.dtype)
            self._sin = sin.to(device=self.device, dtype=self.dtype)
        index = positions.to(self.device)
        cos, sin = self._cos.index_select(0, index)[:, None], self._sin.index_select(0, index)[:, None]
        if heads <= 1:
            both, signed = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [T, 1, 2n]
            return RopeTable(self.rope, positions, cos, sin, cos_both=both, sin_signed=signed)
        if self._kernel is not None:
            return RopeTable(self.rope, positions, cos, sin, self._kernel, heads)
        cos_wide = torch.cat((cos, cos), dim=-1).transpose(0, 1)  # [1, T, 2n], broadcast over the heads
        return RopeTable(self.rope, positions, cos, sin, None, heads, cos_wide, sin.transpose(0, 1))


def neox_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Full-width neox rotation of ``x [heads, T, 2n]`` by ``cos/sin [1, T, n]`` (the same
    products, differences and sums as :func:`~ropekv.rope.apply_rotation`); what ``torch.compile``
    fuses into one pass for the key tables."""
    n = cos.shape[-1]
    a, b = x[..., :n], x[..., n:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


@dataclass(frozen=True)
class OpFacts:
    """Cache operations a sequence went through before this step (ropekv/cache/paged.py), as counts.

    The correct policy ignores them: stored positions are the truth after every operation. They exist
    so that a fault policy can model an engine whose rotation offset an operation put out of step with
    the logical positions (``ropekv.bugs.rollback_offset`` and its kin). ``padding`` is the row's left padding in a
    merged batch (``Engine.decode_batch``).
    """

    rolled_back: int = 0  # tokens given back by rollbacks
    evicted: int = 0  # tokens dropped by evictions
    restored: int = 0  # tokens loaded from a saved cache
    padding: int = 0  # left padding of this row in a batched step


NO_OPS = OpFacts()

# "prefill": a chunk of new tokens; "decode": one new token; "full": the engine's cache-free forward;
# "verify": a speculative draft appended in one forward (Engine.verify)
Phase = Literal["prefill", "decode", "full", "verify"]
CACHED_PHASES: tuple[Phase, ...] = ("prefill", "decode", "verify")  # the phases that read and write the cache


@dataclass(frozen=True)
class StepContext:
    """What a policy may know about the step in progress.

    ``phase`` is ``"prefill"`` (a chunk of new tokens), ``"decode"`` (one new token), ``"verify"``
    (a speculative draft verified in one forward) or ``"full"`` (the engine's own cache-free forward,
    used for self-parity). ``seq_len`` is the length the
    frequencies are computed for (length-dependent RoPE): a decode's or a verify's last position + 1,
    and for every chunk of a prefill the length the whole prefill reaches; ``fork_offset`` the prefix length the
    sequence was forked at (0 if it was not); ``block_size`` the cache's block size. ``tables``: the
    step's cos/sin tables (its query positions, each window group's key positions); ``key_scratch``:
    a buffer ``[N, KVH, D]`` (working dtype) a rotating read may write the layer's keys into, reused
    by every layer of the step, or None. ``streams``: the sequence's mRoPE position streams by token
    index (image-like positions; None: text, one position per token), which :func:`rotate` turns an
    mRoPE spec's positions into.
    """

    phase: Phase
    seq_len: int
    fork_offset: int = 0
    block_size: int = 1
    ops: OpFacts = NO_OPS
    layer: int = 0
    layer_ropes: tuple[RopeSpec | None, ...] = ()  # the contract's spec per layer (None: NoPE)
    window_layers: tuple[int, ...] = ()  # the contract's sliding ("local") layers
    tables: tuple[RopeTable, ...] = field(default=(), compare=False)
    key_scratch: torch.Tensor | None = field(default=None, compare=False)
    streams: PositionStreams | None = field(default=None, compare=False)

    @property
    def cached(self) -> bool:
        """The step goes through the cache (a prefill chunk or a decode), not the cache-free forward."""
        return self.phase in CACHED_PHASES

    def for_layer(self, layer: int) -> StepContext:
        """This context for ``layer`` (faults that confuse layers read ``layer`` and ``layer_ropes``)."""
        return dataclasses.replace(self, layer=layer)

    def table_for(self, rope: RopeSpec | None, positions: torch.Tensor, x: torch.Tensor) -> RopeTable | None:
        if rope is None or (self.streams is not None and rope.mrope_section is not None):
            return None  # tables are by one position per token; streams are rotated directly
        return next((t for t in self.tables if t.serves(rope, positions, x)), None)


class RotationPolicy:
    """Correct rotation: queries and keys turn at their logical positions (or cache indices)."""

    name = "correct"

    def check_contract(self, contract: CacheContract) -> None:
        """Refuse a contract this policy cannot serve exactly: rotated keys under RoPE whose frequencies
        change with the sequence length (dynamic NTK, LongRoPE) would keep stale frequencies."""
        specs = [contract.layer_rope(i) for i in range(contract.num_layers)]
        if contract.key_form == "rotated" and any(r is not None and r.length_dependent for r in specs):
            raise ContractMismatch(
                f"key_form 'rotated' cannot serve {contract.rope.scaling.rope_type} RoPE: its frequencies change "
                "with the sequence length, so cached keys would keep stale frequencies while new queries turn "
                "at new ones. No cache matches a full forward past the switch beyond layer 0 (deeper keys come "
                "from hidden states computed under the old frequencies; docs/contract.md): key_form 'raw' "
                "(rotate on read) makes layer 0 exact and the harness then reports the rest as inherent",
                fields=("key_form", "rope.scaling"),
            )

    def query(self, rope: RopeSpec | None, q: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Rotate queries ``q [n, H, D]`` to their rotation indices ``positions [n]``."""
        return rotate(rope, q, positions, ctx)

    def write_key(
        self, rope: RopeSpec | None, k: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """The form a ``"rotated"`` cache stores for new raw keys ``k [n, KVH, D]``: rotated at ``positions``."""
        return rotate(rope, k, positions, ctx)

    def read_keys(
        self,
        rope: RopeSpec | None,
        stored: torch.Tensor,
        rotation_index: torch.Tensor,
        slots: torch.Tensor,
        ctx: StepContext,
        *,
        backend_rotates: bool,
    ) -> torch.Tensor:
        """Keys ``[N, KVH, D]`` as the kernel uses them, from the stored form.

        A rotating backend turns raw keys to ``rotation_index`` (logical positions, never ``slots``) in
        float32 or wider, into ``ctx.key_scratch`` when it fits; a non-rotating backend reads rotated
        keys as stored.
        """
        if not backend_rotates:
            return stored
        work = stored if stored.dtype == torch.float64 else stored.float()
        table = ctx.table_for(rope, rotation_index, stored)
        if table is None:
            return rotate(rope, work, rotation_index, ctx)
        out = ctx.key_scratch  # for the layer's keys (a table expanded to the KV heads), not a step's new key
        fits = (
            out is not None
            and table.heads == stored.shape[1] > 1
            and out.shape[0] >= stored.shape[0]
            and out.shape[1:] == stored.shape[1:]
            and out.dtype == table.cos.dtype
        )
        return table.rotate(stored, out[: stored.shape[0]] if out is not None and fits else None)


def rotate(
    rope: RopeSpec | None, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext | None = None
) -> torch.Tensor:
    """``rope.rotate(x, positions, ctx.seq_len)`` (working dtype), from the step's table when it has
    one for these positions, else computed (faults hand in other positions or specs); under mRoPE with
    ``ctx.streams``, at the streams of those positions; ``x`` itself for ``rope=None`` (a NoPE layer: no position embedding, nothing turns)."""
    if rope is None:
        return x
    if ctx is not None and ctx.streams is not None and rope.mrope_section is not None:
        return rope.rotate(x, ctx.streams.at(positions), ctx.seq_len)  # each section by its own stream
    table = None if ctx is None else ctx.table_for(rope, positions, x)
    if table is None:
        return rope.rotate(x, positions, None if ctx is None else ctx.seq_len)
    return table.rotate(x).to(x.dtype)
