"""Upper bounds of the integers a model config can give, checked when the config is read.

Each bound is far above any real model, and low enough that nothing sized by a config (a list per
layer, a frequency table, a block of slots, a position in int64) can overflow or exhaust memory
before a tensor is read. A value outside is a one-line :class:`ConfigError` naming the field.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..numbers import is_int
from ..rope import MAX_HEAD_DIM, MAX_POSITIONS

# Any integer a config gives (a count, a size, a window, a layer index): positions stay int64 with room.
MAX_CONFIG_INT = MAX_POSITIONS
MAX_LAYERS = 4096  # ~130 in real models; sizes lists built before any tensor is read
MAX_WIDTH = 2**20  # hidden, intermediate and expert sizes, MLA ranks (real: <= ~50k)
MAX_HEADS = 2**12  # attention and KV heads, KV groups (real: <= 128)
MAX_VOCAB = 2**24  # vocabulary (real: <= ~260k)
MAX_EXPERTS = 2**16  # MoE experts (real: <= ~400)

# ModelConfig's integer fields and their bounds (the lower bound is 1 for every one of them).
MODEL_INT_BOUNDS: dict[str, int] = {
    "vocab_size": MAX_VOCAB,
    "hidden_size": MAX_WIDTH,
    "intermediate_size": MAX_WIDTH,
    "num_layers": MAX_LAYERS,
    "num_heads": MAX_HEADS,
    "num_kv_heads": MAX_HEADS,
    "head_dim": MAX_HEAD_DIM,
    "max_position_embeddings": MAX_POSITIONS,
    "sliding_window": MAX_POSITIONS,
    "attention_chunk_size": MAX_POSITIONS,
    "qkv_groups": MAX_HEADS,
}


def shown(value: Any) -> str:
    """``repr(value)``, except that a huge integer is shown by size (``str`` refuses ints of more
    than 4300 digits, and a 2**64 in a message helps nobody read it)."""
    if is_int(value) and abs(value) >= 2**64:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def bound_text(bound: int) -> str:
    """``2**40`` for a power of two, else the number."""
    return f"2**{bound.bit_length() - 1}" if bound > 65536 and bound & (bound - 1) == 0 else str(bound)


def check_int(what: str, value: Any, low: int, high: int = MAX_CONFIG_INT) -> int:
    """``value`` if it is an integer (not a bool) in ``[low, high]``, else a ConfigError naming ``what``."""
    if not is_int(value) or not low <= value <= high:
        raise ConfigError(f"{what} must be an integer in [{low}, {bound_text(high)}], got {shown(value)}")
    return value
