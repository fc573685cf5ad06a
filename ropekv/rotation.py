"""Where positions become rotations: the one place the engine turns positions into RoPE.

:class:`RotationPolicy` is the correct behaviour. Every bug class of the primer is a small subclass
that overrides one method (see ``ropekv.parity.faults``), so a fault is a named, reviewable variant
and the engine itself has no fault switches. Stored positions are always the logical truth; a policy
only decides how they turn queries and keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rope import RopeSpec, apply_rotation


@dataclass(frozen=True)
class OpFacts:
    """Cache operations a sequence went through before this step (ropekv/cache/paged.py), as counts.

    The correct policy ignores them: stored positions are the truth after every operation. They exist
    so that a fault policy can model an engine whose rotation offset an operation put out of step with
    the logical positions (``ropekv.parity.op_faults``). ``padding`` is the row's left padding in a
    merged batch (``ropekv.batch``).
    """

    rolled_back: int = 0  # tokens given back by rollbacks
    evicted: int = 0  # tokens dropped by evictions
    restored: int = 0  # tokens loaded from a saved cache
    padding: int = 0  # left padding of this row in a batched step


NO_OPS = OpFacts()


@dataclass(frozen=True)
class StepContext:
    """What a policy may know about the step in progress.

    ``phase`` is ``"prefill"`` (a chunk of new tokens), ``"decode"`` (one new token) or ``"full"``
    (the engine's own cache-free forward, used for self-parity). ``seq_len`` is the length the
    frequencies are computed for (length-dependent RoPE); ``fork_offset`` the prefix length the
    sequence was forked at (0 if it was not); ``block_size`` the cache's block size.
    """

    phase: str
    seq_len: int
    fork_offset: int = 0
    block_size: int = 1
    ops: OpFacts = NO_OPS


class RotationPolicy:
    """Correct rotation: queries and keys turn at their logical positions (or cache indices)."""

    name = "correct"

    def check_contract(self, contract) -> None:
        """Refuse a contract this policy cannot serve exactly: rotated keys under RoPE whose frequencies
        change with the sequence length (dynamic NTK, LongRoPE) would keep stale frequencies."""
        if contract.key_form == "rotated" and contract.rope.length_dependent:
            from .errors import ContractMismatch

            raise ContractMismatch(
                f"key_form 'rotated' cannot serve {contract.rope.scaling.rope_type} RoPE: its frequencies change "
                "with the sequence length, so cached keys would keep stale frequencies while new queries turn "
                "at new ones. No cache matches a full forward past the switch beyond layer 0 (deeper keys come "
                "from hidden states computed under the old frequencies; docs/contract.md): key_form 'raw' "
                "(rotate on read) makes layer 0 exact and the harness then reports the rest as inherent",
                fields=("key_form", "rope.scaling"),
            )

    def query(self, rope: RopeSpec, q: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Rotate queries ``q [n, H, D]`` to their rotation indices ``positions [n]``."""
        return rotate(rope, q, positions, ctx.seq_len)

    def write_key(self, rope: RopeSpec, k: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  ctx: StepContext) -> torch.Tensor:
        """The form a ``"rotated"`` cache stores for new raw keys ``k [n, KVH, D]``: rotated at ``positions``."""
        return rotate(rope, k, positions, ctx.seq_len)

    def read_keys(self, rope: RopeSpec, stored: torch.Tensor, rotation_index: torch.Tensor, slots: torch.Tensor,
                  ctx: StepContext, *, backend_rotates: bool) -> torch.Tensor:
        """Keys ``[N, KVH, D]`` as the kernel uses them, from the stored form.

        A rotating backend turns raw keys to ``rotation_index`` (logical positions, never ``slots``) in
        float32 or wider; a non-rotating backend reads rotated keys as stored.
        """
        if backend_rotates:
            work = stored if stored.dtype == torch.float64 else stored.float()
            return rotate(rope, work, rotation_index, ctx.seq_len)
        return stored


def rotate(rope: RopeSpec, x: torch.Tensor, positions: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
    """``rope.rotate(x, positions, seq_len)``, with cos/sin read from a per-spec table.

    Why: ``rope.rotate`` recomputes ``inv_freq`` and float64 cos/sin of every position at every call;
    a rotate-on-read decode step does that for every cached key in every layer. The table rows are
    ``rope.cos_sin`` of the same positions (computed by that same function, then cast to the working
    dtype exactly as ``apply_rotation`` would), so results do not change. Length-dependent RoPE,
    negative or out-of-range positions and anything unusual take ``rope.rotate`` itself.
    """
    if (rope.length_dependent or not isinstance(positions, torch.Tensor) or positions.dim() != 1
            or positions.dtype != torch.int64 or positions.numel() == 0 or not x.is_floating_point()):
        return rope.rotate(x, positions, seq_len)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos_sin = _TABLES.lookup(rope, positions, work)
    if cos_sin is None:
        return rope.rotate(x, positions, seq_len)
    cos, sin = cos_sin  # [T, 1, rotary_dim / 2]
    n = cos.shape[-1]
    if (rope.layout == "neox" and x.dtype == work and x.shape[-1] == 2 * n and x.dim() >= 3
            and x.shape[-3] == cos.shape[0]):
        return _rotate_neox(x, cos, sin)
    return apply_rotation(x, cos[:, 0], sin[:, 0], rope.layout)


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotation(x, cos, sin, "neox")`` for full-width rotary in the working dtype, the same
    products, differences and sums in the same order (so bit for bit), written into one output.

    Why: rotate-on-read turns every cached key of every layer at every step. apply_rotation makes
    six half-size temporaries and concatenates them; at a few MB per layer each fresh tensor is a
    fresh mapping from the allocator, and the page faults (one per 4 KiB) cost more than the
    arithmetic. Here the halves are written in place and one scratch buffer serves all products.
    (Working through the keys in cache-sized blocks of tokens was tried: no faster on two threads.)
    """
    n = cos.shape[-1]
    a, b = x[..., :n], x[..., n:]
    if x.numel() < _SMALL:  # a step's new queries and keys: fewer calls beat fewer allocations
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    first, second = out[..., :n], out[..., n:]
    tmp = _scratch(a.shape, x.dtype, x.device)
    torch.mul(a, cos, out=first)
    first.sub_(torch.mul(b, sin, out=tmp))  # a * cos - b * sin
    torch.mul(b, cos, out=second)
    second.add_(torch.mul(a, sin, out=tmp))  # b * cos + a * sin
    return out


_SMALL = 1 << 16  # elements
_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused buffer of ``shape`` (per dtype and device; its contents never escape a call)."""
    numel = shape.numel()
    buf = _SCRATCH.get((dtype, device))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel + numel // 4, dtype=dtype, device=device)  # headroom: contexts grow by a token a step
        _SCRATCH[(dtype, device)] = buf
    return buf[:numel].view(shape)


class _CosSinTables:
    """``rope.cos_sin(arange(size))`` per (spec, dtype, device), grown on demand, plus recent lookups.

    Recent lookups are kept because the engine passes the same ``positions`` tensors (the step's
    query positions, each window's key positions) to every layer of a step. A kept lookup holds a
    reference to its ``positions`` tensor (so that id cannot be reused) and its version counter (an
    in-place change misses). Inference tensors have no version counter, so they are never kept.
    """

    MAX_POSITIONS = 1 << 20  # beyond this (a buggy position), fall back rather than build a huge table
    MAX_SPECS = 16
    RECENT = 4  # a step's query positions and key positions per window group, with room to spare

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._recent: list[tuple] = []

    def lookup(self, rope: RopeSpec, positions: torch.Tensor, dtype: torch.dtype):
        memo = not positions.is_inference()
        if memo:
            for entry in self._recent:
                if (entry[0] is positions and entry[1] == positions._version and entry[2] is dtype
                        and (entry[3] is rope or entry[3] == rope)):
                    return entry[4]
        lo, hi = (int(v) for v in torch.aminmax(positions))
        if lo < 0 or hi >= self.MAX_POSITIONS:
            return None
        key = (rope, dtype, positions.device)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] <= hi:
            size = max(4096, 1 << hi.bit_length())
            cos, sin = rope.cos_sin(torch.arange(size, dtype=torch.int64))  # float64 [size, rotary_dim / 2]
            if len(self._tables) >= self.MAX_SPECS:
                self._tables.clear()
            table = (cos.to(device=positions.device, dtype=dtype), sin.to(device=positions.device, dtype=dtype))
            self._tables[key] = table
        found = (table[0].index_select(0, positions)[:, None], table[1].index_select(0, positions)[:, None])
        if memo:
            self._recent = [(positions, positions._version, dtype, rope, found)] + self._recent[: self.RECENT - 1]
        return found


_TABLES = _CosSinTables()
