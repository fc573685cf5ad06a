"""chunk_mismatch: a chunked-attention layer read keys of earlier chunks, or missed its own chunk's.

llama4's chunked layers let a query at ``p`` see the keys at ``[floor(p / C) C, p]`` only. An engine
that treats them as full layers reads the earlier chunks; a chunked cache trimmed by its buffer size
drops keys of the current chunk (mlx-lm 0.31.3). The evidence counts both, and where the query's
chunk starts.
"""

from __future__ import annotations

import torch

from ..contract import CacheContract
from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.explain.cells import Cells, share
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from .window_mismatch import mask_evidence

KIND = BugClass.CHUNK_MISMATCH


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    if km is None or f.chunk_size is None:
        return None
    if not bool((~km.visible).any()) and km.missed.numel() == 0:
        return None
    c = f.chunk_size
    start = km.query_position // c * c
    text, n = mask_evidence(km, f"of earlier chunks (chunk size {c}: the query's chunk starts at {start})")
    cells = Cells(torch.zeros_like(km.keys.fit, dtype=torch.bool), torch.zeros(km.query.heads, dtype=torch.bool), n)
    details = {"chunk_size": c, "extra_keys": int((~km.visible).sum()), "missed_keys": int(km.missed.numel())}
    return Match(KIND, share(km, cells), text, "all", details)


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


def _has_chunks(cfg) -> bool:
    return any(a.kind == "chunked" for a in cfg.layer_attentions)


def _forget_chunks(contract: CacheContract) -> CacheContract:
    """Chunked layers read as full ones: every cached key, earlier chunks included, reaches the kernel."""
    return contract.replace(chunk_size=None, chunk_layers=())


FAULTS = (
    NativeFault(
        name="chunked-layers-read-earlier-chunks",
        kind=KIND,
        description="chunked layers attend to the keys of earlier chunks (read as full attention)",
        key_form="rotated",
        shows_when="a query past the first chunk boundary",
        rotation=RotationPolicy,
        needs="chunked attention (llama4)",
        applies=_has_chunks,
        contract_change=_forget_chunks,
    ),
)
