"""The bytes of an mlx-lm prompt-cache file, read before anything in it is believed. Pure Python.

``mlx_lm.models.cache.save_prompt_cache(path, cache, metadata)`` writes one safetensors file:

- tensors ``"{layer}.{k}"``: the ``k``-th entry of layer ``layer``'s ``cache.state`` (``KVCache``:
  keys, values ``[1, num_kv_heads, rows, head_dim]`` with ``rows`` the allocated buffer (a multiple of
  256, zero past ``offset``), then ``offset``; ``RotatingKVCache``: keys, values, ``offset``, ``keep``,
  ``max_size``, ``_idx``); Python scalars are stored as 0-d ``I32`` arrays;
- ``__metadata__`` (str -> str), ``tree_flatten([metadata, classes, scalars])``: ``"0.{key}"`` the
  caller's metadata, ``"1.{layer}"`` the class name per layer, ``"2.0" = ""`` then ``"2.{j}.0"`` /
  ``"2.{j}.1"`` the tensor names holding scalars and their kind (``scalar``, ``string``, ``none``).

``load_prompt_cache`` unflattens the metadata (a caller's key with a dot becomes a nested dict), then
calls ``globals()[class_name].from_state(state)`` for each layer: the file names the class it
constructs. No RoPE, model or dtype is recorded; any model of the same shapes loads it.

:func:`read_header` bounds and validates the framing (header length, JSON, every entry's dtype,
shape and byte range tiling the data section exactly) so that the tensors' bytes are read only
after the header was checked; :func:`header_bytes` rewrites the header (the data section is kept
byte for byte, offsets are relative to it).
"""

from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from ...errors import PayloadError
from ...files import read_exactly

MAX_HEADER_BYTES = 4 << 20  # 30 layers take ~8 KB; a header past this is not a prompt cache
MAX_ENTRIES = 1 << 16
MAX_RANK = 8
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "I64": 8, "U32": 4, "BOOL": 1, "U8": 1}


@dataclass(frozen=True)
class Entry:
    dtype: str  # safetensors dtype code ("F32")
    shape: tuple[int, ...]
    start: int  # byte offsets in the data section
    end: int


@dataclass(frozen=True)
class Header:
    """A validated safetensors header. ``length``: bytes of JSON after the 8-byte length."""

    length: int
    metadata: dict[str, str]
    entries: dict[str, Entry]
    file_size: int

    @property
    def data_start(self) -> int:
        return 8 + self.length

    @property
    def data_len(self) -> int:
        return self.file_size - self.data_start

    def entries_json(self) -> str:
        """Canonical JSON of every entry (what a checksum covers besides the bytes)."""
        return json.dumps(
            {k: [e.dtype, list(e.shape), e.start, e.end] for k, e in sorted(self.entries.items())},
            sort_keys=True,
            separators=(",", ":"),
        )


def read_header(f: io.RawIOBase, size: int, where: str) -> Header:
    """Read and validate the header of the open file ``f`` (at offset 0) of ``size`` bytes; every
    problem is a PayloadError naming ``where``."""
    if size < 8:
        raise PayloadError(f"{where}: truncated: {size} byte(s), not even a safetensors header length")
    first = bytearray(8)
    read_exactly(f, memoryview(first), where, PayloadError)
    (length,) = struct.unpack("<Q", bytes(first))
    if length > MAX_HEADER_BYTES or length > size - 8:
        raise PayloadError(
            f"{where}: corrupt or truncated: the header claims {length} bytes, the file has {size - 8} after "
            f"the length (at most {MAX_HEADER_BYTES} accepted)"
        )
    raw = bytearray(length)
    read_exactly(f, memoryview(raw), where, PayloadError)
    return parse_header(bytes(raw), size, where)


def parse_header(raw: bytes, size: int, where: str) -> Header:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise PayloadError(f"{where}: corrupt header: key {k!r} appears twice")
            out[k] = v
        return out

    def no_constant(name: str) -> Any:
        raise PayloadError(f"{where}: corrupt header: {name} is not JSON")

    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PayloadError(f"{where}: corrupt header: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise PayloadError(f"{where}: corrupt header: not a JSON object")
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise PayloadError(f"{where}: corrupt header: __metadata__ must map strings to strings")
    if len(doc) > MAX_ENTRIES:
        raise PayloadError(f"{where}: {len(doc)} tensors, more than the {MAX_ENTRIES} accepted")
    data_len = size - 8 - len(raw)
    entries = {name: _entry(name, info, where) for name, info in doc.items()}
    cursor = 0
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if e.start != cursor:
            raise PayloadError(
                f"{where}: corrupt or truncated: tensor {name!r} starts at byte {e.start} of the data section, "
                f"{cursor} expected (tensors must tile it)"
            )
        cursor = e.end
    if cursor != data_len:
        raise PayloadError(
            f"{where}: truncated or padded: the tensors cover {cursor} bytes, the data section has {data_len}"
        )
    return Header(length=len(raw), metadata=dict(meta), entries=entries, file_size=size)


def _entry(name: str, info: Any, where: str) -> Entry:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise PayloadError(f"{where}: corrupt header: tensor {name!r} must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _ITEMSIZE:
        raise PayloadError(f"{where}: tensor {name!r} has dtype {dtype!r} (known: {', '.join(_ITEMSIZE)})")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)
    ):
        raise PayloadError(f"{where}: tensor {name!r} has no valid shape ({shape!r})")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise PayloadError(f"{where}: tensor {name!r} has no valid data_offsets ({offsets!r})")
    nbytes = math.prod(shape) * _ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise PayloadError(
            f"{where}: tensor {name!r} declares {dtype} {shape} ({nbytes} bytes) but data_offsets span "
            f"{offsets[1] - offsets[0]} bytes"
        )
    return Entry(dtype, tuple(shape), offsets[0], offsets[1])


def header_bytes(header: Header, metadata: dict[str, str]) -> bytes:
    """The 8-byte length and JSON header of ``header``'s entries under ``metadata`` (padded with spaces
    to a multiple of 8, as safetensors writers do); the data section that follows is unchanged."""
    doc: dict[str, Any] = {"__metadata__": metadata}
    for name, e in header.entries.items():
        doc[name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.start, e.end]}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
