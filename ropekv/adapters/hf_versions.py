"""Which transformers releases the HF adapter drives, and how each spells the calls it makes.

The adapter drives transformers 4.42 and later through each release's public API. Three things moved
over that range, and each is one flag here rather than a ``try``/``except`` at the call:

- how ropekv sees the attention kernel: from 4.56 an attention function registered through
  ``AttentionInterface`` (with its mask builder in ``AttentionMaskInterface``) and switched on with
  ``set_attn_implementation``; before that, the module-level ``apply_rotary_pos_emb`` each model file calls, the cache's ``update``
  and the mask the attention module is called with (:mod:`.hf_legacy`);
- the load and cache spellings: ``dtype=`` (4.56; ``torch_dtype=`` before), ``DynamicCache(config=...)``
  (4.56; ``DynamicCache()`` before), ``StaticCache(max_batch_size=...)`` (before 5.0);
- keeping only the last logits: ``logits_to_keep`` (4.50), ``num_logits_to_keep`` (4.45-4.49), none before.

A release outside the range is refused with one line naming it (:func:`require_supported`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import EngineUnavailable

MIN_VERSION = (4, 42)  # the oldest release whose caches (DynamicCache, StaticCache.crop) the adapter drives
SUPPORTED = "transformers 4.42 or later"


def parse_version(text: str) -> tuple[int, int, int]:
    """``"4.51.3"`` -> ``(4, 51, 3)``; a pre-release or local suffix (``5.0.0rc1``, ``+cpu``) is ignored."""
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise EngineUnavailable(
            f"transformers reports an unreadable version {text!r}; the HF adapter drives {SUPPORTED}"
        )
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@dataclass(frozen=True)
class HFVersion:
    """One transformers release and the spellings the adapter uses on it."""

    text: str
    number: tuple[int, int, int]

    @property
    def attention_interface(self) -> bool:
        """Probes through ``AttentionInterface`` + ``AttentionMaskInterface`` and ``set_attn_implementation``
        (4.56; else :mod:`.hf_legacy`)."""
        return self.number >= (4, 56, 0)

    @property
    def dtype_keyword(self) -> str:
        return "dtype" if self.number >= (4, 56, 0) else "torch_dtype"

    @property
    def cache_takes_config(self) -> bool:
        """``DynamicCache(config=...)`` builds per-layer sliding caches (before 4.56 it takes no config)."""
        return self.number >= (4, 56, 0)

    @property
    def static_cache_batch_keyword(self) -> bool:
        """``StaticCache(..., max_batch_size=1)`` is required before 5.0."""
        return self.number < (5, 0, 0)

    @property
    def logits_keyword(self) -> str | None:
        """The forward keyword that keeps only the last rows' logits, or None where there is none."""
        if self.number >= (4, 50, 0):
            return "logits_to_keep"
        if self.number >= (4, 45, 0):
            return "num_logits_to_keep"
        return None


def require_supported(text: str) -> HFVersion:
    """The release ``text`` if the adapter drives it, else :class:`EngineUnavailable` naming the range."""
    number = parse_version(text)
    if number[:2] < MIN_VERSION:
        raise EngineUnavailable(f"transformers {text} is not supported: the HF adapter drives {SUPPORTED}")
    return HFVersion(text, number)
