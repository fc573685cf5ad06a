"""Paged KV cache: per-layer key/value blocks, the logical position of every slot, prefix forks with
copy-on-write, and sliding-window rings with attention sinks.

Layers are grouped by attention kind, each group with its own block allocator and slot rule
(:mod:`ropekv.cache.layout`: where a token lives). Every mutating call validates everything first and
then writes; a rejected call leaves the cache exactly as it was (:meth:`PagedKVCache.state_digest`
proves it in the tests).

:class:`PagedKVCache` is one class built from parts: the state (:mod:`ropekv.cache.store`), sequences,
appends and reads (here), rollback / evict / shift with the overwrite journal (:mod:`ropekv.cache.ops`)
and reserved imports for a streamed handoff (:mod:`ropekv.cache.reserve`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..contract import key_form_consequence
from ..errors import CacheError, CapacityError, ContractMismatch, UsageError
from .layout import CacheGroup, Group, KVView, Reservation, SeqState, head_rows, pool_rows, put_rows
from .ops import CacheOps
from .quant import LayerScales
from .reserve import Reservations
from .store import check_seq_id

__all__ = ["KVView", "PagedKVCache", "Reservation", "head_rows", "pool_rows"]

_FUSED_CHECK_ELEMENTS = 1 << 18  # new keys + values of all layers below this: one fused finiteness check
# An append's plan per group: rows of the chunk to write, their slots, new blocks, table indices to copy
_Plan = tuple[torch.Tensor, torch.Tensor, int, list[int]]


class PagedKVCache(CacheOps, Reservations):
    """Key/value storage for several sequences on one pool, under one :class:`CacheContract`.

    ``keys[layer]``/``values[layer]``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the
    contract dtype. Each group (full / sliding) has ``num_blocks`` blocks of its own.
    """

    # ------------------------------------------------------------------ sequences

    @property
    def groups(self) -> tuple[CacheGroup, ...]:
        """The cache's group names (``"full"``, ``"sliding"``: :mod:`ropekv.cache.layout`)."""
        return tuple(self._groups)

    def slots_of(self, layer: int, num_before: int, n: int) -> torch.Tensor:
        """Slots ``[n]`` the next ``n`` tokens of a sequence holding ``num_before`` will take in ``layer``."""
        g = self._groups[self.layer_group(layer)]
        return g.slots(torch.arange(num_before, num_before + n, dtype=torch.int64))

    def layer_group(self, layer: int) -> CacheGroup:
        self._check_layer(layer)
        return self._layer_group[layer]

    def create(self, seq_id: Hashable) -> None:
        check_seq_id(seq_id)
        if seq_id in self._seqs:
            raise CacheError(f"sequence {seq_id!r} already exists")
        self._seqs[seq_id] = SeqState(tables={g: [] for g in self._groups})

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

    def first_position(self, seq_id: Hashable) -> int:
        """Logical position of the sequence's first write (0 unless a shift moved it), -1 when empty."""
        history = self._seq(seq_id).history
        return history[0] if history else -1

    def block_table(self, seq_id: Hashable, group: str = "full") -> tuple[int, ...]:
        return tuple(self._seq(seq_id).tables[self._group(group).name])

    def refcount(self, block: int, group: str = "full") -> int:
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
        check_seq_id(new_seq_id)
        if new_seq_id in self._seqs:
            raise CacheError(f"fork: sequence {new_seq_id!r} already exists")
        if not isinstance(prefix_len, int) or isinstance(prefix_len, bool) or not 0 < prefix_len <= parent.num_tokens:
            raise CacheError(
                f"fork: prefix_len {prefix_len!r} out of range (0, {parent.num_tokens}] "
                f"for parent {parent_seq_id!r} with {parent.num_tokens} tokens"
            )
        g = self._groups.get("sliding")
        if g is not None and g.window is not None and prefix_len > g.sinks:
            oldest = max(g.sinks, prefix_len - g.window)
            if oldest + g.window < parent.num_tokens:
                raise CacheError(
                    f"fork: parent {parent_seq_id!r} has {parent.num_tokens} tokens and its window ring "
                    f"(S={g.sinks}, W={g.window}) already overwrote the slot of token {oldest} (by token "
                    f"{oldest + g.window}), which a prefix of {prefix_len} still needs"
                )
        child = SeqState(num_tokens=prefix_len, history=parent.history[:prefix_len], inherited=prefix_len)
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
        scales: Sequence[LayerScales] | None = None,
    ) -> None:
        """Append ``n`` tokens to every layer: ``positions [n]``, ``keys[layer]``/``values[layer]``
        ``[n, num_kv_heads, head_dim]``. Validates everything (sequence, key form, shapes, finite
        values, increasing positions, capacity including copy-on-write) before changing anything.
        An 8-bit cache quantizes them under each layer's scales; a layer without any yet takes
        ``scales[layer]`` (an import: the sender's) or, without them, this write's own (:mod:`~ropekv.cache.quant`)."""
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
        # an 8-bit cache's layers take their static scales from their first write (before the journal
        # stores this chunk's rows in the stored form)
        self.scales = self._scales_for(keys, values, scales)
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
            held = None  # rows of the blocks just copied that the shared block held a token at
            if cow:
                copied = torch.isin(slots // bs, torch.tensor(cow, dtype=torch.int64)).to(self.device)
                held = copied & (g.positions.view(-1)[flat] >= 0)
            g.positions.view(-1)[flat] = pos if every else pos[rows_d]
            for layer in g.layers:
                for which, pool, src in (
                    ("k", self.keys[layer], keys[layer]),
                    ("v", self.values[layer], values[layer]),
                ):
                    src = src.to(self.device)
                    src = src if every else src[rows_d]
                    if which == "k" and self.quantized:  # the keys the quantizer is handed (its point: RoPE's)
                        src = self.policy.quantized_keys(
                            self.contract.layer_rope(layer), src, pos if every else pos[rows_d]
                        )
                    src = self.encode(layer, which, src)  # [k, KVH, D] stored form
                    if held is not None and bool(held.any()):
                        src = self.policy.copied_block_rows(src, pool_rows(pool).index_select(0, flat), held)
                    put_rows(pool, flat, src)
        seq.num_tokens += n
        seq.last_position = int(pos[-1])
        seq.history.extend(pos.tolist())
        if journal or seq.journal:
            keep = seq.num_tokens - self.rollback_depth
            seq.journal = [e for e in seq.journal + journal if e.index >= keep]
        self._invalidate(seq_id)

    def check_room(self, seq_id: Hashable, n: int) -> None:
        """Raise :class:`CapacityError` unless ``n`` more tokens of ``seq_id`` fit, copy-on-write included.

        Appending them in several chunks needs exactly the blocks one append would, so a chunked
        prefill checks once up front and is then refused before its first chunk, never midway."""
        self._check_room(seq_id, self._seq(seq_id), n)

    def _check_room(self, seq_id: Hashable, seq: SeqState, n: int) -> dict[CacheGroup, _Plan]:
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

    def _plan(self, g: Group, seq: SeqState, n: int) -> _Plan:
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

    # ------------------------------------------------------------------ reading

    def view(self, seq_id: Hashable, layer: int, *, copy: bool = True) -> KVView:
        """The live tokens of ``seq_id`` in ``layer`` in position order (a copy, gathered).

        ``copy=False`` is for a caller that consumes the view at once and never writes to it (the
        engine concatenates it with a step's new tokens; gathering first copied every cached key
        twice per layer and step): when the live tokens fill one run of consecutive pool rows in
        position order (one sequence on a fresh pool, no ring wrap), keys and values are views of the
        pool itself, and positions and slots are the cache's own index tensors. Valid until the cache
        next changes. An 8-bit cache returns float32 rows dequantized with the layer's scales, copied.
        """
        seq = self._seq(seq_id)
        self._check_layer(layer)
        flat, slots, positions, start = self._index(seq_id, seq, self._groups[self._layer_group[layer]])
        if not copy and start >= 0:  # head-major views: [N, KVH, D] with strides (D, rows * D, 1)
            end = start + flat.numel()
            keys = pool_rows(self.keys[layer])[start:end]
            values = pool_rows(self.values[layer])[start:end]
        else:  # contiguous [N, KVH, D] copies
            keys = pool_rows(self.keys[layer]).index_select(0, flat)
            values = pool_rows(self.values[layer]).index_select(0, flat)
        if self.quantized and self.scales[layer] is None:  # nothing written yet: no rows to dequantize
            keys, values = keys.to(torch.float32), values.to(torch.float32)
        elif self.quantized:  # float32 rows, dequantized with the scales the policy picks (the layer's own)
            inherited = (
                positions <= seq.history[seq.inherited - 1]
                if seq.inherited
                else torch.zeros_like(positions, dtype=torch.bool)
            )
            k_scale, v_scale = self.policy.read_scales(layer, self.scales, inherited)
            keys, values = self.decode(layer, "k", keys, k_scale), self.decode(layer, "v", values, v_scale)
        if copy:
            positions, slots = positions.clone(), slots.clone()
        return KVView(keys=keys, values=values, positions=positions, slots=slots)

    def codes(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An 8-bit cache's stored keys and values ``[N, KVH, D]`` of ``seq_id`` in ``layer``, as codes
        (copies, position order, the rows :meth:`view` dequantizes); for an export with :meth:`layer_scales`."""
        if not self.quantized:
            raise UsageError("codes: this cache stores numbers, not 8-bit codes; read it with view")
        seq = self._seq(seq_id)
        self._check_layer(layer)
        flat = self._index(seq_id, seq, self._groups[self._layer_group[layer]])[0]
        return pool_rows(self.keys[layer]).index_select(0, flat), pool_rows(self.values[layer]).index_select(0, flat)

    def layer_scales(self) -> tuple[LayerScales, ...]:
        """An 8-bit cache's scales, one :class:`LayerScales` per layer (CacheError before every layer was written)."""
        if any(s is None for s in self.scales):
            raise CacheError("this 8-bit cache has layers without scales: nothing was written to them yet")
        return tuple(s for s in self.scales if s is not None)

    def positions(self, seq_id: Hashable) -> torch.Tensor:
        """Logical positions ``[N]`` of the full group's tokens (the live sliding ones if every layer slides)."""
        seq = self._seq(seq_id)
        g = self._groups["full"] if "full" in self._groups else self._groups["sliding"]
        return self._index(seq_id, seq, g)[2].clone()

    def flat_rows(self, seq_id: Hashable, layer: int) -> torch.Tensor:
        """Rows ``[N]`` of the live tokens of ``seq_id`` in ``layer``'s pool seen as
        ``[num_blocks * block_size, KVH, D]`` (:func:`pool_rows`; :func:`head_rows` per head), in position order. Read-only;
        valid until the sequence changes. For a transport that reads the pool in place."""
        seq = self._seq(seq_id)
        self._check_layer(layer)
        return self._index(seq_id, seq, self._groups[self._layer_group[layer]])[0]

    # ------------------------------------------------------------------ accounting

    def num_free_blocks(self, group: str = "full") -> int:
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
        for scales in self.scales:  # an 8-bit cache's scales are state: every row reads through them
            if scales is not None:
                h.update(torch.cat((scales.k, scales.v)).cpu().numpy().tobytes())
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
                        s.inherited,
                    )
                ).encode()
            )
            for e in s.journal:
                h.update(e.keys.contiguous().view(torch.uint8).numpy().tobytes())
                h.update(e.values.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
