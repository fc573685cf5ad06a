"""Paged KV cache: per-layer key/value blocks, the logical position of every slot, prefix forks with
copy-on-write, and sliding-window rings with attention sinks.

Layers are grouped by attention kind. The "full" group holds the layers outside
``contract.window_layers``, the "sliding" group the windowed ones; each group has its own
:class:`BlockAllocator`, its own ``positions [num_blocks, block_size]`` tensor (-1 = empty), and each
sequence one block table per group. A sequence's ``n``-th appended token (write index ``n``) goes to

- full group: ``slot = n``;
- sliding group (window W, sinks S): ``slot = n if n < S else S + (n - S) % W``, a ring of S + W slots.

Physical location: block ``table[slot // block_size]``, offset ``slot % block_size``. Slots wrap, logical
positions keep increasing: positions are *stored* per slot and never derived from the slot
(the "slot as position" bug, docs/contract.md).

Every mutating call validates everything first and then writes; a rejected call leaves the cache
exactly as it was (:meth:`PagedKVCache.state_digest` proves it in the tests).

Operations beyond append (docs/ops.md): :meth:`~PagedKVCache.rollback` (speculative decoding gives
back rejected tokens; a wrapped ring gets back what they overwrote from an overwrite journal of the
last ``rollback_depth`` tokens), :meth:`~PagedKVCache.evict` (per-slot holes: a stored position of -1
is an evicted token, so a slot is live iff the write-index rule says so AND it is not a hole) and
:meth:`~PagedKVCache.shift` (positions move by ``delta``; rotated keys turn by R(delta) once). What
they do to key contents is decided by a :class:`~ropekv.cache.policy.CacheOpPolicy`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..contract import CacheContract, key_form_consequence
from ..errors import CacheError, CapacityError, ContractMismatch, UsageError
from .allocator import BlockAllocator
from .policy import CORRECT, CacheOpPolicy

FULL, SLIDING = "full", "sliding"
_FUSED_CHECK_ELEMENTS = 1 << 18  # new keys + values of all layers below this: one fused finiteness check


@dataclass(frozen=True)
class KVView:
    """The live tokens of one sequence in one layer, in position order. Read-only."""

    keys: torch.Tensor  # [N, num_kv_heads, head_dim], contract dtype
    values: torch.Tensor  # [N, num_kv_heads, head_dim]
    positions: torch.Tensor  # [N] int64, logical positions, strictly increasing
    slots: torch.Tensor  # [N] int64, slot of each token within the sequence (never a position)


class _Group:
    """Layers of one attention kind: their allocator, slot rule and per-slot positions."""

    def __init__(
        self,
        name: str,
        layers: tuple[int, ...],
        window: int | None,
        sinks: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ):
        self.name, self.layers, self.window, self.sinks = name, layers, window, sinks
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.positions = torch.full((num_blocks, block_size), -1, dtype=torch.int64, device=device)

    @property
    def ring(self) -> int | None:
        """Slots of the ring (S + W), or None for an unbounded full-attention table."""
        return None if self.window is None else self.sinks + self.window

    def slots(self, index: torch.Tensor) -> torch.Tensor:
        """Slot of each write index ``[k]`` -> ``[k]``."""
        if self.window is None:
            return index
        s = self.sinks
        return torch.where(index < s, index, s + (index - s) % self.window)

    def num_slots(self, num_tokens: int) -> int:
        """Slots a sequence of ``num_tokens`` tokens occupies."""
        return num_tokens if self.ring is None else min(num_tokens, self.ring)

    def live(self, num_tokens: int) -> torch.Tensor:
        """Write indices whose token is live after ``num_tokens`` appends, ascending ``[N]`` int64."""
        if self.window is None or num_tokens <= self.ring:
            return torch.arange(num_tokens, dtype=torch.int64)
        sinks = torch.arange(min(self.sinks, num_tokens), dtype=torch.int64)
        recent = torch.arange(max(self.sinks, num_tokens - self.window), num_tokens, dtype=torch.int64)
        return torch.cat((sinks, recent))

    def survivors(self, start: int, n: int) -> torch.Tensor:
        """Rows of a chunk of ``n`` tokens from write index ``start`` whose slot no later row of the
        chunk overwrites (all of them unless the chunk is longer than the ring), ``[k]`` int64."""
        rows = torch.arange(n, dtype=torch.int64)
        if self.window is None:
            return rows
        index = rows + start
        return rows[(index < self.sinks) | (index >= start + n - self.window)]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-self.num_slots(num_tokens) // self.block_size)


@dataclass(frozen=True, eq=False)
class _Overwrite:
    """Journal entry: the ring slot token ``index`` overwrote, and what it held before (all sliding layers)."""

    index: int  # write index of the overwriting token
    slot: int
    position: int  # the slot's stored position before (-1: it was a hole)
    keys: torch.Tensor  # [sliding layers, KVH, D]
    values: torch.Tensor  # [sliding layers, KVH, D]


@dataclass
class _Seq:
    num_tokens: int = 0
    last_position: int = -1
    tables: dict[str, list[int]] = field(default_factory=dict)  # group name -> block ids
    history: list[int] = field(default_factory=list)  # logical position of every write index (holes included)
    journal: list[_Overwrite] = field(default_factory=list)  # ring overwrites of the last rollback_depth tokens


@dataclass(frozen=True, eq=False)
class Reservation:
    """Blocks held for a sequence being written straight into the pool (``PagedKVCache.reserve``).

    ``rows[group]``: ``[N]`` int64 rows of the live tokens (position order) in the pools of that
    group's layers, seen as ``[num_blocks * block_size, KVH * D]``."""

    seq_id: Hashable
    num_tokens: int
    tables: dict[str, list[int]]
    rows: dict[str, torch.Tensor]


