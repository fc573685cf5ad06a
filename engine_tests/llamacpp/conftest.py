"""Shared engines and the float64 reference for the llama.cpp adapter's tests (run from .venv-llamacpp
with scripts/test-llamacpp.sh).

Loading a model takes seconds, so each engine configuration is built once per session. One token
stream serves every case: row ``t`` of one reference forward over the longest sequence is the
reference for every shorter case (causality; SmolLM2's RoPE does not depend on length).
"""

from __future__ import annotations

import pytest
import torch

from ropekv.adapters.llamacpp import LlamaCppEngine
from ropekv.models.default import default_gguf_path
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import token_stream

STREAM_LEN = 1200


@pytest.fixture(scope="session")
def f32_engine() -> LlamaCppEngine:
    """The default: the embedded model as an all-float32 GGUF, f32 KV, n_batch 512, forensics tier."""
    return LlamaCppEngine()


@pytest.fixture(scope="session")
def q4_engine() -> LlamaCppEngine:
    """The embedded Q4_1 file itself (f32 KV)."""
    return LlamaCppEngine(default_gguf_path())


@pytest.fixture(scope="session")
def tokens(f32_engine) -> torch.Tensor:
    return token_stream(f32_engine.config.vocab_size, STREAM_LEN, seed=0)


@pytest.fixture(scope="session")
def reference(f32_engine) -> ReferenceDecoder:
    """float64 reference on the f32 GGUF's weights (= the Q4_1 file's, dequantized)."""
    return ReferenceDecoder(f32_engine.checkpoint)


@pytest.fixture(scope="session")
def q4_reference(q4_engine) -> ReferenceDecoder:
    return ReferenceDecoder(q4_engine.checkpoint)
