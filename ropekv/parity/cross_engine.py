"""Cross-engine parity: an engine's cache-free forward against ropekv's float64 reference.

No cache is involved, so this isolates the model code (RoPE tables, norms, GQA) from the cache path
that ``ropekv.check`` judges. Errors are scale-aware (:func:`ropekv.parity.compare.scaled_error`);
attention logits on both sides come from the probes through the shared recorder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..models.reference import ReferenceDecoder
from .cases import Case, token_stream
from .compare import LogitsOf, NextToken, logits_error, scaled_error, tolerance_for
from .protocol import EngineAdapter, Tier
from .validate import check_adapter, check_full_run


@dataclass(frozen=True)
class CrossEngineParity:
    length: int
    attn: tuple[float, ...]  # per layer, worst row (empty at the logits tier)
    hidden: tuple[float, ...]  # per layer input, worst row
    logits: float
    tolerance: dict[str, float]
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "attn_logits": list(self.attn),
            "hidden_in": list(self.hidden),
            "final_logits": self.logits,
            "tolerance": self.tolerance,
            "passed": self.passed,
        }


def cross_engine_parity(
    engine: EngineAdapter, *, length: int = 64, seed: int = 0, reference_dtype: torch.dtype = torch.float64
) -> CrossEngineParity:
    """Compare ``engine.full_forward`` over ``length`` seeded tokens, every row, with the reference
    decoder built from ``engine.checkpoint`` (the engine's own config and weights)."""
    tier = check_adapter(engine)
    cfg = engine.checkpoint.config
    tokens = token_stream(cfg.vocab_size, length, seed)
    rows = list(range(length))
    case = Case(length=1)
    full = check_full_run(engine, tier, cfg, case, rows, length, engine.full_forward(tokens, rows, case))
    ref = ReferenceDecoder(engine.checkpoint, dtype=reference_dtype).forward(tokens, probe_rows=rows)
    of = LogitsOf(cfg, None, 0)
    r = torch.as_tensor(rows)
    attn, hidden = [], []
    if tier >= Tier.ATTENTION:
        for layer, (mine, theirs) in enumerate(zip(full.layers, ref.layers)):
            attn.append(scaled_error(of.rows(layer, mine, r), of.rows(layer, theirs, r)))
            if mine.hidden_in is not None and theirs.hidden_in is not None:  # the reference always has it
                hidden.append(scaled_error(mine.hidden_in, theirs.hidden_in))
    logits = max(
        logits_error(
            NextToken(full.logits[i], None if full.token_ids is None else full.token_ids[i]), NextToken(ref.logits[i])
        )[0]
        for i in rows
    )
    tol = tolerance_for(engine.dtype, reference_dtype)
    passed = max(attn, default=0.0) <= tol.attn and max(hidden, default=0.0) <= tol.hidden and logits <= tol.logits
    return CrossEngineParity(length, tuple(attn), tuple(hidden), logits, tol.to_dict(), passed)