class PagedKVCache:
    """Key/value storage for several sequences on one pool, under one :class:`CacheContract`.

    ``keys[layer]``/``values[layer]``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the
    contract dtype. Each group (full / sliding) has ``num_blocks`` blocks of its own.
    """

    def __init__(
        self,
        contract: CacheContract,
        num_blocks: int,
        device: str | torch.device = "cpu",
        *,
        rollback_depth: int = 16,
        policy: CacheOpPolicy | None = None,
    ):
        if not isinstance(rollback_depth, int) or isinstance(rollback_depth, bool) or rollback_depth < 0:
            raise UsageError(f"rollback_depth must be an integer >= 0, got {rollback_depth!r}")
        self.rollback_depth = rollback_depth
        self.policy = policy or CORRECT
        if not isinstance(contract, CacheContract):
            raise UsageError(f"PagedKVCache needs a CacheContract, got {type(contract).__name__}")
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise UsageError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.contract = contract
        self.device = torch.device(device)
        c = contract
        sliding = tuple(c.window_layers)
        full = tuple(i for i in range(c.num_layers) if i not in sliding)
        self._groups: dict[str, _Group] = {}
        if full:
            self._groups[FULL] = _Group(FULL, full, None, 0, num_blocks, c.block_size, self.device)
        if sliding:
            self._groups[SLIDING] = _Group(
                SLIDING, sliding, c.window, c.sink_tokens, num_blocks, c.block_size, self.device
            )
        self._layer_group = [SLIDING if i in sliding else FULL for i in range(c.num_layers)]
        self.keys = [_head_major_pool(num_blocks, c, self.device) for _ in range(c.num_layers)]
        self.values = [_head_major_pool(num_blocks, c, self.device) for _ in range(c.num_layers)]
        self._seqs: dict[Hashable, _Seq] = {}
        self._reserved: list[Reservation] = []
        # (seq_id, group) -> (flat slot index [N], slots [N], positions [N], first row or -1); see _index.
        self._index_cache: dict[tuple[Hashable, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}

    # ------------------------------------------------------------------ sequences

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def slots_of(self, layer: int, num_before: int, n: int) -> torch.Tensor:
        """Slots ``[n]`` the next ``n`` tokens of a sequence holding ``num_before`` will take in ``layer``."""
        g = self._groups[self.layer_group(layer)]
        return g.slots(torch.arange(num_before, num_before + n, dtype=torch.int64))

    def layer_group(self, layer: int) -> str:
        self._check_layer(layer)
        return self._layer_group[layer]

    def create(self, seq_id: Hashable) -> None:
        _check_seq_id(seq_id)
        if seq_id in self._seqs:
            raise CacheError(f"sequence {seq_id!r} already exists")
        self._seqs[seq_id] = _Seq(tables={g: [] for g in self._groups})

    def has(self, seq_id: Hashable) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:  # unhashable: never a sequence of ours
            return False

    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).num_tokens

    def last_position(self, seq_id: Hashable) -> int:
        """Logical position of the last appended token, -1 for an empty sequence."""
        return self._seq(seq_id).last_position

    def block_table(self, seq_id: Hashable, group: str = FULL) -> tuple[int, ...]:
        return tuple(self._seq(seq_id).tables[self._group(group).name])

    def refcount(self, block: int, group: str = FULL) -> int:
        return self._group(group).allocator.refcount(block)

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks (a shared block stays with its other holders)."""
        seq = self._seq(seq_id)
        for name, table in seq.tables.items():
            g = self._groups[name]
            for block in table:
                if g.allocator.decref(block) == 0:
                    g.positions[block] = -1
        del self._seqs[seq_id]
        self._invalidate(seq_id)

    def fork(self, new_seq_id: Hashable, parent_seq_id: Hashable, prefix_len: int) -> None:
        """Start ``new_seq_id`` from the first ``prefix_len`` tokens of the parent (a prefix-cache hit).

        The child shares the parent's blocks covering its slots; whoever writes into a shared block
        later copies it first. A sliding ring is refused when the parent already overwrote a slot
        the child still needs: parent token ``m >= S + W`` overwrites the slot of token ``m - W``, so
        the child's oldest live non-sink token ``j = max(S, prefix_len - W)`` is gone iff
        ``prefix_len > S`` and ``j + W < parent.num_tokens``.
        """
        parent = self._seq(parent_seq_id)
        _check_seq_id(new_seq_id)
        if new_seq_id in self._seqs:
            raise CacheError(f"fork: sequence {new_seq_id!r} already exists")
        if not isinstance(prefix_len, int) or isinstance(prefix_len, bool) or not 0 < prefix_len <= parent.num_tokens:
            raise CacheError(
                f"fork: prefix_len {prefix_len!r} out of range (0, {parent.num_tokens}] "
                f"for parent {parent_seq_id!r} with {parent.num_tokens} tokens"
            )
        g = self._groups.get(SLIDING)
        if g is not None and prefix_len > g.sinks:
            oldest = max(g.sinks, prefix_len - g.window)
            if oldest + g.window < parent.num_tokens:
                raise CacheError(
                    f"fork: parent {parent_seq_id!r} has {parent.num_tokens} tokens and its window ring "
                    f"(S={g.sinks}, W={g.window}) already overwrote the slot of token {oldest} (by token "
                    f"{oldest + g.window}), which a prefix of {prefix_len} still needs"
                )
        child = _Seq(num_tokens=prefix_len, history=parent.history[:prefix_len])
        for name, grp in self._groups.items():
            shared = parent.tables[name][: grp.blocks_needed(prefix_len)]
            for block in shared:
                grp.allocator.incref(block)
            child.tables[name] = list(shared)
        child.last_position = child.history[-1]
        self._seqs[new_seq_id] = child

    # ------------------------------------------------------------------ append

    def append(
        self,
        seq_id: Hashable,
        positions: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        *,
        key_form: str,
    ) -> None:
        """Append ``n`` tokens to every layer: ``positions [n]``, ``keys[layer]``/``values[layer]``
        ``[n, num_kv_heads, head_dim]``. Validates everything (sequence, key form, shapes, finite
        values, increasing positions, capacity including copy-on-write) before changing anything."""
        seq = self._seq(seq_id)
        if key_form != self.contract.key_form:
            raise ContractMismatch(
                f"append to sequence {seq_id!r}: key_form={key_form!r} but the cache contract says "
                f"key_form={self.contract.key_form!r} "
                f"({key_form_consequence(stored=key_form, reader=self.contract.key_form)})",
                fields=("key_form",),
            )
        pos = self._check_positions(seq_id, seq, positions)
        n = pos.numel()
        self._check_tensors("keys", keys, n)
        self._check_tensors("values", values, n)
        self._check_finite(keys, values)

        plans = self._check_room(seq_id, seq, n)
        journal = self._journal_entries(seq, pos, keys, values, n)

        for name, (rows, slots, new, cow) in plans.items():
            g, table = self._groups[name], seq.tables[name]
            for i in cow:
                table[i] = self._copy_block(g, table[i])
            for _ in range(new):
                block = g.allocator.allocate()
                g.positions[block] = -1
                table.append(block)
            bs = g.block_size
            blocks = torch.tensor(table, dtype=torch.int64)
            flat = (blocks[slots // bs] * bs + slots % bs).to(self.device)  # [k]
            every = rows.numel() == n  # only a chunk longer than the ring skips rows
            rows_d = rows.to(self.device)
            g.positions.view(-1)[flat] = pos if every else pos[rows_d]
            for layer in g.layers:
                for pool, src in ((self.keys[layer], keys[layer]), (self.values[layer], values[layer])):
                    src = src.to(device=self.device, dtype=pool.dtype)  # [n, KVH, D]
                    _rows(pool).index_copy_(0, flat, src if every else src[rows_d])
        seq.num_tokens += n
        seq.last_position = int(pos[-1])
        seq.history.extend(pos.tolist())
        if journal or seq.journal:
            keep = seq.num_tokens - self.rollback_depth
            seq.journal = [e for e in seq.journal + journal if e.index >= keep]
        self._invalidate(seq_id)

    def _journal_entries(self, seq: _Seq, pos: torch.Tensor, keys, values, n: int) -> list[_Overwrite]:
        """What the ring slots the last ``rollback_depth`` tokens of this append overwrite hold now
        (or will hold, from an earlier row of the same chunk), before anything is written."""
        g = self._groups.get(SLIDING)
        if g is None or not self.rollback_depth:
            return []
        start, end = seq.num_tokens, seq.num_tokens + n
        first = max(start, end - self.rollback_depth, g.ring)
        out = []
        for i in range(first, end):
            slot = int(g.slots(torch.tensor([i]))[0])
            old = i - g.window  # the token whose slot this is until i is written
            if old >= start:
                r = old - start
                k = torch.stack([keys[layer][r] for layer in g.layers]).to(self.contract.torch_dtype)
                v = torch.stack([values[layer][r] for layer in g.layers]).to(self.contract.torch_dtype)
                p = int(pos[r])
            else:
                flat = self._flat(g, seq, torch.tensor([slot]))
                k = torch.stack([_rows(self.keys[layer])[flat][0] for layer in g.layers])
                v = torch.stack([_rows(self.values[layer])[flat][0] for layer in g.layers])
                p = int(g.positions.view(-1)[flat])
            out.append(_Overwrite(i, slot, p, k.cpu().clone(), v.cpu().clone()))
        return out

    def _flat(self, g: _Group, seq: _Seq, slots: torch.Tensor) -> torch.Tensor:
        """Flat pool rows ``[k]`` of ``slots [k]`` under the sequence's current block table."""
        bs = g.block_size
        blocks = torch.tensor(seq.tables[g.name], dtype=torch.int64)
        return (blocks[slots // bs] * bs + slots % bs).to(self.device)

    def check_room(self, seq_id: Hashable, n: int) -> None:
        """Raise :class:`CapacityError` unless ``n`` more tokens of ``seq_id`` fit, copy-on-write included.

        Appending them in several chunks needs exactly the blocks one append would, so a chunked
        prefill checks once up front and is then refused before its first chunk, never midway."""
        self._check_room(seq_id, self._seq(seq_id), n)

    def _check_room(self, seq_id: Hashable, seq: _Seq, n: int) -> dict:
        plans = {name: self._plan(g, seq, n) for name, g in self._groups.items()}
        short = []
        for name, (_, _, new, cow) in plans.items():
            free = self._groups[name].allocator.num_free
            if new + len(cow) > free:
                short.append(
                    f"{new + len(cow)} block(s) in the {name} group ({new} new, {len(cow)} "
                    f"copy-on-write) with {free} free"
                )
        if short:
            raise CapacityError(f"append of {n} token(s) to sequence {seq_id!r} needs " + "; ".join(short))
        return plans

    def _plan(self, g: _Group, seq: _Seq, n: int) -> tuple[torch.Tensor, torch.Tensor, int, list[int]]:
        """Rows of the chunk to write, their slots, how many new blocks and which table indices to
        copy on write (shared blocks, refcount > 1) for an append of ``n`` tokens."""
        rows = g.survivors(seq.num_tokens, n)
        slots = g.slots(rows + seq.num_tokens)  # [k]
        table = seq.tables[g.name]
        touched = sorted(set((slots // g.block_size).tolist()))
        new = [i for i in touched if i >= len(table)]
        assert new == list(range(len(table), len(table) + len(new))), "slots fill block tables in order"
        cow = [i for i in touched if i < len(table) and g.allocator.refcount(table[i]) > 1]
        return rows, slots, len(new), cow

    def _copy_block(self, g: _Group, old: int) -> int:
        """Copy-on-write: a private copy of a shared block (every layer of the group + positions)."""
        new = g.allocator.allocate()
        for layer in g.layers:
            self.keys[layer][new] = self.keys[layer][old]
            self.values[layer][new] = self.values[layer][old]
        g.positions[new] = g.positions[old]
        g.allocator.decref(old)
        return new

    def _check_positions(self, seq_id: Hashable, seq: _Seq, positions: Any) -> torch.Tensor:
        if not isinstance(positions, torch.Tensor):
            raise CacheError(f"append to {seq_id!r}: positions must be a tensor, got {type(positions).__name__}")
        if positions.dim() != 1 or positions.numel() == 0:
            raise CacheError(
                f"append to {seq_id!r}: positions must be 1-D [n] with n >= 1, got shape {tuple(positions.shape)}"
            )
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise CacheError(f"append to {seq_id!r}: positions must be integers, got {positions.dtype}")
        pos = positions.to(device=self.device, dtype=torch.int64)
        steps = pos[1:] - pos[:-1]
        if pos.numel() > 1 and not bool((steps > 0).all()):
            bad = int(torch.nonzero(steps <= 0)[0])
            raise CacheError(
                f"append to {seq_id!r}: positions must strictly increase; position {int(pos[bad + 1])} "
                f"follows {int(pos[bad])} (positions {pos.tolist()[:16]}{'...' if pos.numel() > 16 else ''})"
            )
        if int(pos[0]) <= seq.last_position:
            raise CacheError(
                f"append to {seq_id!r}: first position {int(pos[0])} does not follow the last cached "
                f"position {seq.last_position}"
            )
        return pos

    def _check_tensors(self, what: str, tensors: Any, n: int) -> None:
        c = self.contract
        if not isinstance(tensors, (list, tuple)) or len(tensors) != c.num_layers:
            got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise CacheError(f"append: {what} must be a list with one tensor per layer ({c.num_layers}), got {got}")
        want = (n, c.num_kv_heads, c.head_dim)
        for layer, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise CacheError(f"append: {what}[{layer}] must be a floating-point tensor")
            if tuple(t.shape) != want:
                raise CacheError(f"append: {what}[{layer}] has shape {tuple(t.shape)}, expected {want}")

    def _check_finite(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Refuse NaN or infinite keys/values. A decode step's new rows (a few KB over all layers) are
        checked by one reduction over all of them; a large chunk tensor by tensor, never copied."""
        tensors = list(keys) + list(values)
        total = sum(t.numel() for t in tensors)
        if total <= _FUSED_CHECK_ELEMENTS:
            lo, hi = torch.aminmax(torch.cat([t.reshape(-1).to(torch.float32) for t in tensors]))  # NaN propagates
            if bool(torch.isfinite(lo) & torch.isfinite(hi)):
                return
        for i, t in enumerate(tensors):
            lo, hi = torch.aminmax(t)  # propagates NaN; cheaper than isfinite(t).all() on big chunks
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                what, layer = ("keys", i) if i < len(keys) else ("values", i - len(keys))
                raise CacheError(f"append: {what}[{layer}] holds NaN or infinite values")

    # ------------------------------------------------------------------ operations (docs/ops.md)

    def rollback(self, seq_id: Hashable, n: int) -> None:
        """Give back the last ``n`` tokens of ``seq_id`` (a rejected speculative draft).

        Full group: the sequence shrinks by ``n``; blocks no longer needed are released. Sliding
        ring: every rejected token that overwrote a slot gets the slot's previous token back (keys,
        values, position) from the overwrite journal, newest first; beyond the journal's
        ``rollback_depth`` tokens the rollback is refused. Next position: the last kept token's + 1.
        """
        seq = self._seq(seq_id)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= seq.num_tokens:
            raise CacheError(f"rollback of {seq_id!r}: n must be an integer in [1, {seq.num_tokens}], got {n!r}")
        new_n = seq.num_tokens - n
        g = self._groups.get(SLIDING)
        restores: list[_Overwrite] = []
        if g is not None:
            have = {e.index: e for e in seq.journal}
            need = [i for i in range(new_n, seq.num_tokens) if i >= g.ring]
            missing = [i for i in need if i not in have]
            if missing:
                raise CacheError(
                    f"rollback of {n} token(s) on {seq_id!r}: tokens {missing[0]}..{missing[-1]} overwrote window ring "
                    f"slots whose earlier keys are beyond the overwrite journal (rollback_depth={self.rollback_depth}); "
                    "nothing changed"
                )
            restores = [have[i] for i in reversed(need)]
            cow = self._shared(g, seq, {e.slot // g.block_size for e in restores})
            self._require_free({SLIDING: len(cow)}, f"rollback of {n} token(s) on {seq_id!r}")
            for i in cow:
                seq.tables[SLIDING][i] = self._copy_block(g, seq.tables[SLIDING][i])
            for e in restores:
                flat = self._flat(g, seq, torch.tensor([e.slot]))
                g.positions.view(-1)[flat] = e.position
                for j, layer in enumerate(g.layers):
                    for pool, saved in ((self.keys[layer], e.keys), (self.values[layer], e.values)):
                        rows = _rows(pool)
                        now = rows[flat]  # [1, KVH, D]
                        back = self.policy.ring_restore(saved[j : j + 1].to(pool.device), now)  # [1, KVH, D]
                        rows[flat] = back.to(pool.dtype)
        for name, grp in self._groups.items():
            table = seq.tables[name]
            for block in table[grp.blocks_needed(new_n) :]:
                if grp.allocator.decref(block) == 0:
                    grp.positions[block] = -1
            del table[grp.blocks_needed(new_n) :]
        seq.num_tokens = new_n
        del seq.history[new_n:]
        seq.last_position = seq.history[-1] if seq.history else -1
        seq.journal = [e for e in seq.journal if e.index < new_n]
        self._invalidate(seq_id)

    def evict(self, seq_id: Hashable, positions: Sequence[int] | torch.Tensor) -> None:
        """Drop the tokens at logical ``positions`` from every layer (H2O/SnapKV-style compression).

        Their slots become holes (stored position -1); survivors keep their logical positions and the
        next token still goes to the last position + 1, never to the count of kept rows. A shared
        block is copied before a hole is punched into it. Refused unless every position is live."""
        seq = self._seq(seq_id)
        want = _int_list(positions, f"evict from {seq_id!r}: positions")
        if len(set(want)) != len(want):
            raise CacheError(f"evict from {seq_id!r}: positions repeat ({want[:16]})")
        found, hits = set(), {}
        for name, g in self._groups.items():
            flat, slots, pos, _ = self._index(seq_id, seq, g)
            match = torch.isin(pos, torch.tensor(want, dtype=torch.int64, device=pos.device))
            hits[name] = slots[match].cpu()
            found.update(pos[match].tolist())
        missing = [p for p in want if p not in found]
        if missing:
            raise CacheError(
                f"evict from {seq_id!r}: position(s) {missing[:8]} are not live in the cache "
                "(never cached, already evicted, or out of the window); nothing changed"
            )
        cow = {
            name: self._shared(self._groups[name], seq, set((s // self._groups[name].block_size).tolist()))
            for name, s in hits.items()
        }
        self._require_free({name: len(c) for name, c in cow.items()}, f"evict from {seq_id!r}")
        for name, slots in hits.items():
            g = self._groups[name]
            for i in cow[name]:
                seq.tables[name][i] = self._copy_block(g, seq.tables[name][i])
            if slots.numel():
                g.positions.view(-1)[self._flat(g, seq, slots)] = -1
        self._invalidate(seq_id)

    def shift(self, seq_id: Hashable, delta: int, from_position: int = 0) -> None:
        """Move every cached token at or after ``from_position`` by ``delta`` positions (llama.cpp
        ``seq_add``, StreamingLLM re-indexing): rotated keys are turned by R(delta) exactly once, in
        float32 or wider; raw keys only get their new positions. Positions must still strictly
        increase and stay >= 0. Refused for RoPE that is not shift-invariant (frequencies that depend
        on the length: dynamic NTK, LongRoPE; position ids per section: M-RoPE). The overwrite journal
        is cleared (its keys were turned at the old positions): a later rollback past it is refused."""
        seq = self._seq(seq_id)
        rope = self.contract.rope
        if rope.length_dependent or rope.scaling.rope_type in _NOT_SHIFT_INVARIANT:
            raise ContractMismatch(
                f"shift of {seq_id!r}: {rope.scaling.rope_type} RoPE is not shift-invariant (R(a) R(b) != R(a + b) "
                "once frequencies depend on the length or positions come per section); the cache cannot be "
                "shifted exactly: recompute it at the new positions instead",
                fields=("rope.scaling",),
            )
        for what, v in (("delta", delta), ("from_position", from_position)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise CacheError(f"shift of {seq_id!r}: {what} must be an integer, got {v!r}")
        if delta == 0 or from_position < 0:
            raise CacheError(
                f"shift of {seq_id!r}: delta must be nonzero and from_position >= 0, got {delta}, {from_position}"
            )
        moved = [p for p in seq.history if p >= from_position]
        kept = [p for p in seq.history if p < from_position]
        if not moved:
            raise CacheError(f"shift of {seq_id!r}: no cached token at or after position {from_position}")
        if moved[0] + delta < 0 or (kept and moved[0] + delta <= kept[-1]):
            raise CacheError(
                f"shift of {seq_id!r} by {delta} from {from_position}: position {moved[0]} would become "
                f"{moved[0] + delta}, not after {kept[-1] if kept else 'position -1'} (positions must "
                "strictly increase and stay >= 0)"
            )
        hits = {}
        for name, g in self._groups.items():
            _, slots, pos, _ = self._index(seq_id, seq, g)
            hits[name] = slots[pos >= from_position].cpu()
        cow = {
            name: self._shared(self._groups[name], seq, set((s // self._groups[name].block_size).tolist()))
            for name, s in hits.items()
        }
        self._require_free({name: len(c) for name, c in cow.items()}, f"shift of {seq_id!r}")
        c = self.contract
        for name, slots in hits.items():
            g = self._groups[name]
            for i in cow[name]:
                seq.tables[name][i] = self._copy_block(g, seq.tables[name][i])
            if not slots.numel():
                continue
            flat = self._flat(g, seq, slots)
            g.positions.view(-1)[flat] += delta
            for layer in g.layers:
                rows = _rows(self.keys[layer])
                k = rows.index_select(0, flat)  # [k, KVH, D]
                turned = self.policy.shift_keys(c.rope, k, delta, c.key_form)
                rows.index_copy_(0, flat, turned.to(rows.dtype))
        seq.history = kept + [p + delta for p in moved]
        seq.last_position = seq.history[-1]
        seq.journal = []
        self._invalidate(seq_id)

    def holes(self, seq_id: Hashable) -> int:
        """Evicted tokens the write-index rule would still keep (in the full group, else the sliding one)."""
        seq = self._seq(seq_id)
        g = self._groups[FULL] if FULL in self._groups else self._groups[SLIDING]
        return g.live(seq.num_tokens).numel() - self._index(seq_id, seq, g)[0].numel()

    def _shared(self, g: _Group, seq: _Seq, table_indices: set[int]) -> list[int]:
        """Of the sequence's block-table indices, those whose block another sequence shares (to copy first)."""
        table = seq.tables[g.name]
        return sorted(i for i in table_indices if i < len(table) and g.allocator.refcount(table[i]) > 1)

    def _require_free(self, per_group: dict[str, int], what: str) -> None:
        short = [
            f"{k} block(s) in the {name} group with {self._groups[name].allocator.num_free} free"
            for name, k in per_group.items()
            if k > self._groups[name].allocator.num_free
        ]
        if short:
            raise CapacityError(f"{what} needs copy-on-write copies: " + "; ".join(short))

    # ------------------------------------------------------------------ reading

    def view(self, seq_id: Hashable, layer: int, *, copy: bool = True) -> KVView:
        """The live tokens of ``seq_id`` in ``layer`` in position order (a copy, gathered).

        ``copy=False`` is for a caller that consumes the view at once and never writes to it (the
        engine concatenates it with a step's new tokens; gathering first copied every cached key
        twice per layer and step): when the live tokens fill one run of consecutive pool rows in
        position order (one sequence on a fresh pool, no ring wrap), keys and values are views of the
        pool itself, and positions and slots are the cache's own index tensors. Valid until the cache
        next changes.
        """
        seq = self._seq(seq_id)
        self._check_layer(layer)
        flat, slots, positions, start = self._index(seq_id, seq, self._groups[self._layer_group[layer]])
        if not copy and start >= 0:  # head-major views: [N, KVH, D] with strides (D, rows * D, 1)
            end = start + flat.numel()
            keys = _rows(self.keys[layer])[start:end]
            values = _rows(self.values[layer])[start:end]
        else:  # contiguous [N, KVH, D] copies
            keys = _rows(self.keys[layer]).index_select(0, flat)
            values = _rows(self.values[layer]).index_select(0, flat)
        if copy:
            positions, slots = positions.clone(), slots.clone()
        return KVView(keys=keys, values=values, positions=positions, slots=slots)

    def positions(self, seq_id: Hashable) -> torch.Tensor:
        """Logical positions ``[N]`` of the full group's tokens (the live sliding ones if every layer slides)."""
        seq = self._seq(seq_id)
        g = self._groups[FULL] if FULL in self._groups else self._groups[SLIDING]
        return self._index(seq_id, seq, g)[2].clone()

    def _index(self, seq_id: Hashable, seq: _Seq, g: _Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Flat slot index into ``[num_blocks * block_size]``, slots and positions of the live tokens,
        and the first flat row when those rows are consecutive (else -1), cached per (sequence,
        group) until the sequence changes. Liveness comes from ``num_tokens``, not stored positions:
        a forked child may share a block holding the parent's later tokens."""
        key = (seq_id, g.name)
        hit = self._index_cache.get(key)
        if hit is None:
            slots = g.slots(g.live(seq.num_tokens))  # [N]
            bs = g.block_size
            blocks = torch.tensor(seq.tables[g.name], dtype=torch.int64)
            flat = (blocks[slots // bs] * bs + slots % bs).to(self.device)
            consecutive = flat.numel() > 0 and bool((flat[1:] - flat[:-1] == 1).all())
            positions = g.positions.view(-1).index_select(0, flat)
            live = positions >= 0  # an evicted token is a hole (-1) in a slot the write-index rule keeps
            if not bool(live.all()):
                flat, slots, positions = flat[live], slots[live.cpu()], positions[live]
                consecutive = flat.numel() > 0 and bool((flat[1:] - flat[:-1] == 1).all())
            hit = (flat, slots.to(self.device), positions, int(flat[0]) if consecutive else -1)
            self._index_cache[key] = hit
        return hit

    def flat_rows(self, seq_id: Hashable, layer: int) -> torch.Tensor:
        """Rows ``[N]`` of the live tokens of ``seq_id`` in ``layer``'s pool seen as
        ``[num_blocks * block_size, KVH, D]`` (:func:`pool_rows`; :func:`head_rows` per head), in position order. Read-only;
        valid until the sequence changes. For a transport that reads the pool in place."""
        seq = self._seq(seq_id)
        self._check_layer(layer)
        return self._index(seq_id, seq, self._groups[self._layer_group[layer]])[0]

    # ------------------------------------------------------------------ reserved imports

    def reserve(self, seq_id: Hashable, num_tokens: int) -> Reservation:
        """Blocks for a new sequence of ``num_tokens`` whose keys and values a caller writes straight
        into the pool (a streamed handoff) before :meth:`commit` makes it a sequence. Until then
        nothing reads those blocks; :meth:`release` gives them back. Raises CacheError for a taken
        id, CapacityError when the blocks are not free, having allocated nothing."""
        _check_seq_id(seq_id)
        if seq_id in self._seqs or any(r.seq_id == seq_id for r in self._reserved):
            raise CacheError(f"sequence {seq_id!r} already exists")
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise UsageError(f"reserve needs num_tokens >= 1, got {num_tokens!r}")
        need = {name: g.blocks_needed(num_tokens) for name, g in self._groups.items()}
        short = [
            f"{need[name]} block(s) in the {name} group with {g.allocator.num_free} free"
            for name, g in self._groups.items()
            if need[name] > g.allocator.num_free
        ]
        if short:
            raise CapacityError(f"import of {num_tokens} token(s) as {seq_id!r} needs " + "; ".join(short))
        tables, rows = {}, {}
        for name, g in self._groups.items():
            tables[name] = g.allocator.allocate_many(need[name])
            slots = g.slots(g.live(num_tokens))  # [N]
            blocks = torch.tensor(tables[name], dtype=torch.int64)
            rows[name] = (blocks[slots // g.block_size] * g.block_size + slots % g.block_size).to(self.device)
        res = Reservation(seq_id, num_tokens, tables, rows)
        self._reserved.append(res)
        return res

    def reserved_rows(self, res: Reservation, layer: int) -> torch.Tensor:
        """Rows ``[N]`` (as :meth:`flat_rows`) the live tokens of a reserved sequence take in ``layer``."""
        self._check_layer(layer)
        return res.rows[self._layer_group[layer]]

    def commit(self, res: Reservation, positions: torch.Tensor) -> None:
        """Make a reservation a sequence whose ``n``-th token sits at ``positions[n]`` (``[num_tokens]``,
        non-negative, strictly increasing). On a refusal the reservation stays as it was."""
        self._check_reservation(res)
        seq = _Seq()
        pos = self._check_positions(res.seq_id, seq, positions)
        if pos.numel() != res.num_tokens or int(pos[0]) < 0:
            raise CacheError(
                f"commit of {res.seq_id!r}: {pos.numel()} position(s) from {int(pos[0])}; "
                f"the reservation holds {res.num_tokens} tokens from position >= 0"
            )
        for name, g in self._groups.items():
            for block in res.tables[name]:
                g.positions[block] = -1
            g.positions.view(-1)[res.rows[name]] = pos[g.live(res.num_tokens).to(self.device)]
        self._reserved.remove(res)
        self._seqs[res.seq_id] = _Seq(res.num_tokens, int(pos[-1]), {k: list(v) for k, v in res.tables.items()})
        self._invalidate(res.seq_id)

    def release(self, res: Reservation) -> None:
        """Give a reservation's blocks back, unread: the cache is as before :meth:`reserve`."""
        self._check_reservation(res)
        for name, g in self._groups.items():
            for block in res.tables[name]:
                g.allocator.decref(block)
        self._reserved.remove(res)

    def _check_reservation(self, res: Reservation) -> None:
        if not any(r is res for r in self._reserved):
            raise UsageError(f"reservation of {getattr(res, 'seq_id', res)!r} is not pending in this cache")

    # ------------------------------------------------------------------ accounting

    def num_free_blocks(self, group: str = FULL) -> int:
        return self._group(group).allocator.num_free

    def nbytes(self) -> int:
        """Bytes of all key and value pools (positions and tables not counted)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def bytes_in_use(self) -> int:
        """Blocks in use times the bytes one block takes over all layers of its group (keys + values)."""
        per_block = self.keys[0][0].numel() * self.keys[0].element_size() * 2
        return sum(
            (g.allocator.num_blocks - g.allocator.num_free) * per_block * len(g.layers) for g in self._groups.values()
        )

    def state_digest(self) -> str:
        """sha256 over the blocks in use of every pool, the positions tensors, allocators and sequence
        tables (tests: nothing changed). A free block's bytes are not state: no reader ever sees them
        (its positions are -1 and no table holds it), and a streamed import that fails leaves the bytes
        it received in blocks it gave back."""
        h = hashlib.sha256()
        for g in self._groups.values():
            used = torch.tensor([b for b, n in enumerate(g.allocator.refcounts()) if n > 0], dtype=torch.int64)
            for layer in g.layers:
                for pool in (self.keys[layer], self.values[layer]):
                    h.update(pool.index_select(0, used.to(pool.device)).cpu().view(torch.uint8).numpy().tobytes())
            h.update(g.positions.cpu().view(torch.uint8).numpy().tobytes())
        for name, g in self._groups.items():
            h.update(repr((name, g.allocator.refcounts())).encode())
        for seq_id in sorted(self._seqs, key=repr):
            s = self._seqs[seq_id]
            h.update(
                repr(
                    (
                        seq_id,
                        s.num_tokens,
                        s.last_position,
                        sorted(s.tables.items()),
                        s.history,
                        [(e.index, e.slot, e.position) for e in s.journal],
                    )
                ).encode()
            )
            for e in s.journal:
                h.update(e.keys.contiguous().view(torch.uint8).numpy().tobytes())
                h.update(e.values.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ helpers

    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise CacheError(f"unknown sequence {seq_id!r}") from None

    def _group(self, name: str) -> _Group:
        if name not in self._groups:
            raise UsageError(f"no {name!r} layer group in this cache; groups: {', '.join(self._groups)}")
        return self._groups[name]

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.contract.num_layers:
            raise UsageError(f"layer {layer!r} out of range [0, {self.contract.num_layers})")

    def _invalidate(self, seq_id: Hashable) -> None:
        for name in self._groups:
            self._index_cache.pop((seq_id, name), None)


_NOT_SHIFT_INVARIANT = ("mrope", "multimodal", "dynamic", "longrope")


def _int_list(values: Any, what: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_floating_point() or values.dtype == torch.bool:
            raise CacheError(f"{what} must be a 1-D integer tensor, got {values.dtype} {tuple(values.shape)}")
        values = values.tolist()
    if (
        not isinstance(values, (list, tuple))
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    ):
        raise CacheError(f"{what} must be a non-empty list of integers, got {values!r}")
    return list(values)


def _check_seq_id(seq_id: Any) -> None:
    try:
        hash(seq_id)
    except TypeError:
        raise UsageError(f"sequence id {seq_id!r} is not hashable") from None


def _head_major_pool(num_blocks: int, c: CacheContract, device: torch.device) -> torch.Tensor:
    """One layer's pool, indexed ``[num_blocks, block_size, KVH, D]`` but laid out head-major in
    memory (a ``[KVH, num_blocks * block_size, D]`` buffer, permuted): each KV head's keys of a run
    of consecutive rows are one contiguous ``[N, D]`` matrix, as in transformers' ``[B, KVH, N, D]``
    cache. Why: a decode step's attention reads every cached key and value once per layer, and
    MKL's matmuls run about twice as fast over a contiguous per-head matrix as over one whose rows
    lie ``KVH * D`` apart (docs/performance.md: 36 vs 19 ms a step at 4,096 tokens, one thread)."""
    rows = num_blocks * c.block_size
    store = torch.zeros((c.num_kv_heads, rows, c.head_dim), dtype=c.torch_dtype, device=device)
    return store.permute(1, 0, 2).view(num_blocks, c.block_size, c.num_kv_heads, c.head_dim)


def pool_rows(pool: torch.Tensor) -> torch.Tensor:
    """A layer's pool as the rows ``[num_blocks * block_size, KVH, D]`` that
    :meth:`PagedKVCache.flat_rows` indexes (a strided view: row ``r`` of head ``h`` is ``[r, h]``)."""
    return _rows(pool)


def head_rows(pool: torch.Tensor) -> torch.Tensor:
    """A layer's pool as its head-major buffer ``[KVH, num_blocks * block_size, D]`` (a contiguous
    view): ``head_rows(pool)[h, a:b]`` is one contiguous ``[b - a, D]`` run, what a transport sends
    and receives in place."""
    return _rows(pool).permute(1, 0, 2)


def _rows(pool: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, KVH, D]`` as ``[num_blocks * block_size, KVH, D]`` (a view)."""
    return pool.view(pool.shape[0] * pool.shape[1], *pool.shape[2:])
