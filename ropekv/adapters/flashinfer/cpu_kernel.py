"""A CPU stand-in for FlashInfer's paged append and decode, with the conventions of
:mod:`~ropekv.adapters.flashinfer.kernel`: the query rotated by ``kv_len - 1``, the key at index ``i``
of the request's sequence by ``i`` (rotate-half pairing, float32 angles), a base-2 log-sum-exp and
an output in the query's dtype.

It lets the tests drive the whole GPU driver (packing, probes, recording) on CPU and check the replay,
the comparison and the naming against ropekv's float64 reference without a GPU. It is written from
FlashInfer's source, not from ropekv's RoPE code, so that a disagreement between the two shows.
"""

from __future__ import annotations

import math

import torch

from ...errors import UsageError
from .pages import PageTable


class CpuPagedKernel:
    """:class:`~ropekv.adapters.flashinfer.kernel.PagedKernel` in plain torch, float32 arithmetic."""

    name = "CPU stand-in for FlashInfer's paged decode"
    version = "cpu"

    def append(
        self,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        table: PageTable,
        batch: torch.Tensor,
        index: torch.Tensor,
    ) -> None:
        ps = table.page_size
        if bool((index >= table.kv_lens()[batch.long()]).any()):
            raise UsageError("append: an entry past its request's length (the table describes the cache after it)")
        page = table.indices[(table.indptr[batch.long()] + index // ps).long()].long()
        slot = page * ps + index.long() % ps
        k_pages.view(-1, *k_pages.shape[2:])[slot] = k.to(k_pages.dtype)
        v_pages.view(-1, *v_pages.shape[2:])[slot] = v.to(v_pages.dtype)

    def decode(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        table: PageTable,
        *,
        rotate: bool,
        sm_scale: float,
        rope_theta: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, D = q.shape
        kvh = k_pages.shape[2]
        if table.batch_size != B or H % kvh:
            raise UsageError(f"decode: q {list(q.shape)} does not fit {table.batch_size} requests of {kvh} KV heads")
        ps = table.page_size
        lens = table.kv_lens()  # [B]
        n = int(lens.max())
        i = torch.arange(n)
        valid = i[None, :] < lens[:, None]  # [B, n]
        where = (table.indptr[:-1, None].long() + i[None, :] // ps).clamp(max=table.indices.numel() - 1)
        slots = table.indices[where].long() * ps + i[None, :] % ps  # [B, n]
        keys = k_pages.reshape(-1, kvh, D)[slots].float()  # [B, n, KVH, D]
        values = v_pages.reshape(-1, kvh, D)[slots].float()
        query = q.float()  # [B, H, D]
        if rotate:
            freq = _frequencies(D, rope_theta)
            keys = _rotate(keys, i.float()[None, :, None], freq)
            query = _rotate(query, (lens - 1).float()[:, None], freq)
        group = H // kvh
        keys = keys.repeat_interleave(group, dim=2)  # [B, n, H, D]
        values = values.repeat_interleave(group, dim=2)
        scores = torch.einsum("bhd,bnhd->bhn", query, keys) * sm_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        lse2 = torch.logsumexp(scores, dim=-1) / math.log(2.0)
        out = torch.einsum("bhn,bnhd->bhd", torch.softmax(scores, dim=-1), values)
        return out.to(q.dtype), lse2.float()


def _frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """``[D]`` float32: channel ``c``'s frequency ``theta ** (-2 (c mod D/2) / D)``, as the kernel computes it."""
    m = torch.arange(head_dim) % (head_dim // 2)
    return torch.pow(torch.tensor(1.0 / theta, dtype=torch.float32), (2 * m).float() / head_dim)


def _rotate(x: torch.Tensor, offset: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [..., D]`` by ``offset`` (broadcast against ``x[..., 0]``), in float32."""
    angle = offset[..., None] * freq  # [..., D]
    half = x.shape[-1] // 2
    partner = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cos(angle) + partner * torch.sin(angle)
