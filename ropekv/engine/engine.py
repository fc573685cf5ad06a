"""The reference cached engine: several sequences served from one paged KV cache.

``prefill`` (optionally chunked), ``fork`` (a prefix-cache hit: the new prompt starts at logical
position ``P > 0``), ``decode`` and ``free``. Attention for a chunk reads the cached keys as they were
before the chunk plus the chunk's fresh keys; the chunk is then appended to the cache in one
validated call, so a failed step leaves the cache as it was. ``forward_full`` is the engine's own
cache-free forward (for self-parity).

Length-dependent RoPE (dynamic NTK, LongRoPE): under ``key_form="raw"`` keys are rotated on read with
the frequencies of the current length, as a full forward over the same tokens does at layer 0. Every
chunk of one prefill turns under the frequencies of the length the whole prefill reaches, as one
unchunked forward over it does: a chunked prefill computes what an unchunked one computes (choosing
per chunk, from the chunk's end, gives LongRoPE's early chunks the short factors and later ones the
long factors: the ``longrope-factor-per-chunk`` fault, :mod:`ropekv.bugs.mixed_rotations`). Under
``"rotated"`` the cache would keep keys turned at stale frequencies, so the engine refuses that
contract (see docs/contract.md). Re-rotating every cached key at each length change was rejected: it
costs a pass over the whole cache per step and still leaves deeper layers' keys and values computed
under the old frequencies.

``decode_batch`` decodes several sequences of different lengths in one step: a left-padded batch,
each row at its own next position. Every step, batched or not, goes through one layer loop
(``_run``): a batch is ``B`` rows of one token (:mod:`ropekv.engine.step`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..argtypes import MAX_POSITION
from ..attention_kind import LayerAttention
from ..cache.ops import shift_invariant
from ..cache.paged import PagedKVCache
from ..cache.policy import CacheOpPolicy
from ..contract import CacheContract
from ..errors import CacheError, UsageError
from ..models.config import Checkpoint
from ..probe import LayerProbe
from ..rope import PositionStreams
from .attention import (
    Backend,
    PaddedRow,
    attend,
    attend_padded,
    attend_segments,
    backend_for,
    get_backend,
    visibility,
)
from .fit import check_contract_fits_model
from .rotation import NO_OPS, OpFacts, Phase, RopeTable, RopeTables, RotationPolicy, StepContext
from .step import StepGroup, StepRow, layer_probe, query_row
from .transformer import DecoderWeights, LayerWeights, after_rope, embed, final_logits, finish_layer, project_qkv


@dataclass(frozen=True, eq=False)
class StepOutput:
    logits: torch.Tensor  # [n, vocab] float32 (decode: n = 1; prefill: its last row; [R, vocab] of logits_rows)
    positions: torch.Tensor  # [n]
    layers: tuple[LayerProbe, ...] = ()  # per layer when probed (see step.layer_probe)


class Engine:
    """A paged-KV engine for a llama-family checkpoint under an explicit :class:`CacheContract`."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        contract: CacheContract,
        num_blocks: int = 1024,
        *,
        backend: str | Backend | None = None,
        rotation: RotationPolicy | None = None,
        device: str | torch.device = "cpu",
        weights: DecoderWeights | None = None,
        compile_rotation: bool = False,
        cache_ops: CacheOpPolicy | None = None,
        rollback_depth: int = 16,
    ) -> None:
        cfg = checkpoint.config
        self.checkpoint = checkpoint
        self.config = cfg
        self.contract = contract
        self.rotation = rotation or RotationPolicy()
        self.device = torch.device(device)
        check_contract_fits_model(checkpoint, contract)
        self.backend = (
            backend_for(contract)
            if backend is None
            else (get_backend(backend) if isinstance(backend, str) else backend)
        )
        self.backend.check(contract)
        self.rotation.check_contract(contract)
        self.dtype = contract.compute_dtype  # the storage dtype, float32 for an 8-bit cache
        if weights is not None and (weights.config != cfg or weights.embed.dtype != self.dtype):
            raise UsageError("shared weights were built for another config or dtype")
        self.weights = weights or DecoderWeights.from_checkpoint(checkpoint, self.dtype, self.device)
        self.cache = PagedKVCache(
            contract, num_blocks, device=self.device, rollback_depth=rollback_depth, policy=cache_ops
        )
        self._fork_offset: dict[Hashable, int] = {}
        self._op_facts: dict[Hashable, OpFacts] = {}  # cache operations per sequence, for StepContext.ops
        self._streams: dict[Hashable, PositionStreams] = {}  # mRoPE streams per sequence (image-like prompts)
        self._join_buffers: list[torch.Tensor | None] = [None, None]  # keys, values; see _joined
        self._key_scratch: torch.Tensor | None = None  # keys a rotating backend turns; see _scratch
        work = torch.float64 if self.dtype == torch.float64 else torch.float32
        # cos/sin rows, see _step_tables; compile_rotation: a rotating backend turns keys in one
        # torch.compile'd pass (tests/test_bench.py holds it to the eager step within float32 rounding)
        self._rope_tables = RopeTables(
            contract.rope, work, self.device, compile_keys=compile_rotation and self.backend.rotates
        )

    # ------------------------------------------------------------------ public API

    def prefill(
        self,
        seq_id: Hashable,
        tokens: torch.Tensor,
        *,
        chunk_size: int | None = None,
        streams: PositionStreams | None = None,
    ) -> torch.Tensor:
        """Append ``tokens [n]`` to ``seq_id`` (created if new); returns the last token's logits ``[vocab]``.

        ``streams``: the sequence's mRoPE position streams by token index (an image-like prompt, an
        mRoPE model only); they must give the tokens already cached the streams they were cached with.
        Tokens past the streams, and every token of a sequence without any, are text."""
        tokens = self._check_tokens(tokens)
        if chunk_size is not None and chunk_size < 1:
            raise UsageError(f"chunk_size must be >= 1, got {chunk_size}")
        created = not self.cache.has(seq_id)
        if streams is not None:
            self._check_streams(seq_id, streams, 0 if created else self.cache.num_tokens(seq_id))
        if created:
            self.cache.create(seq_id)
            self._fork_offset[seq_id] = 0
        old_streams = self._streams.get(seq_id)
        if streams is not None:
            self._streams[seq_id] = streams
        try:
            # Refuse the whole prompt before its first chunk, so a refused prefill caches nothing.
            self._check_positions(self.cache.last_position(seq_id) + tokens.numel(), self._first(seq_id))
            self.cache.check_room(seq_id, tokens.numel())
            step = chunk_size or tokens.numel()
            # Every chunk turns under the frequencies of the length the whole prefill reaches (see above).
            seq_len = self.cache.last_position(seq_id) + 1 + tokens.numel()
            out = None
            for start in range(0, tokens.numel(), step):
                chunk = tokens[start : start + step]
                out = self._step(seq_id, chunk, phase="prefill", probe=False, last_logits=True, seq_len=seq_len)
        except Exception:
            if created and self.cache.num_tokens(seq_id) == 0:
                self.free(seq_id)
            elif old_streams is not None:
                self._streams[seq_id] = old_streams
            raise
        assert out is not None  # tokens is non-empty: at least one chunk ran
        return out.logits[-1]

    def decode(self, seq_id: Hashable, token: int | torch.Tensor, *, probe: bool = False) -> StepOutput:
        """Append one token to an existing sequence; returns its next-token logits (and probes)."""
        if not self.cache.has(seq_id):
            raise CacheError(f"decode: unknown sequence {seq_id!r}")
        tokens = self._check_tokens(torch.as_tensor([int(token)] if not torch.is_tensor(token) else token.reshape(1)))
        return self._step(seq_id, tokens, phase="decode", probe=probe)

    def verify(self, seq_id: Hashable, tokens: torch.Tensor, *, probe: bool = False) -> list[StepOutput]:
        """Append a speculative draft ``tokens [K]`` to ``seq_id`` in one forward (phase ``"verify"``)
        and return one output per draft row: its next-token logits ``[1, vocab]``, its position and,
        probed, per layer exactly the keys that row attended to (the engine's own mask). The caller
        accepts a prefix and gives the rest back with :meth:`rollback`."""
        if not self.cache.has(seq_id):
            raise CacheError(f"verify: unknown sequence {seq_id!r}")
        tokens = self._check_tokens(tokens)
        self.cache.check_room(seq_id, tokens.numel())
        start = self.cache.last_position(seq_id) + 1
        positions = torch.arange(start, start + tokens.numel(), dtype=torch.int64)
        self._check_positions(int(positions[-1]))
        row = self._row(seq_id, slice(0, tokens.numel()), positions, "verify", probed=probe)
        rows = list(range(tokens.numel()))
        out = self._run(tokens, positions, [row], padded=False, probe_rows=rows if probe else None)[0]
        masks = [row.groups[self.contract.layer_attention(layer)].mask for layer in range(len(out.layers))]
        return [
            StepOutput(
                out.logits[i : i + 1],
                positions[i : i + 1],
                tuple(query_row(p, i, mask[i]) for p, mask in zip(out.layers, masks)),
            )
            for i in rows
        ]

    def decode_batch(
        self, seq_ids: Sequence[Hashable], tokens: torch.Tensor, *, probe: bool = False
    ) -> list[StepOutput]:
        """Decode ``tokens [B]`` (row ``r`` continues ``seq_ids[r]``) in one step; one ``StepOutput`` per row.

        Sequences are prefilled alone (each at its own positions ``0..n_r - 1``), then decoded
        together: the step's hidden states are one ``[B, hidden]`` tensor, and attention runs over one
        left-padded key tensor ``[B, N_max, KVH, D]`` whose padding is masked out. Every row's query and
        new key turn at that row's own next position (its last cached position + 1), never at a
        shared cursor: a shared cursor puts the shorter rows' queries off by their padding. The cache
        is written after the whole step, row by row, and a row that cannot be written takes the rows
        before it back out."""
        cache, c = self.cache, self.contract
        seq_ids = list(seq_ids)
        tokens = self._check_tokens(torch.as_tensor(tokens).reshape(-1))
        B = len(seq_ids)
        if B == 0 or tokens.numel() != B:
            raise UsageError(
                f"decode_batch: {B} sequence(s) and {tokens.numel()} token(s); give one token per sequence"
            )
        if len(set(seq_ids)) != B:
            raise UsageError("decode_batch: a sequence appears twice in one batch")
        for sid in seq_ids:
            if not cache.has(sid) or cache.num_tokens(sid) == 0:
                raise CacheError(f"decode_batch: unknown or empty sequence {sid!r}")
        if c.rotation_index == "cache":
            raise UsageError(
                "decode_batch: rotation_index='cache' re-indexes per row and is not batched; decode one by one"
            )
        positions = torch.tensor([cache.last_position(s) + 1 for s in seq_ids], dtype=torch.int64)  # [B]
        for sid, p in zip(seq_ids, positions.tolist()):
            self._check_positions(p, self._first(sid))
        for sid in seq_ids:
            cache.check_room(sid, 1)
        cursor = int(positions.max())
        rows = [
            self._row(sid, slice(r, r + 1), positions[r : r + 1], "decode", probed=probe, padding=cursor - int(p))
            for r, (sid, p) in enumerate(zip(seq_ids, positions.tolist()))
        ]
        return self._run(tokens, positions, rows, padded=True, probe_rows=[0] if probe else None)

    def fork(self, new_seq_id: Hashable, prefix_seq_id: Hashable, prefix_len: int) -> None:
        """Start ``new_seq_id`` from the first ``prefix_len`` cached tokens of ``prefix_seq_id``."""
        self.cache.fork(new_seq_id, prefix_seq_id, prefix_len)
        self._fork_offset[new_seq_id] = prefix_len
        if prefix_seq_id in self._streams:  # the prefix keeps the streams it was cached with
            self._streams[new_seq_id] = self._streams[prefix_seq_id]

    def adopt(self, seq_id: Hashable, *, restored: int) -> None:
        """Take on ``seq_id``, a sequence of ``restored`` tokens written into the cache from outside (a
        saved file, ``ropekv.transfer.saved``): no fork offset, and its op facts note the restore."""
        if not self.cache.has(seq_id):
            raise CacheError(f"adopt: unknown sequence {seq_id!r}")
        self._fork_offset[seq_id] = 0
        self._note(seq_id, restored=restored)

    def free(self, seq_id: Hashable) -> None:
        if not self.cache.has(seq_id):
            raise CacheError(f"free: unknown sequence {seq_id!r}")
        self.cache.free(seq_id)
        self._fork_offset.pop(seq_id, None)
        self._op_facts.pop(seq_id, None)
        self._streams.pop(seq_id, None)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.cache.num_tokens(seq_id)

    # ------------------------------------------------------------------ cache operations (docs/ops.md)

    def rollback(self, seq_id: Hashable, n: int) -> None:
        """Give back the last ``n`` tokens (a rejected draft); see :meth:`PagedKVCache.rollback`."""
        self.cache.rollback(seq_id, n)
        self._note(seq_id, rolled_back=n)

    def evict(self, seq_id: Hashable, positions: Sequence[int] | torch.Tensor) -> None:
        """Drop the tokens at ``positions``; survivors keep theirs (see :meth:`PagedKVCache.evict`)."""
        self.cache.evict(seq_id, positions)
        self._note(seq_id, evicted=len(positions))

    def shift(self, seq_id: Hashable, delta: int, from_position: int = 0) -> None:
        """Move the tokens at or after ``from_position`` by ``delta`` (see :meth:`PagedKVCache.shift`)."""
        last = self.cache.last_position(seq_id) + (delta if self.cache.last_position(seq_id) >= from_position else 0)
        first = self._first(seq_id)
        self._check_positions(last, first + delta if first >= from_position else first)
        self.cache.shift(seq_id, delta, from_position)

    def op_facts(self, seq_id: Hashable | None) -> OpFacts:
        """Cache operations ``seq_id`` went through (what :class:`StepContext` hands rotation policies)."""
        return self._op_facts.get(seq_id, NO_OPS)

    def _note(self, seq_id: Hashable, **counts: int) -> None:
        facts = self.op_facts(seq_id)
        self._op_facts[seq_id] = dataclasses.replace(facts, **{k: getattr(facts, k) + v for k, v in counts.items()})

    def forward_full(
        self,
        tokens: torch.Tensor,
        *,
        probe_rows: list[int] | None = None,
        logits_rows: list[int] | None = None,
        streams: PositionStreams | None = None,
    ) -> StepOutput:
        """The engine's own cache-free forward over ``tokens [T]`` at positions ``0..T-1`` (under mRoPE
        ``streams``, as :meth:`prefill` takes them). Logits ``[T, vocab]``, or ``[R, vocab]`` of
        ``logits_rows`` only (a check compares a few rows: at 8,190 tokens all rows are 1.6 GB of
        float32 logits)."""
        tokens = self._check_tokens(tokens)
        if streams is not None:
            self._check_streams(None, streams, 0)
        positions = torch.arange(tokens.numel())
        row = self._row(
            None, slice(0, tokens.numel()), positions, "full", probed=probe_rows is not None, streams=streams
        )
        return self._run(tokens, positions, [row], padded=False, probe_rows=probe_rows, logits_rows=logits_rows)[0]

    # ------------------------------------------------------------------ internals

    def _first(self, seq_id: Hashable) -> int:
        """The first cached position of ``seq_id`` (0 for a new or empty sequence)."""
        return max(0, self.cache.first_position(seq_id)) if self.cache.has(seq_id) else 0

    def _check_positions(self, last: int, first: int = 0) -> None:
        """Refuse ``last`` where the model cannot run at it. Under shift-invariant RoPE (fixed
        frequencies, one position per token) the model sees positions only through ``i - j``: what must
        fit its positions is the span from the sequence's first cached position ``first`` (0 unless a
        shift moved it) to ``last``, and a shifted sequence may sit past them, up to
        :data:`~ropekv.argtypes.MAX_POSITION`. Otherwise ``last`` itself must fit."""
        limit = self.config.position_limit
        c = self.contract
        relative = all(r is None or shift_invariant(r) for r in (c.layer_rope(i) for i in range(c.num_layers)))
        if last > MAX_POSITION:
            raise UsageError(f"position {last} is beyond {MAX_POSITION} (2**40), the largest position ropekv runs at")
        if relative and first > 0 and last - first >= limit:
            raise UsageError(f"positions {first}..{last} span {last - first + 1}, beyond the model's {limit} positions")
        if (not relative or first == 0) and last >= limit:
            raise UsageError(f"position {last} is beyond the model's {limit} positions")

    def _check_streams(self, seq_id: Hashable | None, streams: PositionStreams, num_cached: int) -> None:
        """UsageError unless ``streams`` can serve ``seq_id``: an mRoPE contract, and the tokens already
        cached keep the streams they were rotated at (text, for a sequence without streams)."""
        if not isinstance(streams, PositionStreams):
            raise UsageError(f"streams must be PositionStreams, got {type(streams).__name__}")
        c = self.contract
        if all(r is None or r.mrope_section is None for r in (c.layer_rope(i) for i in range(c.num_layers))):
            raise UsageError("mRoPE position streams need an mRoPE model (rope mrope_section); this one has none")
        old = self._streams.get(seq_id)
        index = torch.arange(num_cached)
        cached = old.at(index) if old is not None else index.expand(3, -1)
        if num_cached and not torch.equal(streams.at(index), cached):
            raise UsageError(
                f"streams of {seq_id!r}: the {num_cached} cached tokens were rotated at other streams; "
                "streams cannot change under cached keys"
            )

    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 1 or tokens.numel() == 0 or tokens.is_floating_point():
            raise UsageError(f"tokens must be a non-empty 1-D integer tensor, got shape {tuple(tokens.shape)}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            raise UsageError(f"token ids must be in [0, {self.config.vocab_size})")
        return tokens.to(torch.int64)

    def _step(
        self,
        seq_id: Hashable,
        tokens: torch.Tensor,
        *,
        phase: Phase,
        probe: bool,
        last_logits: bool = False,
        seq_len: int | None = None,
    ) -> StepOutput:
        """One sequence's chunk (or decode token) as a step of one row; ``seq_len``: the length its
        frequencies are for (a prefill chunk's: the whole prefill's; None: the step's last position + 1)."""
        start = self.cache.last_position(seq_id) + 1
        positions = torch.arange(start, start + tokens.numel(), dtype=torch.int64)
        self._check_positions(int(positions[-1]), self._first(seq_id) if self.cache.num_tokens(seq_id) else start)
        row = self._row(seq_id, slice(0, tokens.numel()), positions, phase, probed=probe, seq_len=seq_len)
        return self._run(
            tokens,
            positions,
            [row],
            padded=False,
            probe_rows=list(range(tokens.numel())) if probe else None,
            logits_rows=[tokens.numel() - 1] if last_logits else None,
        )[0]

    def _row(
        self,
        seq_id: Hashable | None,
        tokens: slice,
        positions: torch.Tensor,
        phase: Phase,
        *,
        probed: bool,
        padding: int | None = None,
        streams: PositionStreams | None = None,
        seq_len: int | None = None,
    ) -> StepRow:
        """``seq_id``'s share of a step: ``positions [n_r]`` at ``tokens`` of the step, its context and
        groups. ``padding`` (a row of a left-padded batch): the row's left padding, noted in its op
        facts. A batch row keeps its keys until the batch attends (no join buffer, no key scratch)
        and turns its one query and key without step tables. ``streams`` (the full forward's): mRoPE
        streams; a cached sequence's are its own. ``seq_len``: the length the step's frequencies are
        for (None: its last position + 1)."""
        padded = padding is not None
        c = self.contract
        if seq_id is not None:
            streams = self._streams.get(seq_id)
        groups = self._step_groups(seq_id, positions, in_place=not (probed or padded))
        ops = self.op_facts(seq_id)
        ctx = StepContext(
            phase=phase,
            seq_len=int(positions.max()) + 1 if seq_len is None else seq_len,
            fork_offset=self._fork_offset.get(seq_id, 0),
            block_size=c.block_size,
            layer_ropes=tuple(c.layer_rope(i) for i in range(c.num_layers)),
            window_layers=c.window_layers,
            ops=ops if padding is None else dataclasses.replace(ops, padding=padding),
            tables=() if padded or streams is not None else self._step_tables(positions, groups.values()),
            key_scratch=None if probed or padded else self._scratch(groups.values()),
            streams=streams,
        )
        return StepRow(seq_id, tokens, positions, ctx, groups)

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: Sequence[StepRow],
        *,
        padded: bool,
        probe_rows: list[int] | None,
        logits_rows: list[int] | None = None,
    ) -> list[StepOutput]:
        """The layer loop of every step: ``tokens [n]`` at ``positions [n]``, split into ``rows`` (one
        sequence each). Each layer projects all rows at once, treats each row alone
        (:meth:`_attend_row`), and under ``padded`` attends over all rows in one left-padded batch.
        The cache is written after the last layer, row by row; a row that cannot be written takes
        the rows before it back out. ``probe_rows``/``logits_rows`` count within a row."""
        cfg, c = self.config, self.contract
        h = embed(cfg, self.weights, tokens.to(self.device))  # [n, hidden]
        new_keys: list[list[torch.Tensor]] = [[] for _ in rows]
        new_values: list[list[torch.Tensor]] = [[] for _ in rows]
        traces: list[list[LayerProbe]] = [[] for _ in rows]
        for layer, lw in enumerate(self.weights.layers):
            q, k, v = project_qkv(cfg, lw, h, positions)  # [n, H, D], [n, KVH, D], [n, KVH, D]
            outs, batch = [], []
            for i, row in enumerate(rows):
                stored, out, operands, trace = self._attend_row(layer, lw, row, h, q, k, v, padded, probe_rows)
                # Copies, not views: v (and raw keys) are views of the layer's fused qkv projection, and
                # a view would keep all of it alive until the cache write after the last layer. In a
                # 32k-token prefill of Gemma 3 270M that held 200 MB of qkv per layer, 3 GB in all.
                # A decode step's rows are already contiguous, so this copies nothing there.
                new_keys[i].append(stored.contiguous())
                new_values[i].append(v[row.tokens].contiguous())
                if trace is not None:
                    traces[i].append(trace)
                if out is not None:
                    outs.append(out)
                if operands is not None:
                    batch.append(operands)
            if padded:  # [B, H, D]
                attn = attend_padded(batch, cfg.num_heads, q.dtype, cfg.attn_scale, cfg.attn_softcap, lw.sinks)
            else:
                (attn,) = outs
            h = finish_layer(cfg, lw, h, attn)
        written: list[StepRow] = []
        try:
            for row, keys, values in zip(rows, new_keys, new_values):
                if row.seq_id is not None:
                    self.cache.append(row.seq_id, row.positions, keys, values, key_form=c.key_form)
                    written.append(row)
        except BaseException:
            for row in written:
                self.cache.rollback(row.seq_id, row.positions.numel())
            raise
        if logits_rows is not None:  # only the rows a caller reads ([R, hidden] -> [R, vocab] logits)
            h = h[torch.as_tensor(logits_rows, dtype=torch.int64)]
        logits = final_logits(cfg, self.weights, h)
        if len(rows) == 1:
            return [StepOutput(logits, rows[0].positions, tuple(traces[0]))]
        return [StepOutput(logits[row.tokens], row.positions, tuple(t)) for row, t in zip(rows, traces)]

    def _attend_row(
        self,
        layer: int,
        lw: LayerWeights,
        row: StepRow,
        h: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        padded: bool,
        probe_rows: list[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, PaddedRow | None, LayerProbe | None]:
        """One row in one layer, from the step's ``h [n, hidden]``, ``q [n, H, D]``, ``k``/``v``
        ``[n, KVH, D]``: the row's new keys in the stored form, then its attention output ``[n_r, H, D]``
        or (``padded``) the operands the batch attends over, and its probe when probed."""
        cfg, c, rot = self.config, self.contract, self.rotation
        rope = c.layer_rope(layer)  # None: a NoPE layer (the policy leaves its q/k unrotated)
        ctx = row.ctx.for_layer(layer)
        g = row.groups[c.layer_attention(layer)]
        if not (row.tokens.start == 0 and row.tokens.stop == q.shape[0]):  # a row of several
            h, q, k, v = h[row.tokens], q[row.tokens], k[row.tokens], v[row.tokens]
        positions = row.positions
        # copy=False: the cached keys/values are read (or joined with this step's) right below,
        # before the cache can change.
        view = self.cache.view(row.seq_id, layer, copy=False) if row.seq_id is not None else None
        # raw keys exist only where q/k norms (if any) come before RoPE (check_contract_fits_model)
        stored = (
            k
            if c.key_form == "raw"
            else after_rope(cfg, lw.k_norm, rot.write_key(rope, k, positions, g.new_slots, ctx))
        )
        if g.segments:  # a decode step that sees every key: cached keys read in place, no join
            assert view is not None  # segments come only with cached keys
            q_eff = after_rope(cfg, lw.q_norm, rot.query(rope, q, positions, ctx))
            k_cached = rot.read_keys(
                rope, view.keys, view.positions, view.slots, ctx, backend_rotates=self.backend.rotates
            )
            k_new = rot.read_keys(rope, stored, positions, g.new_slots, ctx, backend_rotates=self.backend.rotates)
            out = attend_segments(
                q_eff,
                (k_cached, k_new),
                (view.values, v),
                scale=cfg.attn_scale,
                softcap=cfg.attn_softcap,
                sinks=lw.sinks,
            )
            return stored, out, None, None
        if view is not None:
            # probes and batch rows keep k_eff (the keys themselves when read as stored)
            reuse = probe_rows is None and not padded
            keys = self._joined(0, view.keys, stored.to(view.keys.dtype), reuse)
            values = self._joined(1, view.values, v.to(view.values.dtype), reuse)
        else:
            keys, values = stored, v
        attn: torch.Tensor | None = None
        if c.rotation_index == "cache":  # never batched (decode_batch refuses it)
            attn, q_eff, k_eff = self._attend_cache_index(q, keys, values, g.mask, g.key_slots, ctx)
        else:
            q_eff = after_rope(cfg, lw.q_norm, rot.query(rope, q, positions, ctx))
            k_eff = rot.read_keys(rope, keys, g.key_pos, g.key_slots, ctx, backend_rotates=self.backend.rotates)
            if not padded:
                attn, _ = attend(
                    q_eff,
                    k_eff,
                    values,
                    g.attn_mask,
                    scale=cfg.attn_scale,
                    softcap=cfg.attn_softcap,
                    sinks=lw.sinks,
                    with_logits=False,
                )
        trace = (
            None
            if probe_rows is None
            else layer_probe(probe_rows, h, q, q_eff, k_eff, values, g.key_pos, g.key_slots, g.mask)
        )
        operands = PaddedRow(q_eff, k_eff, values, g.mask[0]) if padded else None
        return stored, attn, operands, trace

    def _step_groups(
        self, seq_id: Hashable | None, positions: torch.Tensor, *, in_place: bool
    ) -> dict[LayerAttention, StepGroup]:
        """Slots, key positions and the mask of a row per attention kind (full, the window, the
        chunk), built once per step: every layer of a kind gets the same tensors (and the same cos/sin
        table). Chunked layers live in the full cache group: every key stays cached, and the mask
        hides the keys of earlier chunks (docs/contract.md). ``in_place``: the row may read its cached
        keys in place (neither probed nor batched)."""
        c, n = self.contract, positions.numel()
        num_before = self.cache.num_tokens(seq_id) if seq_id is not None else 0
        out: dict[LayerAttention, StepGroup] = {}
        for layer in range(c.num_layers):
            kind = c.layer_attention(layer)
            if kind in out:
                continue
            new_slots = self.cache.slots_of(layer, num_before, n)
            view = self.cache.view(seq_id, layer, copy=False) if seq_id is not None and num_before else None
            if view is not None:
                key_pos = torch.cat([view.positions, positions])
                key_slots = torch.cat([view.slots, new_slots])
            else:
                key_pos, key_slots = positions, new_slots
            mask = visibility(positions, key_pos, kind.window, c.sink_tokens, kind.chunk)
            everything = bool(mask.all())  # decode without a window hiding anything: attend skips masking
            segments = view is not None and everything and in_place and c.rotation_index == "logical"
            out[kind] = StepGroup(
                new_slots,
                key_pos,
                key_slots,
                mask,
                None if everything else mask,
                segments,
                view.positions if segments and view is not None else key_pos,
            )
        return out

    def _step_tables(self, positions: torch.Tensor, groups: Iterable[StepGroup]) -> tuple[RopeTable, ...]:
        """The step's cos/sin tables: its query positions (queries and new keys), and for a rotating
        backend each group's key positions, expanded to the KV heads."""
        tables = []
        if self.backend.rotates:
            tables += [self._rope_tables.table(g.read_positions, self.config.num_kv_heads) for g in groups]
        tables.append(self._rope_tables.table(positions))
        return tuple(t for t in tables if t is not None)

    def _scratch(self, groups: Iterable[StepGroup]) -> torch.Tensor | None:
        """A buffer for the keys a rotating backend turns, as many rows as the step reads, reused by
        every layer (nothing keeps a layer's keys once the step is not probed)."""
        if not self.backend.rotates:
            return None
        rows = max(g.read_positions.numel() for g in groups)
        c = self.contract
        work = torch.float64 if self.dtype == torch.float64 else torch.float32
        buf = self._key_scratch
        if buf is None or buf.shape[0] < rows or buf.dtype != work:
            # head-major like the pool ([KVH, rows, D] seen as [rows, KVH, D]): the attention
            # matmuls read each head's rotated keys as one contiguous matrix
            size = rows + rows // 4 + 16
            buf = torch.empty((c.num_kv_heads, size, c.head_dim), dtype=work, device=self.device).transpose(0, 1)
            self._key_scratch = buf
        return buf

    def _joined(self, which: int, cached: torch.Tensor, new: torch.Tensor, reuse: bool) -> torch.Tensor:
        """``cat([cached, new])`` (``[N + n, KVH, D]``), written into a buffer shared by all layers when
        ``reuse`` (nothing keeps the result past its layer). Why: at long contexts a fresh tensor of
        a few MB per layer and step is a fresh mapping from the allocator, and its page faults (about
        24,000 per step at 4,096 tokens) cost more than the copy itself."""
        if not reuse:
            return torch.cat([cached, new])
        rows = cached.shape[0] + new.shape[0]
        buf = self._join_buffers[which]
        if buf is None or buf.shape[0] < rows or buf.shape[1:] != cached.shape[1:] or buf.dtype != cached.dtype:
            buf = torch.empty((rows + rows // 4 + 16, *cached.shape[1:]), dtype=cached.dtype, device=cached.device)
            self._join_buffers[which] = buf
        return torch.cat([cached, new], out=buf[:rows])

    def _attend_cache_index(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        key_slots: torch.Tensor,
        ctx: StepContext,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """StreamingLLM-style rotation: each query row turns itself and its visible keys to their order
        among the visible keys (sinks first). Exact with raw keys; one row at a time."""
        rope, rot = self.contract.layer_rope(ctx.layer), self.rotation
        outs, q_effs, k_eff = [], [], None
        for i in range(q.shape[0]):
            vis = mask[i]
            index = torch.cumsum(vis.to(torch.int64), 0) - 1  # rank among visible keys
            k_eff = rot.read_keys(rope, keys, index.clamp(min=0), key_slots, ctx, backend_rotates=self.backend.rotates)
            qi = rot.query(rope, q[i : i + 1], index[vis][-1:].reshape(1), ctx)
            o, _ = attend(
                qi,
                k_eff,
                values,
                mask[i : i + 1],
                scale=self.config.attn_scale,
                softcap=self.config.attn_softcap,
                sinks=self.weights.layers[ctx.layer].sinks,
                with_logits=False,
            )
            outs.append(o)
            q_effs.append(qi)
        assert k_eff is not None  # q has at least one row
        return torch.cat(outs), torch.cat(q_effs), k_eff
