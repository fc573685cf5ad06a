"""The sequence record a checked mlx-lm prompt cache carries beside its contract, and the check that
mlx-lm's own metadata and tensors in the file agree with both. Pure Python.

:class:`SavedSequence`: the token count (cached tokens sit at logical positions ``0 .. n-1``, the
next one at ``n``: mlx-lm caches always start at position 0) and each layer's :class:`LayerState`
(its mlx-lm class, ``offset``, and for a ``RotatingKVCache`` its ``max_size`` and ``keep``). Restoring
the counters with the keys is the point of the record: a restore that loads keys but restarts the
offset at 0 rotates the next token at position 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...contract import CacheContract
from ...errors import CacheError, ConfigError, PayloadError, UsageError
from .cache_contract import SUPPORTED_CACHES, WINDOW_CACHES
from .prompt_file import Header

MAX_TOKENS = 1 << 24
MAX_JSON_CHARS = 1 << 20
ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# cache.state per class: which entries are scalars (mlx-lm stores them as 0-d arrays) after keys, values
_STATE_SCALARS = {"KVCache": (2,), "RotatingKVCache": (2, 3, 4, 5), "ConcatenateKVCache": ()}


@dataclass(frozen=True)
class LayerState:
    """One layer's cache as saved: its mlx-lm class, ``offset`` (tokens seen) and ring (rotating only)."""

    kind: str
    offset: int
    max_size: int | None = None
    keep: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SUPPORTED_CACHES:
            raise ConfigError(f"cache class {self.kind!r} is not supported (supported: {', '.join(SUPPORTED_CACHES)})")
        _check_int("offset", self.offset, 0, MAX_TOKENS)
        ring = self.kind in WINDOW_CACHES
        if ring != (self.max_size is not None) or ring != (self.keep is not None):
            raise ConfigError(f"{self.kind}: max_size and keep are set exactly for a rotating cache")
        if self.max_size is not None and self.keep is not None:
            _check_int("max_size", self.max_size, 1, MAX_TOKENS)
            _check_int("keep", self.keep, 0, self.max_size - 1)


@dataclass(frozen=True)
class SavedSequence:
    """What the cache holds: ``num_tokens`` tokens at logical positions ``0 .. num_tokens - 1`` (the next
    token is at ``num_tokens``), and every layer's state. Every layer has seen every token."""

    num_tokens: int
    layers: tuple[LayerState, ...]

    def __post_init__(self) -> None:
        _check_int("num_tokens", self.num_tokens, 1, MAX_TOKENS)
        bad = [i for i, layer in enumerate(self.layers) if layer.offset != self.num_tokens]
        if not self.layers or bad:
            raise ConfigError(
                f"every layer must have seen the {self.num_tokens} token(s); layer(s) {bad[:5]} have other offsets"
            )

    def to_json(self) -> str:
        layers = [
            {
                "class": s.kind,
                "offset": s.offset,
                **({} if s.max_size is None else {"max_size": s.max_size, "keep": s.keep}),
            }
            for s in self.layers
        ]
        doc = {"num_tokens": self.num_tokens, "positions": [0, self.num_tokens], "layers": layers}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, num_layers: int) -> SavedSequence:
        if len(text) > MAX_JSON_CHARS:
            raise ConfigError(f"sequence record of {len(text)} characters (at most {MAX_JSON_CHARS})")
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"sequence record is not JSON: {exc}") from None
        if not isinstance(doc, dict) or set(doc) != {"num_tokens", "positions", "layers"}:
            raise ConfigError("sequence record must have exactly num_tokens, positions, layers")
        n, layers = doc["num_tokens"], doc["layers"]
        if doc["positions"] != [0, n]:
            raise ConfigError(f"sequence positions {doc['positions']!r}: [0, num_tokens] expected")
        if not isinstance(layers, list) or len(layers) != num_layers:
            raise ConfigError(f"sequence record must describe {num_layers} layers")
        states = []
        for i, d in enumerate(layers):
            if not isinstance(d, dict) or not {"class", "offset"} <= set(d) <= {"class", "offset", "max_size", "keep"}:
                raise ConfigError(f"sequence record layer {i}: class, offset (and max_size, keep) expected")
            states.append(LayerState(d["class"], d["offset"], d.get("max_size"), d.get("keep")))
        return cls(n, tuple(states))

    @classmethod
    def of(cls, caches: Sequence[Any]) -> SavedSequence:
        states = []
        for i, c in enumerate(caches):
            kind = type(c).__name__
            if kind not in SUPPORTED_CACHES:
                raise UsageError(
                    f"layer {i}: cannot save an mlx-lm {kind} with its contract (supported: {', '.join(SUPPORTED_CACHES)})"
                )
            ring = kind in WINDOW_CACHES
            states.append(
                LayerState(kind, int(c.offset), int(c.max_size) if ring else None, int(c.keep) if ring else None)
            )
        if not states or states[0].offset < 1:
            raise CacheError("the prompt cache is empty: nothing to save (prefill it first)")
        try:
            return cls(states[0].offset, tuple(states))
        except ConfigError as exc:
            raise CacheError(f"cannot save this prompt cache: {exc}") from None


