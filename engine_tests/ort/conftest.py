"""Shared fixtures for the ONNX Runtime GenAI adapter tests (run from .venv-ort: scripts/test-ort.sh).

One OrtEngine per embedded model for the whole session (the graph is built once per model into the
user cache: ~12 s for SmolLM2, ~30 s for Gemma 3). Every expected value comes from ropekv's float64
ReferenceDecoder or from the engine's own uncached forward, never from the adapter under test.
"""

from __future__ import annotations

import pytest

from ropekv.adapters.ort import OrtEngine
from ropekv.parity.cases import Case
from ropekv.parity.reference_cache import ReferenceStore


@pytest.fixture(scope="session")
def engine() -> OrtEngine:
    return OrtEngine(None)


@pytest.fixture(scope="session")
def gemma() -> OrtEngine:
    return OrtEngine("gemma3-270m")


@pytest.fixture(scope="session")
def gemma_store(tmp_path_factory) -> ReferenceStore:
    """One float64 reference of Gemma 3's 520-token case for every Gemma test of the session (the
    reference, not the engine, is most of such a check's time)."""
    return ReferenceStore(tmp_path_factory.mktemp("gemma-reference"))


GEMMA_CASE = Case(length=520, decode_steps=1)  # 8 keys past the 512-key window at the decode
