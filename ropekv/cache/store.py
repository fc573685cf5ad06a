"""The state of a paged KV cache and the lookups every cache operation shares.

:class:`CacheStore` owns the pools (``keys[layer]``/``values[layer]``), the layer groups
(:mod:`ropekv.cache.layout`), the sequences and the pending reservations. :class:`~ropekv.cache.paged.PagedKVCache`
adds appends and reads, :mod:`ropekv.cache.ops` rollback, evict and shift, :mod:`ropekv.cache.reserve`
streamed imports: one class, built from those parts.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..contract import CacheContract
from ..errors import CacheError, CapacityError, UsageError
from .layout import CacheGroup, Group, Reservation, SeqState, group_of, head_major_pool
from .policy import CORRECT, CacheOpPolicy
from .quant import LayerScales, dequantize, quantize

# (flat slot index [N], slots [N], positions [N], first row or -1); see CacheStore._index
IndexEntry = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
MEMORY_SHARE = 0.9  # the most of the device's available memory one cache's pools may take


class CacheStore:
    """Key/value storage for several sequences on one pool, under one :class:`CacheContract`.

    ``keys[layer]``/``values[layer]``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the
    contract dtype. Each group (full / sliding) has ``num_blocks`` blocks of its own. An 8-bit cache
    (``contract.kv_quant``) stores e4m3fn codes and keeps ``scales[layer]`` (:class:`LayerScales`, set
    at the layer's first write; :mod:`ropekv.cache.quant`); its rows are dequantized on read.
    """

    def __init__(
        self,
        contract: CacheContract,
        num_blocks: int,
        device: str | torch.device = "cpu",
        *,
        rollback_depth: int = 16,
        policy: CacheOpPolicy | None = None,
    ) -> None:
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
        check_pool_fits(c, num_blocks, self.device)
        self._layer_group: list[CacheGroup] = [group_of(c.layer_attention(i)) for i in range(c.num_layers)]
        sliding = tuple(i for i, g in enumerate(self._layer_group) if g == "sliding")
        full = tuple(i for i, g in enumerate(self._layer_group) if g == "full")
        self._groups: dict[CacheGroup, Group] = {}
        if full:
            self._groups["full"] = Group("full", full, None, 0, num_blocks, c.block_size, self.device)
        if sliding:
            self._groups["sliding"] = Group(
                "sliding", sliding, c.window, c.sink_tokens, num_blocks, c.block_size, self.device
            )
        self.keys = [head_major_pool(num_blocks, c, self.device) for _ in range(c.num_layers)]
        self.values = [head_major_pool(num_blocks, c, self.device) for _ in range(c.num_layers)]
        # per layer, an 8-bit cache's static scales (None until the layer's first write, and always
        # None for an unquantized cache)
        self.scales: list[LayerScales | None] = [None] * c.num_layers
        self._seqs: dict[Hashable, SeqState] = {}
        self._reserved: list[Reservation] = []
        self._index_cache: dict[tuple[Hashable, CacheGroup], IndexEntry] = {}

    # ------------------------------------------------------------------ stored form

    @property
    def quantized(self) -> bool:
        """The cache stores 8-bit codes with per-layer scales (``contract.kv_quant``)."""
        return self.contract.kv_quant is not None

    def _scales_for(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        given: Sequence[LayerScales] | None = None,
    ) -> list[LayerScales | None]:
        """The scales every layer has after a write of ``keys``/``values[layer] [n, KVH, D]``: its own,
        or (first write) ``given[layer]`` (an import's) or the ones this write's amax sets. Computes
        and checks; assigns nothing."""
        q = self.contract.kv_quant
        if q is None:
            return list(self.scales)
        size = 1 if q.scale == "per_tensor" else self.contract.num_kv_heads
        if given is not None and (
            len(given) != self.contract.num_layers
            or not all(isinstance(s, LayerScales) and s.k.numel() == s.v.numel() == size for s in given)
        ):
            raise CacheError(f"append: scales must be one LayerScales of {size} entries ({q.scale}) per layer")
        return [
            s if s is not None else given[i] if given is not None else LayerScales.of(keys[i], values[i], q.scale)
            for i, s in enumerate(self.scales)
        ]

    def encode(self, layer: int, which: str, x: torch.Tensor) -> torch.Tensor:
        """Rows ``x [k, KVH, D]`` of ``layer``'s keys (``which="k"``) or values (``"v"``) in the stored
        form: e4m3fn codes under the layer's scale (set: see :meth:`_scales_for`), else the contract dtype."""
        x = x.to(self.device)
        if not self.quantized:
            return x.to(self.contract.torch_dtype)
        s = self.scales[layer]
        if s is None:
            raise CacheError(f"layer {layer} of an 8-bit cache has no scales yet: nothing was written to it")
        return quantize(x, s.k if which == "k" else s.v)

    def decode(self, layer: int, which: str, stored: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Stored rows ``[k, KVH, D]`` of ``layer`` as numbers: dequantized (with ``scale``, ``[S]`` or
        ``[k, S]``, default the layer's own) in float32 for an 8-bit cache, else as stored."""
        if not self.quantized:
            return stored
        if scale is None:
            s = self.scales[layer]
            if s is None:
                raise CacheError(f"layer {layer} of an 8-bit cache has no scales yet: nothing was written to it")
            scale = s.k if which == "k" else s.v
        return dequantize(stored, scale)

    # ------------------------------------------------------------------ lookups

    def _seq(self, seq_id: Hashable) -> SeqState:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise CacheError(f"unknown sequence {seq_id!r}") from None

    def _group(self, name: str) -> Group:
        for g in self._groups.values():
            if g.name == name:
                return g
        raise UsageError(f"no {name!r} layer group in this cache; groups: {', '.join(self._groups)}")

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.contract.num_layers:
            raise UsageError(f"layer {layer!r} out of range [0, {self.contract.num_layers})")

    def _invalidate(self, seq_id: Hashable) -> None:
        for name in self._groups:
            self._index_cache.pop((seq_id, name), None)

    def _index(self, seq_id: Hashable, seq: SeqState, g: Group) -> IndexEntry:
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

    def _flat(self, g: Group, seq: SeqState, slots: torch.Tensor) -> torch.Tensor:
        """Flat pool rows ``[k]`` of ``slots [k]`` under the sequence's current block table."""
        bs = g.block_size
        blocks = torch.tensor(seq.tables[g.name], dtype=torch.int64)
        return (blocks[slots // bs] * bs + slots % bs).to(self.device)

    def _copy_block(self, g: Group, old: int) -> int:
        """Copy-on-write: a private copy of a shared block (every layer of the group + positions)."""
        new = g.allocator.allocate()
        for layer in g.layers:
            self.keys[layer][new] = self.keys[layer][old]
            self.values[layer][new] = self.values[layer][old]
        g.positions[new] = g.positions[old]
        g.allocator.decref(old)
        return new

    def _check_positions(self, seq_id: Hashable, seq: SeqState, positions: Any) -> torch.Tensor:
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


def pool_bytes(contract: CacheContract, num_blocks: int) -> int:
    """Bytes of a cache's pools: per layer two ``[num_blocks, block_size, KVH, D]`` tensors (keys and
    values), and per layer group (at most two) the int64 positions ``[num_blocks, block_size]``
    (an 8-bit cache's scales, a few float32 per layer, are not counted)."""
    c = contract
    element = torch.empty((), dtype=c.torch_dtype).element_size()
    slots = num_blocks * c.block_size
    return 2 * c.num_layers * slots * c.num_kv_heads * c.head_dim * element + 2 * slots * 8


def available_bytes(device: torch.device) -> int | None:
    """Memory ``device`` can still give (CUDA: free device memory; CPU: the kernel's MemAvailable),
    None where it cannot be told."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_pool_fits(contract: CacheContract, num_blocks: int, device: torch.device) -> None:
    """CapacityError, before anything is allocated, when the pools of ``num_blocks`` blocks would take
    more than :data:`MEMORY_SHARE` of the memory ``device`` has available (an allocator failure, or
    the machine swapping, otherwise)."""
    need = pool_bytes(contract, num_blocks)
    have = available_bytes(device)
    if have is not None and need > MEMORY_SHARE * have:
        c = contract
        raise CapacityError(
            f"a cache of {num_blocks} blocks x {c.block_size} slots ({c.num_layers} layers, keys and values, "
            f"{c.dtype}) needs {_gib(need)}; {device.type} has {_gib(have)} available: use fewer or smaller blocks"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_seq_id(seq_id: Any) -> None:
    try:
        hash(seq_id)
    except TypeError:
        raise UsageError(f"sequence id {seq_id!r} is not hashable") from None
