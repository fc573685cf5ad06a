"""Shared fixtures for the mlx-lm adapter tests (run from .venv-mlx: scripts/test-mlx.sh).

One MLXEngine on the embedded SmolLM2-135M for the whole session (loading takes seconds, MLX on CPU is
slow: cases stay short). Every expected value comes from ropekv's float64 ReferenceDecoder or from
mlx-lm's own uncached forward, never from the adapter under test.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ropekv.adapters.mlx.runtime import import_mlx

# Before any test module imports mlx.core: OpenBLAS must be in the process first (runtime.py).
RUNTIME = import_mlx("openblas")

from ropekv.adapters.mlx import MLXEngine  # noqa: E402
from ropekv.models.reference import ReferenceDecoder  # noqa: E402
from ropekv.parity.cases import Case, token_stream  # noqa: E402
from ropekv.parity.compare import scaled_error, tolerance_for  # noqa: E402
from ropekv.parity.protocol import CaseRun  # noqa: E402
from ropekv.parity.recorder import attention_logits  # noqa: E402


@pytest.fixture(scope="session")
def engine() -> MLXEngine:
    return MLXEngine(None)


@pytest.fixture(scope="session")
def reference(engine) -> ReferenceDecoder:
    return ReferenceDecoder(engine.checkpoint)


@pytest.fixture(scope="session")
def tokens(engine) -> torch.Tensor:
    return token_stream(engine.config.vocab_size, 256)


@pytest.fixture(scope="session")
def tol(engine):
    return tolerance_for(engine.dtype)


@dataclass(frozen=True)
class Errors:
    logits: float  # worst scale-aware final-logit error over the decode steps
    attn: tuple[float, ...]  # per layer, worst over the steps
    max_abs_logit: float

    @property
    def first_bad_layer(self) -> int | None:
        return next((i for i, e in enumerate(self.attn) if e > 2e-3), None)


def against_reference(
    reference: ReferenceDecoder,
    run: CaseRun,
    case: Case,
    tokens: torch.Tensor,
    window: int | None | str = "case",
    sink_tokens: int | None = None,
) -> Errors:
    """The cached run's decode steps against the float64 reference with the case's window (or another)."""
    w = case.window if window == "case" else window
    s = case.sink_tokens if sink_tokens is None else sink_tokens
    rows = case.decode_positions
    out = reference.forward(tokens[: case.total], probe_rows=rows, window=w, sink_tokens=s)
    scale = reference.config.head_dim**-0.5
    attn = [0.0] * reference.config.num_layers
    logits = mabs = 0.0
    for si, (step, row) in enumerate(zip(run.steps, rows)):
        assert step.position == row
        logits = max(logits, scaled_error(step.logits, out.logits[row]))
        mabs = max(mabs, float((step.logits.double() - out.logits[row]).abs().max()))
        for li, probe in enumerate(step.layers):
            mine = attention_logits(probe, torch.tensor([row]), scale=scale, mask_by_position=False)[:, 0]  # [H, N]
            ref_probe = out.layers[li]
            ref = attention_logits(ref_probe, torch.tensor(rows), scale=scale, window=w, sink_tokens=s)[:, si]  # [H, T]
            visible = torch.isfinite(ref[0])
            if int(probe.key_positions.max()) >= ref.shape[1]:  # keys the uninterrupted run never had
                attn[li] = float("inf")
                continue
            got = torch.full_like(ref, float("-inf"))
            got[:, probe.key_positions] = mine
            # a key the kernel read that the reference masks (or the reverse) is an error of its own
            attn[li] = max(
                attn[li], scaled_error(got, ref) if torch.equal(torch.isfinite(got[0]), visible) else float("inf")
            )
    return Errors(logits=logits, attn=tuple(attn), max_abs_logit=mabs)
