"""pytest plugin (entry point ``pytest11: ropekv``): fixtures for checking an engine with ropekv.

- ``ropekv_default_checkpoint``: the embedded SmolLM2-135M as a :class:`~ropekv.models.config.Checkpoint`
  (converted once into ``$XDG_CACHE_HOME/ropekv``; session scope).
- ``tiny_checkpoint``: a factory, ``tiny_checkpoint(arch="llama", saved=False, **config_overrides)``,
  returning an in-memory Checkpoint, or with ``saved=True`` a directory written by transformers
  (cached per arguments for the session).
"""

from __future__ import annotations

import json
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ropekv_default_checkpoint():
    from ..models import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from .tiny import tiny_checkpoint as make

    cache: dict[str, Any] = {}

    def factory(arch: str = "llama", *, saved: bool = False, **overrides: Any):
        key = json.dumps([arch, saved, overrides], sort_keys=True, default=str)
        if key not in cache:
            where = tmp_path_factory.mktemp(f"tiny-{arch}") / "model" if saved else None
            cache[key] = make(arch, save_to=where, **overrides)
        return cache[key]

    return factory
