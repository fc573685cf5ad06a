"""Attention backends: what key form they consume and how they read keys.

- ``rotated`` reads rotated keys as stored (vLLM, llama.cpp, HF transformers).
- ``rotate_on_read`` reads raw keys with their stored positions and rotates inside the backend in
  float32, the stand-in for fused kernels that rotate internally (a FlashInfer mode). Its rotation
  indices come from the stored positions (or cache order under ``rotation_index="cache"``), never from
  slot numbers.

Pairing a backend with a contract it cannot honour raises :class:`ContractMismatch` at construction.
The kernels: :func:`attend` (one sequence's queries), :func:`attend_segments` (keys read in place, in
segments) and :func:`attend_padded` (a batch of sequences over one left-padded key tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ..contract import CacheContract, KeyForm
from ..errors import ContractMismatch, UsageError

BackendName = Literal["rotated", "rotate_on_read"]
BACKENDS: tuple[str, ...] = get_args(BackendName)


@dataclass(frozen=True)
class Backend:
    """An attention backend. ``key_form`` is the form it consumes; ``rotates`` whether it turns keys."""

    name: str
    key_form: KeyForm
    rotates: bool

    def check(self, contract: CacheContract) -> None:
        if contract.key_form != self.key_form:
            what = (
                "stored keys are rotated, this backend rotates again: keys would sit at twice their position"
                if self.rotates
                else "stored keys are raw, this backend does not rotate: every key would sit at position 0"
            )
            raise ContractMismatch(
                f"backend {self.name!r} consumes {self.key_form} keys but the cache contract stores "
                f"{contract.key_form} keys: {what}",
                fields=("key_form",),
            )
        if contract.kernel_rotates != self.rotates:
            raise ContractMismatch(
                f"backend {self.name!r} {'rotates' if self.rotates else 'does not rotate'} keys but the contract says "
                f"kernel_rotates={contract.kernel_rotates}",
                fields=("kernel_rotates",),
            )


ROTATED = Backend("rotated", key_form="rotated", rotates=False)
ROTATE_ON_READ = Backend("rotate_on_read", key_form="raw", rotates=True)


def get_backend(name: str) -> Backend:
    for b in (ROTATED, ROTATE_ON_READ):
        if b.name == name:
            return b
    raise UsageError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")


def backend_for(contract: CacheContract) -> Backend:
    """The backend that honours ``contract``'s key form."""
    return ROTATE_ON_READ if contract.key_form == "raw" else ROTATED


def visibility(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    sink_tokens: int,
    chunk: int | None = None,
) -> torch.Tensor:
    """Boolean mask ``[n, N]``: key ``j`` is visible to query ``i`` iff ``j <= i`` and
    (``i - W < j`` or ``j < sink_tokens``) — HF's sliding-window semantics plus StreamingLLM sinks —
    and, on a chunked layer, ``j >= floor(i / chunk) * chunk`` (llama4: keys of the query's chunk)."""
    qp = query_positions[:, None]
    kp = key_positions[None, :]
    mask = kp <= qp
    if window is not None:
        mask &= (kp > qp - window) | (kp < sink_tokens)
    if chunk is not None:
        mask &= kp >= torch.div(qp, chunk, rounding_mode="floor") * chunk
    return mask


