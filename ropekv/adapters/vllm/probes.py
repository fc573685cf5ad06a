"""Hooks on vLLM's loaded model that record, per forward pass and layer, what the attention kernel saw.

Installed for one adapter call and removed in ``finally`` (:meth:`Probes.installed`):

- a forward pre-hook on each decoder layer: the runner's ``positions`` (layer 0) and the layer's input
  ``hidden_states + residual`` (vLLM carries the residual stream in two tensors);
- a forward hook on ``self_attn.qkv_proj``: q and k before RoPE (cloned at once: vLLM's CPU rotary
  kernel rotates q and k in place, inside the qkv buffer);
- a forward pre-hook on ``self_attn.attn`` (vLLM's ``Attention`` module): q and k after RoPE, the keys
  that ``unified_kv_cache_update`` is about to write;
- a wrapper around ``vllm._custom_ops.cpu_attention_with_kv_cache``, the call into the CPU attention
  kernel: the query it receives, its block table and sequence lengths, and the keys it reads, gathered
  from the key cache it is handed through that block table and unpacked by the kernel ISA
  (:mod:`.kv_layout`). In every probed forward it also checks that the slots the forward wrote (the
  forward context's slot mapping) hold exactly the hooked keys, which tests the unpacking each time.

Key positions come from vLLM's metadata: every forward adds ``slot -> position`` for the slots its
slot mapping wrote, with the positions the model runner passed in; keys read by the kernel are
labelled by looking their slots up there (never derived from slot numbers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import AdapterError
from ...probe import LayerProbe
from . import kv_layout

ADAPTER = "vllm"


@dataclass
class LayerRecord:
    """One layer of one forward, rows restricted to the probed positions where noted."""

    hidden_in: torch.Tensor | None = None  # [R, hidden] at probed rows
    q_raw: torch.Tensor | None = None  # [R, H, D] at probed rows, before RoPE
    k_raw: torch.Tensor | None = None  # [N, KVH, D] every token of this forward, before RoPE
    q_rot: torch.Tensor | None = None  # [R, H, D] at probed rows, the Attention module's input
    k_rot: torch.Tensor | None = None  # [N, KVH, D] the Attention module's input (written to the cache)
    v: torch.Tensor | None = None  # [N, KVH, D] the Attention module's value input (written to the cache)
    q_kernel: torch.Tensor | None = None  # [R, H, D] at probed rows, as the kernel received it
    keys: torch.Tensor | None = None  # [S, KVH, D] the keys the kernel read (when asked)
    key_slots: torch.Tensor | None = None  # [S] their physical slots
    slots: torch.Tensor | None = None  # [N] where this forward wrote this layer's keys (its KV cache group's)


@dataclass
class ForwardRecord:
    positions: torch.Tensor  # [N] logical positions of this forward's tokens (the model runner's)
    rows: torch.Tensor  # [R] indices into this forward's tokens that are probed
    seq_len: int = 0  # keys the kernel attended over
    layers: dict[int, LayerRecord] = field(default_factory=dict)


def _seen(value: torch.Tensor | None) -> torch.Tensor:
    """A record the hooks fill in every forward with probed rows (their queries and hidden states, the
    keys the kernel read and their slots); None there is a bug of these hooks."""
    assert value is not None, "a probed forward's layer record is incomplete"
    return value


class Probes:
    """Records what vLLM's kernels saw while a request runs. ``probe_positions``: the positions whose
    query rows are kept (and in whose forwards the kernel's keys are read back); ``read_keys_position``
    also reads them back in the forward holding that position (the full forward's last token, whose
    forward attends over every key). ``model`` is vLLM's loaded ``*ForCausalLM`` (``Any``: its
    modules' attributes are vLLM's)."""

    def __init__(self, model: Any, num_heads: int, num_kv_heads: int, head_dim: int):
        self.model = model
        self.layers = list(model.model.layers)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.forwards: list[ForwardRecord] = []
        # Per layer: slot -> position. A model with sliding layers has several KV cache groups in vLLM
        # (their own block tables and slot mappings over one shared tensor), so slots are per layer.
        self.slot_position: dict[int, dict[int, int]] = {}
        self.windows: dict[int, int] = {}  # layer -> the sliding window vLLM handed its kernel (keys)
        self.probe_positions: set[int] = set()
        self.read_keys_position: int | None = None
        self._current: ForwardRecord | None = None
        self._layer: int | None = None

    # ------------------------------------------------------------------ lifetime

    def reset(self, probe_positions=(), *, read_keys_position: int | None = None) -> None:
        """Forget every forward and slot (a new case: vLLM's prefix cache was reset too)."""
        self.forwards, self.slot_position = [], {}
        self.probe_positions = set(int(p) for p in probe_positions)
        self.read_keys_position = read_keys_position

    @contextlib.contextmanager
    def installed(self) -> Iterator[Probes]:
        import vllm._custom_ops as ops

        handles = []
        original = ops.cpu_attention_with_kv_cache
        rotaries: list[Any] = []
        try:
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                handles.append(layer.register_forward_pre_hook(self._layer_hook(i), with_kwargs=True))
                if hasattr(attn, "k_norm"):
                    # q/k norms sit between qkv_proj and RoPE: the raw key is the rotary module's input.
                    # vLLM shares one rotary module between layers of one kind: hooked once each.
                    if not any(r is attn.rotary_emb for r in rotaries):
                        rotaries.append(attn.rotary_emb)
                        handles.append(attn.rotary_emb.register_forward_pre_hook(self._rotary_hook(), with_kwargs=True))
                else:
                    handles.append(attn.qkv_proj.register_forward_hook(self._qkv_hook(i, attn)))
                handles.append(attn.attn.register_forward_pre_hook(self._attn_hook(i), with_kwargs=True))
            ops.cpu_attention_with_kv_cache = self._kernel(original)
            yield self
        finally:
            ops.cpu_attention_with_kv_cache = original
            for h in handles:
                h.remove()
            self._current, self._layer = None, None

    # ------------------------------------------------------------------ hooks

    def _layer_hook(self, i: int):
        def hook(module, args, kwargs):
            positions = args[0] if args else kwargs["positions"]
            hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
            residual = args[2] if len(args) > 2 else kwargs.get("residual")
            if i == 0:
                positions = positions.detach().reshape(-1).to(torch.int64).clone()  # [N]
                rows = torch.tensor(
                    [r for r, p in enumerate(positions.tolist()) if p in self.probe_positions], dtype=torch.int64
                )
                self._current = ForwardRecord(positions=positions, rows=rows)
                self.forwards.append(self._current)
            fwd = self._current_forward()
            rec = fwd.layers.setdefault(i, LayerRecord())
            self._layer = i
            if fwd.rows.numel():
                stream = hidden if residual is None else hidden + residual  # [N, hidden]
                rec.hidden_in = stream[fwd.rows].detach().clone()

        return hook

    def _current_forward(self) -> ForwardRecord:
        """The forward being recorded: layer 0's pre-hook opens it before any other hook runs."""
        assert self._current is not None, "a vLLM hook ran before layer 0's pre-hook"
        return self._current

    def _qkv_hook(self, i: int, attn: Any):
        q_size, kv_size = attn.q_size, attn.kv_size

        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output  # [N, q_size + 2 kv_size]
            fwd = self._current_forward()
            rec = fwd.layers.setdefault(i, LayerRecord())
            n = out.shape[0]
            rec.k_raw = out[:, q_size : q_size + kv_size].detach().reshape(n, self.num_kv_heads, self.head_dim).clone()
            if fwd.rows.numel():
                q = out[:, :q_size].reshape(n, self.num_heads, self.head_dim)
                rec.q_raw = q[fwd.rows].detach().clone()

        return hook

    def _rotary_hook(self):
        def hook(module, args, kwargs):
            names = ("positions", "query", "key")
            got = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
            i = self._layer
            assert i is not None, "a rotary module ran outside a decoder layer"
            fwd = self._current_forward()
            rec = fwd.layers.setdefault(i, LayerRecord())
            q, k = got["query"], got["key"]
            n = q.shape[0]
            rec.k_raw = k.detach().reshape(n, self.num_kv_heads, self.head_dim).clone()
            if fwd.rows.numel():
                rec.q_raw = q.detach().reshape(n, self.num_heads, self.head_dim)[fwd.rows].clone()

        return hook

    def _attn_hook(self, i: int):
        def hook(module, args, kwargs):
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            fwd = self._current_forward()
            rec = fwd.layers.setdefault(i, LayerRecord())
            n = query.shape[0]
            rec.k_rot = key.detach().reshape(n, self.num_kv_heads, self.head_dim).clone()
            value = args[2] if len(args) > 2 else kwargs.get("value")
            if value is not None:
                rec.v = value.detach().reshape(n, self.num_kv_heads, -1).clone()
            if fwd.rows.numel():
                rec.q_rot = query.detach().reshape(n, self.num_heads, self.head_dim)[fwd.rows].clone()
            self._layer = i
            self._note_slots(module, i)

        return hook

    def _note_slots(self, module: Any, i: int) -> None:
        """Slot mapping of this forward, from vLLM's forward context; ``slot -> position`` updated."""
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
        mapping = ctx.slot_mapping
        slots = mapping.get(module.layer_name) if isinstance(mapping, dict) else mapping
        fwd = self._current_forward()
        n = fwd.positions.shape[0]
        if slots is None:
            raise AdapterError(ADAPTER, "slot mapping", "the forward context's slot mapping", "none")
        slots = slots.detach().reshape(-1)[:n].to(torch.int64).clone()  # [N]
        fwd.layers[i].slots = slots
        table = self.slot_position.setdefault(i, {})
        for s, p in zip(slots.tolist(), fwd.positions.tolist()):
            if s >= 0:
                table[s] = p

    def _kernel(self, original):
        def wrapper(
            query,
            key_cache,
            value_cache,
            output,
            query_start_loc,
            seq_lens,
            scale,
            causal,
            alibi_slopes,
            sliding_window,
            block_table,
            *args,
            **kwargs,
        ):
            fwd, i = self._current, self._layer
            if fwd is not None and i is not None:
                if int(sliding_window) > 0:
                    self.windows[i] = int(sliding_window)
                self._on_kernel(fwd, i, query, key_cache, query_start_loc, seq_lens, block_table)
            return original(
                query,
                key_cache,
                value_cache,
                output,
                query_start_loc,
                seq_lens,
                scale,
                causal,
                alibi_slopes,
                sliding_window,
                block_table,
                *args,
                **kwargs,
            )

        return wrapper

    def _on_kernel(self, fwd: ForwardRecord, i: int, query, key_cache, query_start_loc, seq_lens, block_table) -> None:
        # query: [n, H, D]; key_cache: [num_blocks, KVH, B, D] (the kernel's view); block_table: [reqs, max_blocks]
        if seq_lens.numel() != 1:
            raise AdapterError(
                ADAPTER,
                "batch",
                "one request per forward (ropekv runs requests one by one)",
                f"{seq_lens.numel()} requests",
            )
        rec = fwd.layers[i]
        layer = self.layers[i].self_attn.attn
        isa = str(layer.isa)
        block_size = key_cache.shape[2]
        fwd.seq_len = int(seq_lens[0])
        reads = fwd.rows.numel() > 0 or (
            self.read_keys_position is not None and self.read_keys_position in fwd.positions.tolist()
        )
        if not reads:
            return
        # The write: the slots this forward filled must hold exactly the keys the Attention module got.
        real_keys, _ = kv_layout.kernel_views(layer.kv_cache)
        k_rot, slots = _seen(rec.k_rot), _seen(rec.slots)  # this layer's Attention pre-hook
        n = k_rot.shape[0]
        written = slots[:n] >= 0
        stored = kv_layout.read_keys(real_keys, slots[:n][written], isa)
        if not torch.equal(stored, k_rot[written].to(stored.dtype)):
            diff = float((stored.float() - k_rot[written].float()).abs().max())
            raise AdapterError(
                ADAPTER,
                f"layer {i} kv cache",
                f"the keys read back at the slot mapping (isa {isa}) to equal the keys the Attention module wrote",
                f"max difference {diff:.3g}",
            )
        if fwd.rows.numel():
            rec.q_kernel = query.detach()[fwd.rows].clone()
        if reads:
            # The data: what the kernel read, through the block table it was handed. The labels: the
            # request's own blocks in vLLM's metadata (the same table unless something in between
            # handed the kernel other blocks), whose slots the slot -> position map knows.
            # A sliding layer reads only the last ``window`` keys of each query (vLLM hands freed blocks'
            # entries to its null block): keys from the probed row with the lowest position on.
            first = 0
            if i in self.windows and fwd.rows.numel():
                lowest = int(fwd.positions[fwd.rows].min())
                first = max(0, lowest - self.windows[i] + 1)
            read_from = kv_layout.slots_of(block_table[0], fwd.seq_len, block_size)[first:]  # [S]
            rec.keys = kv_layout.read_keys(key_cache, read_from, isa)
            rec.key_slots = kv_layout.slots_of(self._metadata(layer).block_table[0], fwd.seq_len, block_size)[first:]

    @staticmethod
    def _metadata(layer: Any) -> Any:
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        return md[layer.layer_name] if isinstance(md, dict) else md

    # ------------------------------------------------------------------ results

    def key_positions(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``[S]`` logical positions of the keys at ``slots`` of ``layer``, from what vLLM wrote there."""
        table = self.slot_position.get(layer, {})
        missing = [s for s in slots.tolist() if s not in table]
        if missing:
            raise AdapterError(
                ADAPTER,
                "key slots",
                "slots written by a request ropekv observed",
                f"{len(missing)} unknown slots, first {missing[0]}",
            )
        return torch.tensor([table[s] for s in slots.tolist()], dtype=torch.int64)

    def raw_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor | None:
        """``[S, KVH, D]`` pre-RoPE keys last written at ``slots``, or None if one was never seen."""
        table: dict[int, tuple[torch.Tensor, int]] = {}
        for fwd in self.forwards:
            rec = fwd.layers.get(layer)
            if rec is None or rec.k_raw is None or rec.slots is None:
                continue
            for r, s in enumerate(rec.slots[: rec.k_raw.shape[0]].tolist()):
                table[s] = (rec.k_raw, r)
        if any(s not in table for s in slots.tolist()):
            return None
        return torch.stack([table[s][0][table[s][1]] for s in slots.tolist()])

    def forward_at(self, position: int) -> ForwardRecord:
        """The last forward whose tokens include ``position`` as a probed row."""
        for fwd in reversed(self.forwards):
            if fwd.rows.numel() and position in fwd.positions[fwd.rows].tolist():
                return fwd
        raise AdapterError(
            ADAPTER,
            "forwards",
            f"a forward pass at position {position}",
            f"positions {[f.positions.tolist()[:1] + f.positions.tolist()[-1:] for f in self.forwards]}",
        )

    def decode_probes(self, position: int) -> tuple[LayerProbe, ...]:
        """Per layer the probe of the single-token forward at ``position`` (R = 1)."""
        fwd = self.forward_at(position)
        row = fwd.positions[fwd.rows].tolist().index(position)
        out = []
        for i in range(len(self.layers)):
            rec = fwd.layers[i]
            key_slots = _seen(rec.key_slots)
            out.append(
                LayerProbe(
                    q=_seen(rec.q_kernel)[row : row + 1],
                    k=_seen(rec.keys),
                    key_positions=self.key_positions(i, key_slots),
                    key_slots=key_slots,
                    hidden_in=_seen(rec.hidden_in)[row : row + 1],
                    q_raw=_seen(rec.q_raw)[row : row + 1],
                    k_raw=self.raw_keys(i, key_slots),
                )
            )
        return tuple(out)

    def full_probes(self, rows: list[int]) -> tuple[LayerProbe, ...]:
        """Per layer: q at ``rows`` (from whichever chunk computed them), every key as the last forward's
        kernel read it (it attends over the whole sequence)."""
        last = max((f for f in self.forwards if f.layers[0].keys is not None), key=lambda f: f.seq_len)
        out = []
        for i in range(len(self.layers)):
            qs, hs, qr = [], [], []
            for p in rows:
                fwd = self.forward_at(p)
                r = fwd.positions[fwd.rows].tolist().index(p)
                rec = fwd.layers[i]
                qs.append(_seen(rec.q_kernel)[r])
                hs.append(_seen(rec.hidden_in)[r])
                qr.append(_seen(rec.q_raw)[r])
            rec = last.layers[i]
            key_slots = _seen(rec.key_slots)
            out.append(
                LayerProbe(
                    q=torch.stack(qs),
                    k=_seen(rec.keys),
                    key_positions=self.key_positions(i, key_slots),
                    key_slots=key_slots,
                    hidden_in=torch.stack(hs),
                    q_raw=torch.stack(qr),
                    k_raw=self.raw_keys(i, key_slots),
                )
            )
        return tuple(out)
