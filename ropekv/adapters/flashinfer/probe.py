"""Seeing the keys as FlashInfer's decode kernel used them, from the outside.

With ``pos_encoding_mode="ROPE_LLAMA"`` the kernel rotates cached keys in registers; nothing it
multiplied is written anywhere. What it returns is the output and the log-sum-exp of the scores. So
the driver asks it about one key at a time:

- for key ``j`` of a request of ``n`` entries, a probe request of the same length whose pages are
  zero except entry ``j``, which holds the stored key's bits. A zero key scores exactly 0 however it is
  rotated, so the kernel's base-2 log-sum-exp is ``log2(n - 1 + exp(s))`` with ``s`` the score of
  key ``j`` alone, and ``s = ln(2 ** lse2 - (n - 1))``;
- the query of each probe request is ``+-alpha`` times one basis vector per query head (the query
  heads of one KV head take consecutive channels), so ``s / alpha`` is one channel of the key as the
  kernel multiplied it, seen from the query's position. ``alpha`` is a power of two (exact in float16
  and bfloat16) that keeps ``|s| <= 16``; of the two signs, the one with the larger score is read
  (its ``exp(s) >= 1`` stands well above the ``n - 1`` of the zero keys).

The kernel rotates the query too (by ``n - 1``), and scores depend only on the difference of the two
phases: what comes back is ``R(-(n - 1)) R_kernel(j) k_j``, the key relative to the query. A replay
places it at the query's logical position (:mod:`~ropekv.adapters.flashinfer.replay`). A query heads
whose channel is past ``head_dim`` gets a zero query and must read ``log2(n)`` exactly: the
calibration :func:`recover_keys` reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import UsageError
from .pages import PageTable

TARGET_SCORE = 16.0  # the largest |score| a probe aims at: exp(16) is far inside float32's range
SIGNS = (1.0, -1.0)


@dataclass(frozen=True, eq=False)
class KeyProbe:
    """The probe requests for the ``n`` keys of one request: ``(j, sign, block)`` in that order."""

    k_pages: torch.Tensor  # [1 + n, page_size, KVH, D]: page 0 all zero; page 1 + j holds key j alone
    v_pages: torch.Tensor  # [1 + n, page_size, KVH, D] zeros (the probe reads the log-sum-exp only)
    table: PageTable
    q: torch.Tensor  # [n * 2 * blocks, H, D]
    alpha: float
    n: int  # keys probed
    length: int  # entries of each probe request (its query sits at index length - 1)


def blocks(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Probe requests per key and sign: the query heads of one KV head read ``num_heads / num_kv_heads``
    channels per request."""
    return -(-head_dim // (num_heads // num_kv_heads))


def probe_alpha(stored: torch.Tensor) -> float:
    """The power of two that keeps every probe score at most :data:`TARGET_SCORE` in size: a rotation
    moves a channel's value within its rotate-half pair, so the bound is the largest pair norm."""
    x = stored.float()
    half = x.shape[-1] // 2
    norm = float(torch.sqrt(x[..., :half] ** 2 + x[..., half:] ** 2).max())
    if not math.isfinite(norm):
        raise UsageError("probe: the stored keys are not finite")
    if norm == 0.0:
        return 1.0
    return float(2.0 ** max(-14, min(14, math.floor(math.log2(TARGET_SCORE / norm)))))


def key_probe(
    stored: torch.Tensor,
    page_size: int,
    num_heads: int,
    alpha: float,
    at: list[int] | None = None,
    length: int | None = None,
) -> KeyProbe:
    """The probe of ``stored [n, KVH, D]``: by default a request's keys in sequence order, as its pages
    hold them; with ``at``, key ``i`` stands at index ``at[i]`` of a request of ``length`` entries."""
    n, kvh, d = stored.shape
    index = list(range(n)) if at is None else [int(x) for x in at]
    length = n if length is None else length
    if len(index) != n or min(index) < 0 or max(index) >= length:
        raise UsageError(f"key_probe: {n} keys at {index[:4]}... do not fit a request of {length} entries")
    group = num_heads // kvh
    nb = blocks(num_heads, kvh, d)
    num_pages = -(-length // page_size)
    k_pages = torch.zeros(1 + n, page_size, kvh, d, dtype=stored.dtype, device=stored.device)
    slot = torch.tensor([j % page_size for j in index], device=stored.device)
    k_pages[1 + torch.arange(n, device=stored.device), slot] = stored
    page_lists = []
    for key, j in enumerate(index):
        pages = [0] * num_pages
        pages[j // page_size] = 1 + key
        page_lists.extend([pages] * (len(SIGNS) * nb))
    table = PageTable.of(page_lists, [length] * len(page_lists), page_size, device=str(stored.device))
    q = torch.zeros(n, len(SIGNS), nb, num_heads, d, dtype=stored.dtype, device=stored.device)
    for h in range(num_heads):
        m = h % group
        for b in range(nb):
            c = b * group + m
            if c < d:
                for si, sign in enumerate(SIGNS):
                    q[:, si, b, h, c] = sign * alpha
    return KeyProbe(k_pages, torch.zeros_like(k_pages), table, q.reshape(-1, num_heads, d), alpha, n, length)


@dataclass(frozen=True, eq=False)
class RecoveredKeys:
    keys: torch.Tensor  # [n, KVH, D] float64: each key as the kernel multiplied it, relative to the query
    calibration: float  # max |lse2 - log2(n)| over the zero-query heads (0 up to float32 rounding)
    sign_gap: float  # max |s(+) + s(-)| where both signs resolve (|s| < 4): 0 up to rounding


def recover_keys(
    lse2: torch.Tensor, alpha: float, n: int, num_kv_heads: int, head_dim: int, length: int | None = None
) -> RecoveredKeys:
    """The ``n`` keys behind a :func:`key_probe`'s base-2 log-sum-exps ``lse2 [n * 2 * blocks, H]``, its
    requests ``length`` entries long (default ``n``)."""
    length = n if length is None else length
    num_heads = lse2.shape[-1]
    group = num_heads // num_kv_heads
    nb = blocks(num_heads, num_kv_heads, head_dim)
    if lse2.shape != (n * len(SIGNS) * nb, num_heads):
        raise UsageError(
            f"recover_keys: lse2 of shape {list(lse2.shape)} does not fit {n} keys x 2 signs x {nb} blocks"
        )
    ln = lse2.double().reshape(n, len(SIGNS), nb, num_heads) * math.log(2.0)
    excess = torch.exp(ln) - (length - 1)  # exp(s) of the probed key
    s = torch.where(excess > 0, torch.log(excess.clamp_min(1e-300)), torch.full_like(excess, -math.inf))
    s_pos, s_neg = s[:, 0], s[:, 1]
    x = torch.where(s_pos >= s_neg, s_pos, -s_neg) / alpha  # [n, nb, H]
    keys = torch.zeros(n, num_kv_heads, head_dim, dtype=torch.float64)
    zero_q = []
    for h in range(num_heads):
        g, m = divmod(h, group)
        for b in range(nb):
            c = b * group + m
            if c < head_dim:
                keys[:, g, c] = x[:, b, h]
            else:
                zero_q.append(lse2[:, h].reshape(n, len(SIGNS), nb)[:, :, b])
    calibration = 0.0
    if zero_q:
        calibration = float((torch.cat([z.reshape(-1) for z in zero_q]).double() - math.log2(length)).abs().max())
    both = (s_pos.abs() < 4) & (s_neg.abs() < 4)
    sign_gap = float((s_pos + s_neg)[both].abs().max()) if bool(both.any()) else 0.0
    return RecoveredKeys(keys, calibration, sign_gap)
