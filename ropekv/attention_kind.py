"""Which keys a layer's queries see: one record, one spelling, for every package.

``LayerAttention`` is read from a model's config (``models/``), recorded per layer in the cache
contract, and decides the cache's block tables and the engine's masks. transformers' ``layer_types``
strings (``"sliding_attention"``, ...) are an input format, parsed once where config.json is read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, get_args

from .errors import ConfigError

AttentionKindName = Literal["full", "sliding", "chunked"]
ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKindName)


@dataclass(frozen=True)
class LayerAttention:
    """Which keys one layer's queries see: ``full`` (every earlier key), ``sliding`` (the last ``size``
    keys, the query's own included: HF's ``i - W < j <= i``) or ``chunked`` (llama4's
    ``attention_chunk_size``: a query at position ``p`` sees the keys at positions
    ``[floor(p / size) * size, p]``, its own chunk). Written ``full``, ``sliding(W=5)``, ``chunked(C=8)``."""

    kind: AttentionKindName
    size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in get_args(AttentionKindName):
            raise ConfigError(f"attention kind must be one of {get_args(AttentionKindName)}, got {self.kind!r}")
        if (self.kind == "full") != (self.size is None):
            raise ConfigError(
                f"attention kind {self.kind!r} with size {self.size!r}: full attention has no size, "
                "sliding and chunked attention need one"
            )

    @property
    def window(self) -> int | None:
        return self.size if self.kind == "sliding" else None

    @property
    def chunk(self) -> int | None:
        return self.size if self.kind == "chunked" else None

    def __str__(self) -> str:
        return "full" if self.kind == "full" else f"{self.kind}({'W' if self.kind == 'sliding' else 'C'}={self.size})"


class ModelWindows(enum.StrEnum):
    """``window=MODEL_WINDOWS``: each layer attends as its config says (its sliding window, its
    chunk), rather than one window forced on every layer. Its value is the string ``"model"``, which
    it equals, so that recorded calls (and JSON) read the same."""

    MODEL = "model"


MODEL_WINDOWS = ModelWindows.MODEL