def check_layout(header: Header, contract: CacheContract, sequence: SavedSequence, where: str) -> None:
    """mlx-lm's metadata (classes, scalars) and the tensors agree with the contract and the sequence."""
    meta = header.metadata
    n = contract.num_layers
    classes = {k: v for k, v in meta.items() if k.startswith("1.")}
    expected_classes = {f"1.{i}": s.kind for i, s in enumerate(sequence.layers)}
    if classes != expected_classes:
        bad = sorted(set(classes.items()) ^ set(expected_classes.items()))[:3]
        raise PayloadError(f"{where}: mlx-lm's cache classes disagree with ropekv's record (e.g. {bad})")
    names = set()
    for i, s in enumerate(sequence.layers):
        scalars = _STATE_SCALARS[s.kind]
        count = 2 + len(scalars)
        for k in range(count):
            name = f"{i}.{k}"
            names.add(name)
            e = header.entries.get(name)
            if e is None:
                raise PayloadError(f"{where}: tensor {name!r} ({s.kind} state) is missing")
            if k in scalars:
                if e.shape != () or e.dtype not in ("I32", "I64"):
                    raise PayloadError(
                        f"{where}: tensor {name!r} must be an integer scalar, got {e.dtype} {list(e.shape)}"
                    )
                if meta.get(_scalar_key(header, name)) != "scalar":
                    raise PayloadError(f"{where}: tensor {name!r} is not listed as a scalar in mlx-lm's metadata")
                continue
            want = ST_DTYPE[contract.dtype]
            ok = (
                len(e.shape) == 4
                and e.shape[0] == 1
                and e.shape[1] == contract.num_kv_heads
                and e.shape[3] == contract.head_dim
            )
            if e.dtype != want or not ok:
                raise PayloadError(
                    f"{where}: tensor {name!r} is {e.dtype} {list(e.shape)}; {want} [1, {contract.num_kv_heads}, rows, "
                    f"{contract.head_dim}] expected"
                )
            rows, held = e.shape[2], s.offset if s.max_size is None else min(s.offset, s.max_size)
            if rows < held or (s.kind == "ConcatenateKVCache" and rows != s.offset):
                raise PayloadError(f"{where}: tensor {name!r} holds {rows} rows for {held} cached token(s)")
    extra = sorted(set(header.entries) - names)
    if extra:
        raise PayloadError(f"{where}: tensors {extra[:5]} belong to no layer of the contract ({n} layers)")


def _scalar_key(header: Header, name: str) -> str:
    """The metadata key mlx-lm files the kind of scalar tensor ``name`` under (``"2.{j}.1"``)."""
    for k, v in header.metadata.items():
        if k.startswith("2.") and k.endswith(".0") and v == name:
            return k[:-2] + ".1"
    return ""


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
