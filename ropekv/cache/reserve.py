"""Reserved imports, a part of :class:`~ropekv.cache.paged.PagedKVCache`: blocks held for a sequence
whose keys and values a caller writes straight into the pool (a streamed handoff,
``ropekv.transfer.stream``), then :meth:`~Reservations.commit` makes it a sequence or
:meth:`~Reservations.release` gives the blocks back unread.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..errors import CacheError, CapacityError, UsageError
from .layout import CacheGroup, Reservation, SeqState
from .store import CacheStore, check_seq_id

__all__ = ["Reservation", "Reservations"]


class Reservations(CacheStore):
    """``reserve`` / ``reserved_rows`` / ``commit`` / ``release``."""

    def reserve(self, seq_id: Hashable, num_tokens: int) -> Reservation:
        """Blocks for a new sequence of ``num_tokens`` whose keys and values a caller writes straight
        into the pool (a streamed handoff) before :meth:`commit` makes it a sequence. Until then
        nothing reads those blocks; :meth:`release` gives them back. Raises CacheError for a taken
        id, CapacityError when the blocks are not free, having allocated nothing."""
        check_seq_id(seq_id)
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
        tables: dict[CacheGroup, list[int]] = {}
        rows: dict[CacheGroup, torch.Tensor] = {}
        for name, g in self._groups.items():
            tables[name] = g.allocator.allocate_many(need[name])
            slots = g.slots(g.live(num_tokens))  # [N]
            blocks = torch.tensor(tables[name], dtype=torch.int64)
            rows[name] = (blocks[slots // g.block_size] * g.block_size + slots % g.block_size).to(self.device)
        res = Reservation(seq_id, num_tokens, tables, rows)
        self._reserved.append(res)
        return res

    def reserved_rows(self, res: Reservation, layer: int) -> torch.Tensor:
        """Rows ``[N]`` (as :meth:`~ropekv.cache.paged.PagedKVCache.flat_rows`) the live tokens of a
        reserved sequence take in ``layer``."""
        self._check_layer(layer)
        return res.rows[self._layer_group[layer]]

    def commit(self, res: Reservation, positions: torch.Tensor) -> None:
        """Make a reservation a sequence whose ``n``-th token sits at ``positions[n]`` (``[num_tokens]``,
        non-negative, strictly increasing). On a refusal the reservation stays as it was."""
        self._check_reservation(res)
        seq = SeqState()
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
        self._seqs[res.seq_id] = SeqState(res.num_tokens, int(pos[-1]), {k: list(v) for k, v in res.tables.items()})
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
