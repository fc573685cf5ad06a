"""pytest plugin (entry point ``pytest11: ropekv``): fixtures for checking an engine with ropekv.

- ``ropekv_default_checkpoint``: the embedded SmolLM2-135M as a :class:`~ropekv.models.config.Checkpoint`
  (converted once into ``$XDG_CACHE_HOME/ropekv``; session scope).
- ``ropekv_default_model_dir``: the folder of the default model's files (config.json, model.safetensors,
  tokenizer.json, tokenizer_config.json), for an engine with its own loader: no weight is read
  (:func:`ropekv.models.resolve_model_dir`; session scope).
- ``tiny_checkpoint``: :func:`ropekv.testing.tiny.tiny_checkpoint` itself, same signature
  ``tiny_checkpoint(arch="llama", *, save_to=None, **config_overrides)``: an in-memory Checkpoint (cached
  per arguments for the session), or with ``save_to`` a directory written there by transformers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ropekv_default_checkpoint():
    from ..models import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture(scope="session")
def ropekv_default_model_dir() -> Path:
    from ..models import resolve_model_dir

    return resolve_model_dir(None)


def cached_tiny_checkpoint() -> Callable[..., Any]:
    """:func:`ropekv.testing.tiny.tiny_checkpoint`, its in-memory results cached per arguments."""
    from .tiny import tiny_checkpoint as make

    cache: dict[str, Any] = {}

    @functools.wraps(make)
    def tiny_checkpoint(arch: str = "llama", *, save_to: str | Path | None = None, **overrides: Any) -> Any:
        if save_to is not None:  # the caller's folder: written each time, as the library function does
            return make(arch, save_to=save_to, **overrides)
        key = json.dumps([arch, overrides], sort_keys=True, default=str)
        if key not in cache:
            cache[key] = make(arch, **overrides)
        return cache[key]

    return tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint():
    return cached_tiny_checkpoint()
