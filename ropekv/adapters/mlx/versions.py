"""Which mlx-lm releases the mlx adapter drives, and what differs between them.

The adapter drives mlx-lm 0.22 and later on mlx 0.32.4 (older mlx-lm model code runs on the current
mlx). Two things moved over that range, and each is read from the release itself, not guessed from its
number:

- ``load_model`` took ``trust_remote_code`` only in later releases; where it does, ropekv passes
  ``False`` (releases without the keyword build only mlx-lm's own model classes);
- before 0.28 the model built its masks in ``create_attention_mask(h, caches)`` from the list of caches;
  later each cache builds its own (``make_mask``), which is how ropekv hands a full forward a window
  mask. On an older release a case window is reported as ignored (``MLXEngine.ignored``).

A ConcatenateKVCache honours a sliding layer's window in a multi-token call only from 0.30.7
(:func:`concatenate_masks_windows`): before that the adapter's full forward runs through the model's own
fresh caches instead.

A release outside the range is refused with one line naming it (:func:`require_supported`).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from ...errors import EngineUnavailable

MIN_VERSION = (0, 22)
SUPPORTED = "mlx-lm 0.22 or later"


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.26.3"`` -> ``(0, 26, 3)``; a pre-release or local suffix is ignored."""
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise EngineUnavailable(f"mlx-lm reports an unreadable version {text!r}; the mlx adapter drives {SUPPORTED}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def require_supported(text: str) -> tuple[int, int, int]:
    """The release ``text`` as numbers if the adapter drives it, else :class:`EngineUnavailable`."""
    number = parse_version(text)
    if number[:2] < MIN_VERSION:
        raise EngineUnavailable(f"mlx-lm {text} is not supported: the mlx adapter drives {SUPPORTED}")
    return number


def load_keywords(utils: Any) -> dict[str, Any]:
    """``trust_remote_code=False`` where this release's ``load_model`` takes it, else nothing."""
    params = inspect.signature(utils.load_model).parameters
    return {"trust_remote_code": False} if "trust_remote_code" in params else {}


def caches_make_masks(cache_module: Any) -> bool:
    """Whether this release's caches build their own masks (``KVCache.make_mask``, 0.28 and later)."""
    return hasattr(cache_module.KVCache, "make_mask")


def concatenate_masks_windows(cache_module: Any) -> bool:
    """Whether this release's ``ConcatenateKVCache`` builds a windowed mask for a multi-token call, asked
    of the release itself: ``make_mask(2, window_size=1)`` is an array there, the string ``"causal"``
    (every key) or nothing before 0.30.7."""
    if not hasattr(cache_module, "ConcatenateKVCache"):
        return False
    cache = cache_module.ConcatenateKVCache()
    if not hasattr(cache, "make_mask"):
        return False
    try:
        mask = cache.make_mask(2, window_size=1)
    except TypeError:
        return False
    return mask is not None and not isinstance(mask, str)
