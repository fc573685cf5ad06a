"""Cache operations beyond append (docs/ops.md), as a part of :class:`~ropekv.cache.paged.PagedKVCache`.

:meth:`~CacheOps.rollback` (speculative decoding gives back rejected tokens; a wrapped ring gets back
what they overwrote from an overwrite journal of the last ``rollback_depth`` tokens, written by
:meth:`~CacheOps._journal_entries` on append), :meth:`~CacheOps.evict` (per-slot holes: a stored
position of -1 is an evicted token, so a slot is live iff the write-index rule says so AND it is not
a hole) and :meth:`~CacheOps.shift` (positions move by ``delta``; rotated keys turn by R(delta) once).
What they do to key contents is decided by a :class:`~ropekv.cache.policy.CacheOpPolicy`. Each
validates everything first and then writes: a refused operation changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..errors import CacheError, CapacityError, ContractMismatch
from ..rope import RopeSpec
from .layout import CacheGroup, Group, Overwrite, SeqState, pool_rows, put_rows
from .store import CacheStore

_NOT_SHIFT_INVARIANT = ("mrope", "multimodal", "dynamic", "longrope")


def shift_invariant(rope: RopeSpec) -> bool:
    """Whether keys under ``rope`` can be moved exactly by turning them: R(a) R(b) = R(a + b) holds
    only while the frequencies do not depend on the length (dynamic NTK, LongRoPE) and positions are
    one number per token (not M-RoPE's sections). :meth:`CacheOps.shift` refuses the others."""
    return not (
        rope.length_dependent or rope.scaling.rope_type in _NOT_SHIFT_INVARIANT or rope.mrope_section is not None
    )


class CacheOps(CacheStore):
    """Rollback, evict and shift, and the overwrite journal that makes a ring rollback exact."""

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
        g = self._groups.get("sliding")
        restores: list[Overwrite] = []
        if g is not None and g.ring is not None:
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
            self._require_free({"sliding": len(cow)}, f"rollback of {n} token(s) on {seq_id!r}")
            for i in cow:
                seq.tables["sliding"][i] = self._copy_block(g, seq.tables["sliding"][i])
            for age, e in enumerate(restores):  # newest first
                flat = self._flat(g, seq, torch.tensor([e.slot]))
                g.positions.view(-1)[flat] = e.position
                for j, layer in enumerate(g.layers):
                    for pool, saved in ((self.keys[layer], e.keys), (self.values[layer], e.values)):
                        rows = pool_rows(pool)
                        now = rows[flat]  # [1, KVH, D]
                        back = self.policy.ring_restore(saved[j : j + 1].to(pool.device), now, age=age)  # [1, KVH, D]
                        put_rows(pool, flat, back.to(pool.dtype))
        for name, grp in self._groups.items():
            table = seq.tables[name]
            for block in table[grp.blocks_needed(new_n) :]:
                if grp.allocator.decref(block) == 0:
                    grp.positions[block] = -1
            del table[grp.blocks_needed(new_n) :]
        seq.num_tokens = new_n
        seq.inherited = min(seq.inherited, new_n)
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
        found: set[int] = set()
        hits: dict[CacheGroup, torch.Tensor] = {}
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
        for g in self._groups.values():
            if g.ring is not None:  # a ring's slots follow positions: its survivors keep theirs whatever the policy
                continue
            flat, _, pos, _ = self._index(seq_id, seq, g)
            kept = self.policy.survivor_positions(pos)
            if not torch.equal(kept, pos):
                g.positions.view(-1)[flat] = kept.to(pos.dtype)
        self._invalidate(seq_id)

    def shift(self, seq_id: Hashable, delta: int, from_position: int = 0) -> None:
        """Move every cached token at or after ``from_position`` by ``delta`` positions (llama.cpp
        ``seq_add``, StreamingLLM re-indexing): rotated keys are turned by R(delta) exactly once, in
        float32 or wider; raw keys only get their new positions. Positions must still strictly
        increase and stay >= 0. Refused for RoPE that is not shift-invariant (frequencies that depend
        on the length: dynamic NTK, LongRoPE; position ids per section: M-RoPE). The overwrite journal
        is cleared (its keys were turned at the old positions): a later rollback past it is refused."""
        seq = self._seq(seq_id)
        # Every layer's own RoPE (gemma3's sliding and global layers turn with different bases); NoPE
        # layers (None) hold keys no position turned, so a shift only relabels them.
        layer_ropes = [lc.rope for lc in self.contract.layers]
        rope = next((r for r in layer_ropes if r is not None and not shift_invariant(r)), self.contract.rope)
        if not shift_invariant(rope):
            raise ContractMismatch(
                f"shift of {seq_id!r}: {'M-RoPE' if rope.mrope_section else rope.scaling.rope_type} RoPE is not shift-invariant (R(a) R(b) != R(a + b) "
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
        hits: dict[CacheGroup, torch.Tensor] = {}
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
                layer_rope = layer_ropes[layer]
                if layer_rope is None:
                    continue
                k = self.decode(layer, "k", pool_rows(self.keys[layer]).index_select(0, flat))  # [k, KVH, D]
                turned = self.policy.shift_keys(layer_rope, k, delta, c.key_form)
                # an 8-bit cache re-quantizes the turned keys under the layer's scale (its headroom
                # holds them: a rotation keeps each pair's length)
                put_rows(self.keys[layer], flat, self.encode(layer, "k", turned))
        seq.history = kept + [p + delta for p in moved]
        seq.last_position = seq.history[-1]
        seq.journal = []
        self._invalidate(seq_id)

    def holes(self, seq_id: Hashable) -> int:
        """Evicted tokens the write-index rule would still keep (in the full group, else the sliding one)."""
        seq = self._seq(seq_id)
        g = self._groups["full"] if "full" in self._groups else self._groups["sliding"]
        return g.live(seq.num_tokens).numel() - self._index(seq_id, seq, g)[0].numel()

    def _journal_entries(
        self,
        seq: SeqState,
        pos: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        n: int,
    ) -> list[Overwrite]:
        """What the ring slots the last ``rollback_depth`` tokens of an append overwrite hold now
        (or will hold, from an earlier row of the same chunk), before anything is written."""
        g = self._groups.get("sliding")
        if g is None or g.ring is None or g.window is None or not self.rollback_depth:
            return []
        start, end = seq.num_tokens, seq.num_tokens + n
        first = max(start, end - self.rollback_depth, g.ring)
        out = []
        for i in range(first, end):
            slot = int(g.slots(torch.tensor([i]))[0])
            old = i - g.window  # the token whose slot this is until i is written
            if old >= start:
                r = old - start
                # the stored form (8-bit codes under the layer's scale), as the pool holds it
                k = torch.stack([self.encode(layer, "k", keys[layer][r : r + 1])[0] for layer in g.layers])
                v = torch.stack([self.encode(layer, "v", values[layer][r : r + 1])[0] for layer in g.layers])
                p = int(pos[r])
            else:
                flat = self._flat(g, seq, torch.tensor([slot]))
                k = torch.stack([pool_rows(self.keys[layer])[flat][0] for layer in g.layers])
                v = torch.stack([pool_rows(self.values[layer])[flat][0] for layer in g.layers])
                p = int(g.positions.view(-1)[flat])
            out.append(Overwrite(i, slot, p, k.cpu().clone(), v.cpu().clone()))
        return out

    def _shared(self, g: Group, seq: SeqState, table_indices: set[int]) -> list[int]:
        """Of the sequence's block-table indices, those whose block another sequence shares (to copy first)."""
        table = seq.tables[g.name]
        return sorted(i for i in table_indices if i < len(table) and g.allocator.refcount(table[i]) > 1)

    def _require_free(self, per_group: dict[CacheGroup, int], what: str) -> None:
        short = [
            f"{k} block(s) in the {name} group with {self._groups[name].allocator.num_free} free"
            for name, k in per_group.items()
            if k > self._groups[name].allocator.num_free
        ]
        if short:
            raise CapacityError(f"{what} needs copy-on-write copies: " + "; ".join(short))


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