_BLOCK_BYTES = 32 << 20  # logits of one query block; below glibc's mmap threshold, so blocks reuse heap memory


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    with_logits: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled dot-product attention with grouped KV heads, computed in float32 or wider.

    q ``[n, H, D]`` (rotated), k ``[N, KVH, D]`` (as the kernel uses them), v ``[N, KVH, D]``,
    mask ``[n, N]``, or None when every key is visible to every query (a decode step without a
    window: it saves two passes over the logits per layer). ``scale`` defaults to ``D**-0.5``;
    ``softcap`` caps the scores as ``softcap * tanh(s / softcap)``; ``sinks [H]`` (gpt_oss) are learned
    logits, one per head, that join the softmax denominator and take no value (:func:`softmax_with_sinks`;
    the returned logits do not include them). Returns ``(out [n, H, D] in q's dtype,
    logits [H, n, N] pre-softmax, masked -inf)``; the logits are None unless ``with_logits``.

    Without logits the queries go in blocks whose ``[H, rows, N]`` scores stay under 32 MiB, and each
    block reads only the keys up to the last one any of its rows sees (a causal prefill skips the
    upper triangle): a long prefill never holds an ``[H, n, N]`` score tensor, and its temporaries
    are reused instead of mapped and faulted in afresh for every layer.
    """
    n, num_heads, _ = q.shape
    rows = n if with_logits else max(1, _BLOCK_BYTES // (num_heads * k.shape[0] * 4))
    if rows >= n:
        return _attend_block(q, k, v, mask, scale, softcap, sinks)
    out = torch.empty_like(q)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        block_mask = None if mask is None else mask[start:stop]
        kb, vb = k, v
        if block_mask is not None:
            kb, vb, block_mask = _seen_keys(k, v, block_mask)
        out[start:stop] = _attend_block(q[start:stop], kb, vb, block_mask, scale, softcap, sinks)[0]
    return out, None


def _seen_keys(
    k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys ``k, v [N, KVH, D]`` some row of ``block_mask [rows, N]`` sees, and the mask over them:
    a causal block skips the keys after its last row, a sliding or chunked one also those before its
    band (a view when the seen keys are one range; the sinks and the band gathered otherwise), so a
    sliding layer's cost grows with N x window, not N^2."""
    seen = torch.nonzero(block_mask.any(dim=0)).flatten()  # [K] ascending
    if not seen.numel():
        return k[:1], v[:1], block_mask[:, :1]
    lo, hi = int(seen[0]), int(seen[-1]) + 1
    if hi - lo == seen.numel():
        return k[lo:hi], v[lo:hi], block_mask[:, lo:hi]
    return k[seen], v[seen], block_mask[:, seen]


