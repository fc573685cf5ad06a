"""Batched decode of sequences of different lengths: one step, a left-padded batch, per-row positions.

Sequences are prefilled alone (each at its own positions ``0..n_r - 1``), then decoded together: the
step's hidden states are one ``[B, hidden]`` tensor, and attention runs over one left-padded key
tensor ``[B, N_max, KVH, D]`` whose padding is masked out. Every row's query and new key turn at that
row's own next position (its last cached position + 1), never at a shared cursor: a shared cursor
puts the shorter rows' queries off by their padding (maclocal-api #92). The cache is written after
the whole step, row by row, and a row that cannot be written takes the rows before it back out.
"""

from __future__ import annotations

import torch

from ..errors import CacheError, UsageError
from ..probe import LayerProbe
from .attention import softmax_with_sinks, visibility
from .rotation import StepContext
from .transformer import after_rope, embed, final_logits, finish_layer, project_qkv


def decode_batch(engine, seq_ids: list, tokens: torch.Tensor, *, probe: bool = False) -> list:
    """Decode ``tokens [B]`` (row ``r`` continues ``seq_ids[r]``); returns one ``StepOutput`` per row."""
    from .engine import StepOutput

    cfg, c, rot, cache = engine.config, engine.contract, engine.rotation, engine.cache
    seq_ids = list(seq_ids)
    tokens = engine._check_tokens(torch.as_tensor(tokens).reshape(-1))
    B = len(seq_ids)
    if B == 0 or tokens.numel() != B:
        raise UsageError(f"decode_batch: {B} sequence(s) and {tokens.numel()} token(s); give one token per sequence")
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
    for p in positions.tolist():
        engine._check_positions(p)
    for sid in seq_ids:
        cache.check_room(sid, 1)
    cursor = int(positions.max())
    ctxs = [
        StepContext(
            phase="decode",
            seq_len=int(p) + 1,
            fork_offset=engine._fork_offset.get(s, 0),
            block_size=c.block_size,
            layer_ropes=tuple(c.layer_rope(i) for i in range(c.num_layers)),
            window_layers=c.window_layers,
            ops=_with_padding(engine.op_facts(s), cursor - int(p)),
        )
        for s, p in zip(seq_ids, positions.tolist())
    ]
    num_before = [cache.num_tokens(s) for s in seq_ids]
    h = embed(cfg, engine.weights, tokens.to(engine.device))  # [B, hidden]
    new_keys = [[] for _ in range(B)]
    new_values = [[] for _ in range(B)]
    traces = [[] for _ in range(B)]
    for layer, lw in enumerate(engine.weights.layers):
        kind = c.layer_attention(layer)  # full, sliding (window) or chunked
        rope = c.layer_rope(layer)  # None: a NoPE layer (the policy leaves its q/k unrotated)
        q, k, v = project_qkv(cfg, lw, h, positions)  # [B, H, D], [B, KVH, D], [B, KVH, D]
        rows = []
        for r, sid in enumerate(seq_ids):
            pos, ctx = positions[r : r + 1], ctxs[r].for_layer(layer)
            view = cache.view(sid, layer)
            new_slot = cache.slots_of(layer, num_before[r], 1)
            stored = (
                k[r : r + 1]
                if c.key_form == "raw"
                else after_rope(cfg, lw.k_norm, rot.write_key(rope, k[r : r + 1], pos, new_slot, ctx))
            )
            keys = torch.cat([view.keys, stored.to(view.keys.dtype)])  # [N_r, KVH, D]
            values = torch.cat([view.values, v[r : r + 1].to(view.values.dtype)])
            key_pos = torch.cat([view.positions, pos.to(view.positions.device)])  # [N_r]
            key_slots = torch.cat([view.slots, new_slot.to(view.slots.device)])
            k_eff = rot.read_keys(rope, keys, key_pos, key_slots, ctx, backend_rotates=engine.backend.rotates)
            q_eff = after_rope(cfg, lw.q_norm, rot.query(rope, q[r : r + 1], pos, ctx))  # [1, H, D]
            mask = visibility(pos, key_pos, kind.window, c.sink_tokens, kind.chunk)[0]  # [N_r]
            rows.append((q_eff, k_eff, values, key_pos, key_slots, mask))
            new_keys[r].append(stored)
            new_values[r].append(v[r : r + 1])
            if probe:
                traces[r].append(
                    LayerProbe(
                        q=q_eff,
                        k=k_eff[mask],
                        key_positions=key_pos[mask],
                        key_slots=key_slots[mask],
                        hidden_in=h[r : r + 1].detach(),
                        q_raw=q[r : r + 1],
                        v=values[mask],
                    )
                )
        out = _padded_attention(rows, cfg.num_heads, q.dtype, cfg.attn_scale, cfg.attn_softcap, lw.sinks)  # [B, H, D]
        h = finish_layer(cfg, lw, h, out)
    logits = final_logits(cfg, engine.weights, h)  # [B, vocab]
    written = []
    try:
        for r, sid in enumerate(seq_ids):
            cache.append(sid, positions[r : r + 1], new_keys[r], new_values[r], key_form=c.key_form)
            written.append(sid)
    except BaseException:
        for sid in written:
            cache.rollback(sid, 1)
        raise
    return [StepOutput(logits[r : r + 1], positions[r : r + 1], tuple(traces[r])) for r in range(B)]


def _padded_attention(
    rows: list,
    num_heads: int,
    dtype: torch.dtype,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every row over one left-padded key tensor ``[B, N_max, KVH, D]``.

    ``rows[r] = (q_eff [1, H, D], k_eff [N_r, KVH, D], values [N_r, KVH, D], _, _, mask [N_r])``; the
    padding (and each row's own masked keys) is -inf before the softmax. Returns ``[B, H, D]`` in ``dtype``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    B, n_max = len(rows), max(r[1].shape[0] for r in rows)
    kvh, d = rows[0][1].shape[1:]
    dev = rows[0][1].device
    keys = torch.zeros(B, n_max, kvh, d, dtype=work, device=dev)
    values = torch.zeros(B, n_max, kvh, d, dtype=work, device=dev)
    visible = torch.zeros(B, n_max, dtype=torch.bool, device=dev)
    for r, (_, k_eff, v, _, _, mask) in enumerate(rows):
        pad = n_max - k_eff.shape[0]  # left padding of row r
        keys[r, pad:], values[r, pad:], visible[r, pad:] = k_eff.to(work), v.to(work), mask.to(dev)
    q = torch.cat([r[0] for r in rows]).to(work)  # [B, H, D]
    kv_head = torch.arange(num_heads, device=dev) // (num_heads // kvh)  # [H]
    logits = torch.einsum("bhd,bnhd->bhn", q, keys[:, :, kv_head]) * scale  # [B, H, N_max]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    probs = softmax_with_sinks(logits, None if sinks is None else sinks.reshape(1, -1, 1))  # sinks [H] -> [1, H, 1]
    out = torch.einsum("bhn,bnhd->bhd", probs, values[:, :, kv_head])
    return out.to(dtype)


def _with_padding(facts, padding: int):
    import dataclasses

    return dataclasses.replace(facts, padding=padding)
