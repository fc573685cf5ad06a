"""Forensics of a block seam: the keys that fit no rotation are the seam block's first recomputed rows.

A prefix hit at ``P`` not a multiple of the block size ``B`` leaves one block (``P // B``, positions
``P // B * B .. P // B * B + B - 1``) holding stored rows below ``P`` and recomputed rows from ``P``
on. Where the keys that are no rotation of their own token's key (the misfits) are exactly a run
starting at ``P`` inside that block, and every other key and the query sit at their positions, the
seam block mixed contents: its first recomputed rows hold something else (another request's rows, a
stored block restored over the recomputed ones). Named :attr:`~ropekv.parity.bug_class.BugClass.BLOCK_SEAM`.
"""

from __future__ import annotations

import torch

from .bug_class import BugClass
from .finding import Finding


def seam(
    t: int,
    query_effective: int,
    query_fit: float,
    key_positions: torch.Tensor,
    key_effective: torch.Tensor,
    key_fit: torch.Tensor,
    fork_offset: int,
    block_size: int,
    *,
    fit_ok: float,
) -> Finding | None:
    """Keys at ``key_positions [N]`` with their best effective positions and fits ``[N]``; the hit at
    ``fork_offset``; ``block_size``. A seam finding, or None."""
    P, B = fork_offset, block_size
    if P <= 0 or B <= 1 or P % B == 0 or query_fit < fit_ok or query_effective != t:
        return None
    j, ok = key_positions.long(), key_fit >= fit_ok
    bad = ~ok
    if not bool(bad.any()) or not bool((key_effective[ok] == j[ok]).all()):
        return None
    start = P // B * B
    end = start + B  # the seam block holds positions start..end-1
    wrong = sorted(j[bad].tolist())
    if wrong != list(range(P, P + len(wrong))) or wrong[-1] >= end:
        return None
    last = min(end - 1, int(j.max()))
    stored = f"{start}..{P - 1}" if start < P - 1 else f"{start}"
    recomputed = f"{P}..{last}" if last > P else f"{P}"
    keys = f"{wrong[0]}..{wrong[-1]}" if len(wrong) > 1 else f"{wrong[0]}"
    text = (
        f"block {P // B} (positions {start}..{end - 1}) mixes the stored prefix ({stored}) and recomputed "
        f"rows ({recomputed}): key(s) {keys} are wrong (no rotation of their own tokens' keys at any "
        f"position, fit {float(key_fit[bad].max()):.2f} at best; every other key and the query sit at their "
        "positions): the seam block's first recomputed rows hold other contents (stored rows kept over them)"
    )
    return Finding(
        BugClass.BLOCK_SEAM,
        text,
        show=bad,
        key_effective=key_effective,
        key_fit=key_fit,
        query_effective=query_effective,
        query_fit=query_fit,
        details=(("seam_block", P // B), ("seam_wrong_keys", len(wrong))),
    )
