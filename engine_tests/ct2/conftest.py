"""Shared fixtures for the CTranslate2 adapter tests (run from .venv-ct2: scripts/test-ct2.sh).

One CT2Engine on the embedded SmolLM2-135M for the session (its conversion is made once into the user
cache, ~22 s). Expected values come from ropekv's float64 reference, never from the adapter under test.
"""

from __future__ import annotations

import pytest

from ropekv.adapters.ct2 import CT2Engine


@pytest.fixture(scope="session")
def engine() -> CT2Engine:
    return CT2Engine(None)
