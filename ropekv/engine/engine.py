"""The reference cached engine: several sequences served from one paged KV cache.

``prefill`` (optionally chunked), ``fork`` (a prefix-cache hit: the new prompt starts at logical
position ``P > 0``), ``decode`` and ``free``. Attention for a chunk reads the cached keys as they were
before the chunk plus the chunk's fresh keys; the chunk is then appended to the cache in one
validated call, so a failed step leaves the cache as it was. ``forward_full`` is the engine's own
cache-free forward (for self-parity).

Length-dependent RoPE (dynamic NTK, LongRoPE): under ``key_form="raw"`` keys are rotated on read with
the frequencies of the current length, as a full forward over the same tokens does at layer 0. Under
``"rotated"`` the cache would keep keys turned at stale frequencies, so the engine refuses that
contract (see docs/contract.md). Re-rotating every cached key at each length change was rejected: it
costs a pass over the whole cache per step and still leaves deeper layers' keys and values computed
under the old frequencies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..attention_kind import LayerAttention
from ..cache.paged import PagedKVCache
from ..cache.policy import CacheOpPolicy
from ..contract import CacheContract
from ..errors import CacheError, ContractMismatch, UsageError
from ..models.config import Checkpoint
from ..probe import LayerProbe
from .attention import Backend, attend, attend_segments, backend_for, get_backend, visibility
from .rotation import NO_OPS, OpFacts, Phase, RopeTable, RopeTables, RotationPolicy, StepContext
from .transformer import DecoderWeights, after_rope, embed, final_logits, finish_layer, project_qkv


@dataclass(frozen=True, eq=False)
class StepOutput:
    logits: torch.Tensor  # [n, vocab] float32 (decode: n = 1; prefill: its last row; [R, vocab] of logits_rows)
    positions: torch.Tensor  # [n]
    layers: tuple[LayerProbe, ...] = ()  # per layer when probed (see _probe)


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
    ):
        cfg = checkpoint.config
        self.checkpoint = checkpoint
        self.config = cfg
        self.contract = contract
        self.rotation = rotation or RotationPolicy()
        self.device = torch.device(device)
        self._check_contract_fits_model()
        self.backend = (
            backend_for(contract)
            if backend is None
            else (get_backend(backend) if isinstance(backend, str) else backend)
        )
        self.backend.check(contract)
        self.rotation.check_contract(contract)
        self.dtype = contract.torch_dtype
        if weights is not None and (weights.config != cfg or weights.embed.dtype != self.dtype):
            raise UsageError("shared weights were built for another config or dtype")
        self.weights = weights or DecoderWeights.from_checkpoint(checkpoint, self.dtype, self.device)
        self.cache = PagedKVCache(
            contract, num_blocks, device=self.device, rollback_depth=rollback_depth, policy=cache_ops
        )
        self._fork_offset: dict[object, int] = {}
        self._op_facts: dict[object, OpFacts] = {}  # cache operations per sequence, for StepContext.ops
        self._join_buffers: list[torch.Tensor | None] = [None, None]  # keys, values; see _joined
        self._key_scratch: torch.Tensor | None = None  # keys a rotating backend turns; see _scratch
        work = torch.float64 if self.dtype == torch.float64 else torch.float32
        # cos/sin rows, see _step_tables; compile_rotation: a rotating backend turns keys in one
        # torch.compile'd pass (tests/test_bench.py holds it to the eager step within float32 rounding)
        self._rope_tables = RopeTables(
            contract.rope, work, self.device, compile_keys=compile_rotation and self.backend.rotates
        )

    # ------------------------------------------------------------------ public API

    def prefill(self, seq_id, tokens: torch.Tensor, *, chunk_size: int | None = None) -> torch.Tensor:
        """Append ``tokens [n]`` to ``seq_id`` (created if new); returns the last token's logits ``[vocab]``."""
        tokens = self._check_tokens(tokens)
        if chunk_size is not None and chunk_size < 1:
            raise UsageError(f"chunk_size must be >= 1, got {chunk_size}")
        created = not self.cache.has(seq_id)
        if created:
            self.cache.create(seq_id)
            self._fork_offset[seq_id] = 0
        try:
            # Refuse the whole prompt before its first chunk, so a refused prefill caches nothing.
            self._check_positions(self.cache.last_position(seq_id) + tokens.numel())
            self.cache.check_room(seq_id, tokens.numel())
            step = chunk_size or tokens.numel()
            out = None
            for start in range(0, tokens.numel(), step):
                out = self._step(seq_id, tokens[start : start + step], phase="prefill", probe=False, last_logits=True)
        except Exception:
            if created and self.cache.num_tokens(seq_id) == 0:
                self.free(seq_id)
            raise
        return out.logits[-1]

    def decode(self, seq_id, token: int | torch.Tensor, *, probe: bool = False) -> StepOutput:
        """Append one token to an existing sequence; returns its next-token logits (and probes)."""
        if not self.cache.has(seq_id):
            raise CacheError(f"decode: unknown sequence {seq_id!r}")
        tokens = self._check_tokens(torch.as_tensor([int(token)] if not torch.is_tensor(token) else token.reshape(1)))
        return self._step(seq_id, tokens, phase="decode", probe=probe)

    def fork(self, new_seq_id, prefix_seq_id, prefix_len: int) -> None:
        """Start ``new_seq_id`` from the first ``prefix_len`` cached tokens of ``prefix_seq_id``."""
        self.cache.fork(new_seq_id, prefix_seq_id, prefix_len)
        self._fork_offset[new_seq_id] = prefix_len

    def free(self, seq_id) -> None:
        if not self.cache.has(seq_id):
            raise CacheError(f"free: unknown sequence {seq_id!r}")
        self.cache.free(seq_id)
        self._fork_offset.pop(seq_id, None)
        self._op_facts.pop(seq_id, None)

    def num_tokens(self, seq_id) -> int:
        return self.cache.num_tokens(seq_id)

    # ------------------------------------------------------------------ cache operations (docs/ops.md)

    def rollback(self, seq_id, n: int) -> None:
        """Give back the last ``n`` tokens (a rejected draft); see :meth:`PagedKVCache.rollback`."""
        self.cache.rollback(seq_id, n)
        self._note(seq_id, rolled_back=n)

    def evict(self, seq_id, positions) -> None:
        """Drop the tokens at ``positions``; survivors keep theirs (see :meth:`PagedKVCache.evict`)."""
        self.cache.evict(seq_id, positions)
        self._note(seq_id, evicted=len(positions))

    def shift(self, seq_id, delta: int, from_position: int = 0) -> None:
        """Move the tokens at or after ``from_position`` by ``delta`` (see :meth:`PagedKVCache.shift`)."""
        last = self.cache.last_position(seq_id) + (delta if self.cache.last_position(seq_id) >= from_position else 0)
        self._check_positions(last)
        self.cache.shift(seq_id, delta, from_position)

    def save(self, seq_id, path, tokens: torch.Tensor) -> int:
        """Write ``seq_id`` (whose consumed ids are ``tokens [n]``) to a safetensors file; returns its size."""
        from ..transfer.saved import save_sequence

        return save_sequence(self, seq_id, path, tokens)

    def load(self, path, seq_id=None):
        """Load a file written by :meth:`save`; returns ``(seq_id, tokens)``. All or nothing."""
        from ..transfer.saved import load_sequence

        sid, tokens = load_sequence(self, path, seq_id)
        self._fork_offset[sid] = 0
        self._note(sid, restored=int(tokens.numel()))
        return sid, tokens

    def decode_batch(self, seq_ids: list, tokens: torch.Tensor, *, probe: bool = False) -> list[StepOutput]:
        """One decode step for several sequences of different lengths at once, in a left-padded
        batch: every row at its own next position (see :mod:`ropekv.engine.batch`)."""
        from .batch import decode_batch

        return decode_batch(self, seq_ids, tokens, probe=probe)

    def op_facts(self, seq_id) -> OpFacts:
        """Cache operations ``seq_id`` went through (what :class:`StepContext` hands rotation policies)."""
        return self._op_facts.get(seq_id, NO_OPS)

    def _note(self, seq_id, **counts: int) -> None:
        facts = self.op_facts(seq_id)
        self._op_facts[seq_id] = dataclasses.replace(facts, **{k: getattr(facts, k) + v for k, v in counts.items()})

    def forward_full(
        self, tokens: torch.Tensor, *, probe_rows: list[int] | None = None, logits_rows: list[int] | None = None
    ) -> StepOutput:
        """The engine's own cache-free forward over ``tokens [T]`` at positions ``0..T-1``. Logits
        ``[T, vocab]``, or ``[R, vocab]`` of ``logits_rows`` only (a check compares a few rows: at
        8,190 tokens all rows are 1.6 GB of float32 logits)."""
        tokens = self._check_tokens(tokens)
        return self._run(
            tokens, torch.arange(tokens.numel()), None, phase="full", probe_rows=probe_rows, logits_rows=logits_rows
        )

    # ------------------------------------------------------------------ internals

    def _check_contract_fits_model(self) -> None:
        cfg, c = self.config, self.contract
        problems = []
        for field, ours, theirs in (
            ("num_layers", c.num_layers, cfg.num_layers),
            ("num_kv_heads", c.num_kv_heads, cfg.num_kv_heads),
            ("head_dim", c.head_dim, cfg.head_dim),
        ):
            if ours != theirs:
                problems.append((field, f"{field}: contract {ours}, model {theirs}"))
        if cfg.mla is not None and (c.mla is None or c.mla.cached != "expanded"):
            problems.append(
                (
                    "mla.cached",
                    f"mla.cached: contract {None if c.mla is None else c.mla.cached!r}, "
                    "ropekv's engine caches MLA keys 'expanded' (per-head keys and values, "
                    "the rope part last)",
                )
            )
        elif c.mla is not None and cfg.mla is None:
            problems.append(("mla", "mla: the contract describes multi-head latent attention, the model has none"))
        if c.rope != cfg.rope:
            problems.append(
                (
                    "rope",
                    f"rope: contract {c.rope.fingerprint()}, model {cfg.rope.fingerprint()} "
                    "(keys and queries would turn differently from what the model was trained with)",
                )
            )
        elif c.layer_ropes != cfg.layer_ropes:
            bad = [i for i in range(cfg.num_layers) if c.layer_rope(i) != cfg.layer_rope(i)]
            problems.append(
                (
                    "layer_ropes",
                    f"layer_ropes: layer(s) {bad[:8]} turn with another RoPE (or none) in the "
                    "contract than in the model",
                )
            )
        if c.key_form == "raw" and cfg.qk_norm and cfg.family.block.qk_norm == "head_after_rope":
            problems.append(
                (
                    "key_form",
                    f"key_form: 'raw' has no meaning for {cfg.architecture}: its q/k norm is "
                    "applied after RoPE, so the key the kernel reads is norm(R(j) k), not a "
                    "rotation of any key a cache could hold raw; use key_form 'rotated' "
                    "(with a length-dependent RoPE, dynamic NTK without alpha, no key form can "
                    "serve it: rotated keys keep stale frequencies)",
                )
            )
        if c.model_fingerprint and c.model_fingerprint != self.checkpoint.fingerprint:
            problems.append(
                (
                    "model_fingerprint",
                    f"model_fingerprint: contract {c.model_fingerprint}, model "
                    f"{self.checkpoint.fingerprint} (keys would come from another model)",
                )
            )
        if problems:
            raise ContractMismatch(
                "the cache contract does not fit the model: " + "; ".join(p for _, p in problems),
                fields=tuple(f for f, _ in problems),
            )

    def _check_positions(self, last: int) -> None:
        if last >= self.config.position_limit:
            raise UsageError(f"position {last} is beyond the model's {self.config.position_limit} positions")

    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 1 or tokens.numel() == 0 or tokens.is_floating_point():
            raise UsageError(f"tokens must be a non-empty 1-D integer tensor, got shape {tuple(tokens.shape)}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            raise UsageError(f"token ids must be in [0, {self.config.vocab_size})")
        return tokens.to(torch.int64)

    def _step(
        self, seq_id, tokens: torch.Tensor, *, phase: Phase, probe: bool, last_logits: bool = False
    ) -> StepOutput:
        start = self.cache.last_position(seq_id) + 1
        positions = torch.arange(start, start + tokens.numel(), dtype=torch.int64)
        self._check_positions(int(positions[-1]))
        rows = list(range(tokens.numel())) if probe else None
        return self._run(
            tokens,
            positions,
            seq_id,
            phase=phase,
            probe_rows=rows,
            logits_rows=[tokens.numel() - 1] if last_logits else None,
        )

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seq_id,
        *,
        phase: Phase,
        probe_rows: list[int] | None,
        logits_rows: list[int] | None = None,
    ) -> StepOutput:
        cfg, c, rot = self.config, self.contract, self.rotation
        groups = self._step_groups(seq_id, positions, probe_rows is not None)
        step_ctx = StepContext(
            phase=phase,
            seq_len=int(positions.max()) + 1,
            fork_offset=self._fork_offset.get(seq_id, 0),
            block_size=c.block_size,
            layer_ropes=tuple(c.layer_rope(i) for i in range(c.num_layers)),
            window_layers=c.window_layers,
            ops=self.op_facts(seq_id),
            tables=self._step_tables(positions, groups.values()),
            key_scratch=None if probe_rows is not None else self._scratch(groups.values()),
        )
        h = embed(cfg, self.weights, tokens.to(self.device))  # [n, hidden]
        new_keys, new_values, traces = [], [], []
        for layer, lw in enumerate(self.weights.layers):
            rope = c.layer_rope(layer)  # None: a NoPE layer (the policy leaves its q/k unrotated)
            ctx = step_ctx.for_layer(layer)
            g = groups[c.layer_attention(layer)]
            q, k, v = project_qkv(cfg, lw, h, positions)  # [n, H, D], [n, KVH, D], [n, KVH, D]
            # copy=False: the cached keys/values are read (or joined with this step's) right below,
            # before the cache can change.
            view = self.cache.view(seq_id, layer, copy=False) if seq_id is not None else None
            # raw keys exist only where q/k norms (if any) come before RoPE (_check_contract_fits_model)
            stored_new = (
                k
                if c.key_form == "raw"
                else after_rope(cfg, lw.k_norm, rot.write_key(rope, k, positions, g.new_slots, ctx))
            )
            if g.segments:  # a decode step that sees every key: cached keys read in place, no join
                q_eff = after_rope(cfg, lw.q_norm, rot.query(rope, q, positions, ctx))
                k_cached = rot.read_keys(
                    rope, view.keys, view.positions, view.slots, ctx, backend_rotates=self.backend.rotates
                )
                k_new = rot.read_keys(
                    rope, stored_new, positions, g.new_slots, ctx, backend_rotates=self.backend.rotates
                )
                out = attend_segments(
                    q_eff,
                    (k_cached, k_new),
                    (view.values, v),
                    scale=cfg.attn_scale,
                    softcap=cfg.attn_softcap,
                    sinks=lw.sinks,
                )
            else:
                if view is not None:
                    reuse = probe_rows is None  # probes keep k_eff (the keys themselves when read as stored)
                    keys = self._joined(0, view.keys, stored_new.to(view.keys.dtype), reuse)
                    values = self._joined(1, view.values, v.to(view.values.dtype), reuse)
                else:
                    keys, values = stored_new, v
                if c.rotation_index == "cache":
                    out, q_eff, k_eff = self._attend_cache_index(q, keys, values, g.mask, g.key_slots, ctx)
                else:
                    q_eff = after_rope(cfg, lw.q_norm, rot.query(rope, q, positions, ctx))
                    k_eff = rot.read_keys(rope, keys, g.key_pos, g.key_slots, ctx, backend_rotates=self.backend.rotates)
                    out, _ = attend(
                        q_eff,
                        k_eff,
                        values,
                        g.attn_mask,
                        scale=cfg.attn_scale,
                        softcap=cfg.attn_softcap,
                        sinks=lw.sinks,
                        with_logits=False,
                    )
                if probe_rows is not None:
                    traces.append(_probe(probe_rows, h, q, q_eff, k_eff, values, g.key_pos, g.key_slots, g.mask))
            new_keys.append(stored_new)
            new_values.append(v)
            h = finish_layer(cfg, lw, h, out)
        if seq_id is not None:
            self.cache.append(seq_id, positions, new_keys, new_values, key_form=c.key_form)
        if logits_rows is not None:  # only the rows a caller reads ([R, hidden] -> [R, vocab] logits)
            h = h[torch.as_tensor(logits_rows, dtype=torch.int64)]
        return StepOutput(final_logits(cfg, self.weights, h), positions, tuple(traces))

    def _step_groups(self, seq_id, positions: torch.Tensor, probed: bool) -> dict[LayerAttention, _StepGroup]:
        """Slots, key positions and the mask of this step per attention kind (full, the window, the
        chunk), built once per step: every layer of a kind gets the same tensors (and the same cos/sin
        table). Chunked layers live in the full cache group: every key stays cached, and the mask
        hides the keys of earlier chunks (docs/contract.md)."""
        c, n = self.contract, positions.numel()
        num_before = self.cache.num_tokens(seq_id) if seq_id is not None else 0
        out: dict[LayerAttention, _StepGroup] = {}
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
            segments = view is not None and everything and not probed and c.rotation_index == "logical"
            out[kind] = _StepGroup(
                new_slots,
                key_pos,
                key_slots,
                mask,
                None if everything else mask,
                segments,
                view.positions if segments else key_pos,
            )
        return out

    def _step_tables(self, positions: torch.Tensor, groups) -> tuple[RopeTable, ...]:
        """The step's cos/sin tables: its query positions (queries and new keys), and for a rotating
        backend each group's key positions, expanded to the KV heads."""
        tables = []
        if self.backend.rotates:
            tables += [self._rope_tables.table(g.read_positions, self.config.num_kv_heads) for g in groups]
        tables.append(self._rope_tables.table(positions))
        return tuple(t for t in tables if t is not None)

    def _scratch(self, groups) -> torch.Tensor | None:
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

    def _attend_cache_index(self, q, keys, values, mask, key_slots, ctx):
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
        return torch.cat(outs), torch.cat(q_effs), k_eff


