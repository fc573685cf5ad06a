"""Bugs injected into vLLM's decode path in the running process, one per bug class ropekv must catch.

Each fault patches the live engine's modules (instance attributes, undone on exit), never ropekv's
code, so the adapter sees a buggy vLLM exactly as it would see one shipped that way. "Decode" is a
forward of a single token at a position > 0 (vLLM's decode step); prefill is left correct, so only the
cached path diverges. Each names the :class:`~ropekv.parity.bug_class.BugClass` forensics should find.

- ``double_rotation``: the decode-side reader rotates every cached (already rotated) key again before
  the kernel reads it; the kernel sees ``R(2j) k_j``.
- ``query_position_offset``: the decode query is rotated at ``t + 1``.
- ``slot_as_position``: the decode-side reader re-indexes cached keys by their physical slot (block
  table entry x block size + offset): the kernel sees ``R(slot) k_j``.
- ``frequency_mismatch``: decode rotates with another RoPE base (10,000, llama's default, hard-coded).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..adapters.vllm import kv_layout
from ..errors import UsageError
from ..parity.bug_class import BugClass
from ..rope import apply_rotation
from .record import Fault, FaultEngine

if TYPE_CHECKING:  # pragma: no cover
    from ..adapters.vllm.engine import VLLMEngine


@dataclass(frozen=True, kw_only=True)
class VLLMFault(Fault):
    """A :class:`~ropekv.faults.record.Fault` patched into the running vLLM; ``install(engine)``
    patches it and returns the undo steps."""

    engine: FaultEngine = field(default="vllm", init=False)
    install: Callable[[VLLMEngine], list[Callable[[], None]]]


def _is_decode(positions: torch.Tensor) -> bool:
    return positions.numel() == 1 and int(positions.reshape(-1)[0]) > 0


def _rotary_modules(engine: VLLMEngine) -> list[torch.nn.Module]:
    seen: dict[int, torch.nn.Module] = {}
    for layer in engine.model.model.layers:
        seen.setdefault(id(layer.self_attn.rotary_emb), layer.self_attn.rotary_emb)
    return list(seen.values())


def _unpatch(obj: Any, name: str) -> Callable[[], None]:
    """The undo step of a patch of ``obj``'s instance attribute ``name``: drop it (the class's shows again)."""

    def undo() -> None:
        obj.__dict__.pop(name, None)

    return undo


def _patch_rotary(engine: VLLMEngine, decode_forward) -> list[Callable[[], None]]:
    """Replace each rotary module's ``forward`` on decode steps by ``decode_forward(rope, original,
    positions, query, key)``; prefill keeps the original."""
    undo: list[Callable[[], None]] = []
    for rope in _rotary_modules(engine):
        original = rope.forward

        def forward(positions, query, key=None, _rope=rope, _original=original):
            if _is_decode(positions):
                return decode_forward(_rope, _original, positions, query, key)
            return _original(positions, query, key)

        rope.forward = forward
        undo.append(_unpatch(rope, "forward"))
    return undo


def _query_off_by_one(rope, original, positions, query, key):
    q, _ = original(positions + 1, query, key.clone())
    _, k = original(positions, query.clone(), key)
    return q, k


def _other_base(base: float) -> float:
    return 10000.0 if base != 10000.0 else 500000.0


def _decode_base(rope, original, positions, query, key):
    table = rope.cos_sin_cache
    inv_freq = 1.0 / (
        _other_base(float(rope.base)) ** (torch.arange(0, rope.rotary_dim, 2, dtype=torch.float) / rope.rotary_dim)
    )
    freqs = torch.arange(table.shape[0], dtype=torch.float)[:, None] * inv_freq[None, :]
    rope.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(table.dtype)
    try:
        return original(positions, query, key)
    finally:
        rope.cos_sin_cache = table


def _install_reader(
    engine: VLLMEngine, turn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> list[Callable[[], None]]:
    """Patch each layer's CPU attention ``forward`` so that on decode the kernel reads every cached key
    turned once more by ``turn(positions, slots)`` (a buggy re-indexing step on the decode read path)."""
    rope = _rotary_modules(engine)[0]
    undo: list[Callable[[], None]] = []
    for layer in engine.model.model.layers:
        impl = layer.self_attn.attn.impl
        original = impl.forward

        def forward(layer_, query, key, value, kv_cache, attn_metadata, *args, _original=original, **kwargs):
            if attn_metadata is not None and attn_metadata.max_query_len == 1 and int(attn_metadata.seq_lens[0]) > 1:
                kv_cache, attn_metadata = _turned_copy(kv_cache, attn_metadata, rope, str(layer_.isa), turn)
            return _original(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

        impl.forward = forward
        undo.append(_unpatch(impl, "forward"))
    return undo


def _turned_copy(kv_cache: torch.Tensor, md, rope: Any, isa: str, turn):
    """A copy of the request's blocks with every key turned by ``turn(positions, slots)``, and metadata
    whose block table points at the copy (the real cache is left as it is)."""
    # kv_cache: [num_blocks, KVH, B, 2D]; one request (the adapter runs them one by one)
    block_size = kv_cache.shape[2]
    n = int(md.seq_lens[0])
    num = -(-n // block_size)
    blocks = md.block_table[0, :num].to(torch.int64)
    copy = kv_cache[blocks].clone()  # [num, KVH, B, 2D]
    keys_view, _ = kv_layout.kernel_views(copy)
    local = torch.arange(n)  # slot i of the copy holds token i, at vLLM's position i
    slots = kv_layout.slots_of(blocks, n, block_size)  # the real slots
    keys = kv_layout.read_keys(keys_view, local, isa)  # [n, KVH, D]
    inv_freq = 1.0 / (float(rope.base) ** (torch.arange(0, rope.rotary_dim, 2, dtype=torch.float64) / rope.rotary_dim))
    angles = turn(local, slots).to(torch.float64)[:, None] * inv_freq[None, :]  # [n, rotary_dim / 2]
    layout = "neox" if rope.is_neox_style else "gptj"
    kv_layout.write_keys(keys_view, local, apply_rotation(keys, angles.cos(), angles.sin(), layout), isa)
    table = torch.arange(num, dtype=md.block_table.dtype)[None]
    return copy, dataclasses.replace(md, block_table=table)


CATALOGUE: tuple[VLLMFault, ...] = (
    VLLMFault(
        name="double_rotation",
        kind=BugClass.DOUBLE_ROTATION,
        description="decode reads every cached key rotated a second time (R(2j) k_j)",
        install=lambda e: _install_reader(e, lambda positions, slots: positions),
    ),
    VLLMFault(
        name="query_position_offset",
        kind=BugClass.QUERY_POSITION_OFFSET,
        description="decode rotates the query at t + 1",
        install=lambda e: _patch_rotary(e, _query_off_by_one),
    ),
    VLLMFault(
        name="slot_as_position",
        kind=BugClass.SLOT_AS_POSITION,
        description="decode re-indexes cached keys by their physical slot (R(slot) k_j)",
        install=lambda e: _install_reader(e, lambda positions, slots: slots - positions),
    ),
    VLLMFault(
        name="frequency_mismatch",
        kind=BugClass.FREQUENCY_MISMATCH,
        description="decode rotates with another RoPE base (10,000)",
        install=lambda e: _patch_rotary(e, _decode_base),
    ),
)


@contextlib.contextmanager
def injected(engine: VLLMEngine, name: str) -> Iterator[VLLMFault]:
    """Patch ``engine``'s running vLLM with fault ``name`` (of :data:`CATALOGUE`) for the duration of the block."""
    fault = next((f for f in CATALOGUE if f.name == name), None)
    if fault is None:
        raise UsageError(f"unknown vLLM fault {name!r}; known: {', '.join(f.name for f in CATALOGUE)}")
    undo = fault.install(engine)
    try:
        yield fault
    finally:
        for step in reversed(undo):
            step()