def attend_segments(
    q: torch.Tensor,
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attend` of queries that see every key (a decode step without a window), with the keys
    and values given as segments along the key axis (``keys[s]``/``values[s]``: ``[N_s, KVH, D]``,
    e.g. the cached tokens as views of the pool, then the step's new ones). Returns ``out [n, H, D]``.

    Why: joining the segments first copies every cached key and value once per layer and step (at
    4,096 tokens, 6 MB per layer); here each segment is read in place by its own ``bmm`` and only the
    scores (``[H, n, N]``, a few KB for one query) are joined for the softmax.
    """
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    n, num_heads, head_dim = q.shape
    num_kv = keys[0].shape[1]
    group = num_heads // num_kv
    qw = q.to(work).reshape(n, num_kv, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv, group * n, head_dim)
    scores = [torch.bmm(qw, k.to(work).permute(1, 2, 0)) for k in keys]  # [KVH, G * n, N_s] each
    logits = torch.cat(scores, dim=-1).mul_(1.0 / math.sqrt(head_dim) if scale is None else scale)  # [KVH, G*n, N]
    if softcap is not None:
        logits = torch.tanh(logits / softcap).mul_(softcap)
    probs = softmax_with_sinks(logits, None if sinks is None else _sink_column(sinks, num_kv, group, n))
    out, start = None, 0
    for v in values:
        part = torch.bmm(probs[..., start : start + v.shape[0]], v.to(work).permute(1, 0, 2))  # [KVH, G * n, D]
        out = part if out is None else out.add_(part)
        start += v.shape[0]
    assert out is not None  # at least one segment
    return out.view(num_kv, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(q.dtype)


@dataclass(frozen=True, eq=False)
class PaddedRow:
    """One row of a left-padded batch (:func:`attend_padded`): its query and every key it may read."""

    q: torch.Tensor  # [1, H, D] rotated
    keys: torch.Tensor  # [N_r, KVH, D] as the kernel uses them
    values: torch.Tensor  # [N_r, KVH, D]
    visible: torch.Tensor  # [N_r] bool: the row's own mask (window, sinks, chunk)


def attend_padded(
    rows: Sequence[PaddedRow],
    num_heads: int,
    dtype: torch.dtype,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every row over one left-padded key tensor ``[B, N_max, KVH, D]``: the padding
    (and each row's own masked keys) is -inf before the softmax. Returns ``[B, H, D]`` in ``dtype``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    B, n_max = len(rows), max(r.keys.shape[0] for r in rows)
    kvh, d = rows[0].keys.shape[1:]
    dev = rows[0].keys.device
    keys = torch.zeros(B, n_max, kvh, d, dtype=work, device=dev)
    values = torch.zeros(B, n_max, kvh, d, dtype=work, device=dev)
    visible = torch.zeros(B, n_max, dtype=torch.bool, device=dev)
    for i, row in enumerate(rows):
        pad = n_max - row.keys.shape[0]  # left padding of row i
        keys[i, pad:], values[i, pad:], visible[i, pad:] = row.keys.to(work), row.values.to(work), row.visible.to(dev)
    q = torch.cat([r.q for r in rows]).to(work)  # [B, H, D]
    kv_head = torch.arange(num_heads, device=dev) // (num_heads // kvh)  # [H]
    logits = torch.einsum("bhd,bnhd->bhn", q, keys[:, :, kv_head]) * scale  # [B, H, N_max]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    probs = softmax_with_sinks(logits, None if sinks is None else sinks.reshape(1, -1, 1))  # sinks [H] -> [1, H, 1]
    out = torch.einsum("bhn,bnhd->bhd", probs, values[:, :, kv_head])
    return out.to(dtype)


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``logits [..., N]``; with ``sinks [..., 1]`` (broadcast to the rows)
    the sink is one more column of the softmax, dropped after it: the weights on the keys sum to
    ``1 - p_sink`` (gpt_oss's ``eager_attention_forward``). Masked ``-inf`` keys stay at 0."""
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    column = sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]


def _sink_column(sinks: torch.Tensor, num_kv: int, group: int, n: int) -> torch.Tensor:
    """``sinks [H]`` as a ``[KVH, G * n, 1]`` column matching logits laid out ``[KVH, G * n, N]``
    (query head ``h = kv * G + g``, as :func:`attend` stacks them)."""
    return sinks.reshape(num_kv, group, 1, 1).expand(num_kv, group, n, 1).reshape(num_kv, group * n, 1)


def _attend_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` of one block of queries, logits included."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    n, num_heads, head_dim = q.shape
    num_keys, num_kv = k.shape[0], k.shape[1]
    group = num_heads // num_kv
    # One bmm per KV head with the G query heads of its group stacked as rows ([KVH, G * n, D]):
    # K and V are read in place through strided views. Broadcasting [KVH, G, n, D] @ [KVH, 1, D, N]
    # made torch.matmul expand K and V G times and copy them, which dominated long-context decode.
    qw = q.to(work).reshape(n, num_kv, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv, group * n, head_dim)
    kw = k.to(work).permute(1, 2, 0)  # [KVH, D, N]
    factor = 1.0 / math.sqrt(head_dim) if scale is None else scale
    logits = torch.bmm(qw, kw).mul_(factor).view(num_kv, group, n, num_keys)  # [KVH, G, n, N]
    if softcap is not None:
        logits = torch.tanh(logits / softcap).mul_(softcap)
    if mask is not None:
        logits.masked_fill_(~mask, float("-inf"))
    column = None if sinks is None else sinks.reshape(num_kv, group, 1, 1)  # [KVH, G, 1, 1]: head kv * G + g
    probs = softmax_with_sinks(logits, column).view(num_kv, group * n, num_keys)
    out = torch.bmm(probs, v.to(work).permute(1, 0, 2)).view(num_kv, group, n, head_dim)  # [KVH, G, n, D]
    out = out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    return out.to(q.dtype), logits.reshape(num_heads, n, -1)