@dataclass(frozen=True, eq=False)
class _StepGroup:
    """One attention kind's share of a step (see ``Engine._step_groups``)."""

    new_slots: torch.Tensor  # [n] slots of the step's tokens
    key_pos: torch.Tensor  # [N + n] positions of every key the step's queries may read
    key_slots: torch.Tensor  # [N + n]
    mask: torch.Tensor  # [n, N + n] visibility
    attn_mask: torch.Tensor | None  # the mask, or None when it hides nothing
    segments: bool  # read the cached keys in place (attend_segments) instead of joining them
    read_positions: torch.Tensor  # positions of the keys a rotating read turns in one call


def _probe(rows: list[int], h, q, q_eff, k_eff, values, key_pos, key_slots, mask) -> LayerProbe:
    """The layer as its kernel saw it at ``rows``. One row (a decode step, or a per-position full
    forward): exactly the keys the kernel attended to, by the engine's own mask. Several rows (a probed
    full forward): every key, and the reader masks by position."""
    r = torch.as_tensor(rows)
    keep = mask[r[0]] if len(rows) == 1 else slice(None)
    return LayerProbe(
        q=q_eff[r],
        k=k_eff[keep],
        key_positions=key_pos[keep],
        key_slots=key_slots[keep],
        hidden_in=h[r].detach(),
        q_raw=q[r],
        v=values[keep],
    )
