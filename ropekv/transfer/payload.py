"""The handoff payload: one prefilled sequence's KV cache as self-describing, checksummed bytes.

A payload is a safetensors file (docs/handoff.md):

- tensors ``tokens [n]`` and ``positions [n]`` (int64: token ids and logical positions of the whole
  sequence), and per layer ``layers.{i}.keys`` / ``layers.{i}.values`` ``[rows, num_kv_heads, head_dim]``
  in the contract dtype. ``rows = n`` for full-attention layers; a windowed layer holds only the
  tokens its ring keeps (:func:`~ropekv.cache.layout.window_rows`: the sinks and the last ``window`` tokens). Under the
  contract's ``block_layout`` ``"blocks,2,heads,block,dim"`` they are ``[blocks, num_kv_heads,
  block_size, head_dim]`` instead (:mod:`ropekv.transfer.block_layout`).
- ``__metadata__`` (strings): ``format`` (``ropekv.handoff``), ``version`` (``1``), ``contract`` (the
  sender's :class:`~ropekv.contract.CacheContract` JSON), ``sequence`` (JSON ``{"seq_id", "num_tokens"}``)
  and ``checksum``: ``sha256:`` over the canonical metadata and every tensor's name, dtype, shape and
  bytes, so a flipped bit anywhere in the payload is detected.
- an 8-bit contract (``dtype`` ``float8_e4m3fn``, :class:`~ropekv.contract.KvQuant`): keys and values
  are the e4m3fn codes (``F8_E4M3``) and per layer ``layers.{i}.k_scale`` / ``layers.{i}.v_scale``
  (float32 ``[S]``, S = 1 per tensor or ``num_kv_heads`` per head) are the scales that dequantize them:
  codes never travel without their scales.

:func:`read_payload` checks the 8-byte header length and the JSON header itself (sizes bounded,
offsets contiguous and covering the data exactly, names, dtypes and shapes consistent with the
contract) before anything is allocated, then verifies the checksum, and only then lets safetensors
build tensors. Whatever the bytes, it raises nothing but :class:`~ropekv.errors.PayloadError`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.block_layout import from_wire, to_wire, wire_shape
from ..cache.layout import window_rows
from ..cache.quant import LayerScales
from ..contract import CacheContract
from ..errors import PayloadError, RopeKVError
from ..numbers import is_int
from ..rope import MAX_POSITIONS

FORMAT = "ropekv.handoff"
VERSION = 1
MAX_HEADER_BYTES = 4 << 20  # a 200-layer contract needs ~40 KB; anything past this is a lie
MAX_TOKENS = 1 << 24
MAX_TOKEN_ID = 1 << 31  # token ids are int32 in every engine
MAX_RANK = 8
_META_KEYS = ("checksum", "contract", "format", "sequence", "version")
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "float8_e4m3fn": "F8_E4M3"}
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "F8_E4M3": 1}
_TORCH_DTYPE = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
}
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True, eq=False)
class Handoff:
    """One sequence's cached state as it crosses a prefill->decode boundary. Validated on construction.

    ``keys[i]``/``values[i]``: ``[rows_i, num_kv_heads, head_dim]`` in the contract dtype, where
    ``rows_i = len(layer_rows(i))``: all ``n`` tokens for a full layer, the ring's live tokens for a
    windowed one. Keys are in the contract's key form (rotated at ``positions``, or raw).
    ``scales`` (an 8-bit contract only, else None): per layer the :class:`LayerScales` that dequantize
    that layer's codes.
    """

    contract: CacheContract
    seq_id: str | int
    tokens: torch.Tensor  # [n] int64 token ids
    positions: torch.Tensor  # [n] int64 logical positions, strictly increasing
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    scales: tuple[LayerScales, ...] | None = None

    def __post_init__(self) -> None:
        _check_handoff(self)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def layer_rows(self, layer: int) -> torch.Tensor:
        """Indices ``[rows]`` into ``tokens``/``positions`` of the tokens ``layer`` holds."""
        return held_rows(self.contract, layer, self.num_tokens)

    def tensor_bytes(self) -> int:
        """Bytes of the keys and values alone (what a raw copy of the cache would move)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def held_rows(c: CacheContract, layer: int, num_tokens: int) -> torch.Tensor:
    """Write indices ``[rows]`` of the tokens layer ``layer`` of a cache under ``c`` still holds after
    ``num_tokens`` appends: the ring's (:func:`window_rows`) on a sliding layer, all of them otherwise."""
    window = c.layer(layer).attention.window
    if window is None:
        return torch.arange(num_tokens, dtype=torch.int64)
    return window_rows(num_tokens, window, c.sink_tokens)


# ---------------------------------------------------------------------- writing


def write_payload(handoff: Handoff) -> bytes:
    """Serialize ``handoff`` (already validated by its constructor) to payload bytes."""
    if not isinstance(handoff, Handoff):
        raise PayloadError(f"write_payload needs a Handoff, got {type(handoff).__name__}")
    from safetensors.torch import save

    tensors = _tensors(handoff)
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "contract": handoff.contract.to_json(),
        "sequence": json.dumps(
            {"seq_id": handoff.seq_id, "num_tokens": handoff.num_tokens}, sort_keys=True, separators=(",", ":")
        ),
    }
    entries = [
        (name, _st_dtype(t), list(t.shape), t.view(torch.uint8).numpy().data) for name, t in sorted(tensors.items())
    ]
    meta["checksum"] = _checksum(meta, entries)
    try:
        return save(tensors, metadata=meta)
    except Exception as exc:
        raise PayloadError(f"payload could not be written: {type(exc).__name__}: {exc}") from None


def _tensors(h: Handoff) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors by payload name; a tensor sharing storage with an earlier one is copied
    (safetensors refuses shared storage, e.g. keys and values that are one tensor)."""
    out = {"tokens": h.tokens, "positions": h.positions}
    c = h.contract
    for i, (k, v) in enumerate(zip(h.keys, h.values)):
        out[f"layers.{i}.keys"] = to_wire(k, c.block_layout, c.block_size)
        out[f"layers.{i}.values"] = to_wire(v, c.block_layout, c.block_size)
    for i, sc in enumerate(h.scales or ()):
        out[f"layers.{i}.k_scale"], out[f"layers.{i}.v_scale"] = sc.k, sc.v
    storages = set()
    for name, t in out.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in storages else t
        storages.add(ptr)
    return out


def _st_dtype(t: torch.Tensor) -> str:
    """safetensors' name for the dtype of ``t`` (int64 for tokens/positions, a contract float dtype)."""
    return "I64" if t.dtype == torch.int64 else _ST_DTYPE[str(t.dtype).removeprefix("torch.")]


def scale_size(c: CacheContract) -> int:
    """Entries of one layer's key (or value) scale under an 8-bit contract: 1 per tensor, KVH per head."""
    assert c.kv_quant is not None
    return 1 if c.kv_quant.scale == "per_tensor" else c.num_kv_heads


def _checksum(meta: dict[str, str], entries: list[tuple[str, str, list[int], memoryview]]) -> str:
    """sha256 over the metadata (checksum excluded, canonical JSON) and each tensor's name, dtype,
    shape and bytes, in name order."""
    h = hashlib.sha256(f"{FORMAT}/{VERSION}\n".encode())
    h.update(
        json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True, separators=(",", ":")).encode()
    )
    for name, dtype, shape, data in entries:
        h.update(json.dumps([name, dtype, shape], separators=(",", ":")).encode())
        h.update(data)
    return "sha256:" + h.hexdigest()


# ---------------------------------------------------------------------- reading


@dataclass(frozen=True, eq=False)
class PayloadHeader:
    """A payload's header, validated: everything known about it before one tensor byte is read.

    ``entries``: tensor name -> (safetensors dtype, shape, (start, end) offsets into the data section),
    already checked to tile the data section exactly and to be what ``contract`` and ``num_tokens``
    call for. The data section starts at byte ``data_start`` and is ``data_len`` bytes long."""

    header_len: int
    meta: dict[str, str]
    entries: dict[str, tuple[str, list[int], tuple[int, int]]]
    contract: CacheContract
    seq_id: str | int
    num_tokens: int

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_len(self) -> int:
        return sum(b - a for _, _, (a, b) in self.entries.values())


def header_length(first8: bytes, total: int) -> int:
    """The header length the first 8 bytes of a ``total``-byte payload declare, bounded."""
    if total < 8 or len(first8) < 8:
        raise PayloadError(f"payload truncated: {total} byte(s), the 8-byte header length alone needs 8")
    header_len = int.from_bytes(first8[:8], "little")
    if not 2 <= header_len <= MAX_HEADER_BYTES:
        raise PayloadError(
            f"payload bytes 0..8: header length {header_len} outside [2, {MAX_HEADER_BYTES}] "
            "(not a handoff payload, or corrupted)"
        )
    if 8 + header_len > total:
        raise PayloadError(
            f"payload truncated: header declares {header_len} bytes at 8..{8 + header_len}, "
            f"only {total} byte(s) present"
        )
    return header_len


def read_header(raw: bytes, header_len: int, total: int) -> PayloadHeader:
    """Validate the JSON header ``raw`` (bytes ``8 .. 8 + header_len``) of a ``total``-byte payload."""
    header = _parse_header(raw, header_len)
    meta = _metadata(header.pop("__metadata__", None))
    entries = _entries(header, total - 8 - header_len, base=8 + header_len)
    contract = contract_of_metadata(meta["contract"])
    seq_id, n = _sequence(meta["sequence"])
    _check_layout(entries, contract, n)
    return PayloadHeader(header_len, meta, entries, contract, seq_id, n)


def read_payload(data: bytes) -> Handoff:
    """Parse and validate payload bytes; raises :class:`PayloadError` naming what is wrong and where."""
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
    header_len = header_length(data[:8], len(data))
    header = read_header(data[8 : 8 + header_len], header_len, len(data))
    tensors = {}
    for name, (dtype, shape, (a, b)) in header.entries.items():
        t = empty_tensor(dtype, shape)
        tensor_bytes(t)[:] = memoryview(data)[header.data_start + a : header.data_start + b]
        tensors[name] = t
    return assemble(header, tensors)


def empty_tensor(dtype: str, shape: list[int]) -> torch.Tensor:
    """An uninitialized CPU tensor for one validated header entry (its size is bounded by the file's)."""
    return torch.empty(shape, dtype=_TORCH_DTYPE[dtype])


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` as a writable memoryview (to read a file into)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def assemble(header: PayloadHeader, tensors: dict[str, torch.Tensor]) -> Handoff:
    """The :class:`Handoff` of ``header`` and its ``tensors`` (one per entry, as read): the checksum is
    verified first, then the handoff validates its content."""
    views = [
        (name, dtype, shape, tensor_bytes(tensors[name])) for name, (dtype, shape, _) in sorted(header.entries.items())
    ]
    if _checksum(header.meta, views) != header.meta["checksum"]:
        raise PayloadError(
            "payload checksum mismatch: metadata or tensor bytes were changed after writing "
            "(a flipped bit, a truncated or spliced transfer)"
        )
    c, n = header.contract, header.num_tokens

    def rows(name: str, layer: int) -> torch.Tensor:
        return from_wire(tensors[name], c.block_layout, c.block_size, len(held_rows(c, layer, n)))

    scales = None
    if c.kv_quant is not None:
        try:
            scales = tuple(
                LayerScales(tensors[f"layers.{i}.k_scale"], tensors[f"layers.{i}.v_scale"]) for i in range(c.num_layers)
            )
        except RopeKVError as exc:
            raise PayloadError(f"payload scales: {exc}") from None
    return Handoff(
        contract=c,
        seq_id=header.seq_id,
        tokens=tensors["tokens"],
        positions=tensors["positions"],
        keys=tuple(rows(f"layers.{i}.keys", i) for i in range(c.num_layers)),
        values=tuple(rows(f"layers.{i}.values", i) for i in range(c.num_layers)),
        scales=scales,
    )


def _parse_header(raw: bytes, header_len: int) -> dict[str, Any]:
    where = f"payload header (bytes 8..{8 + header_len})"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PayloadError(f"{where} is not UTF-8 at byte {8 + exc.start}") from None
    body = text.rstrip(" ")  # safetensors pads with spaces; nothing else may follow the object
    if any(c in body for c in "\t\n\r"):
        raise PayloadError(f"{where} holds whitespace other than trailing spaces (not as written)")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            raise PayloadError(f"{where} repeats a key")
        return out

    def no_constant(name: str) -> Any:
        raise PayloadError(f"{where} holds {name}, which is not JSON")

    try:
        header = json.loads(body, object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except PayloadError:
        raise
    except (ValueError, RecursionError) as exc:
        raise PayloadError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise PayloadError(f"{where} must be a JSON object, got {type(header).__name__}")
    return header


def _metadata(meta: Any) -> dict[str, str]:
    if not isinstance(meta, dict):
        raise PayloadError("payload header has no __metadata__ object: not a ropekv handoff payload")
    if meta.get("format") != FORMAT:
        raise PayloadError(f"payload __metadata__.format is {str(meta.get('format'))[:80]!r}, expected {FORMAT!r}")
    if meta.get("version") != str(VERSION):
        raise PayloadError(
            f"payload __metadata__.version {str(meta.get('version'))[:20]!r} is not supported "
            f"(this reader understands version {VERSION})"
        )
    if sorted(meta) != list(_META_KEYS) or not all(isinstance(v, str) for v in meta.values()):
        raise PayloadError(
            f"payload __metadata__ must hold exactly the strings {', '.join(_META_KEYS)}; "
            f"has {', '.join(sorted(map(str, meta)))[:200]}"
        )
    if not _CHECKSUM.fullmatch(meta["checksum"]):
        raise PayloadError("payload __metadata__.checksum is not 'sha256:' followed by 64 hex digits")
    return meta


def _entries(header: dict[str, Any], data_len: int, base: int) -> dict[str, tuple[str, list[int], tuple[int, int]]]:
    """Validate every tensor entry; offsets must tile the data section exactly (no gaps, no overlap)."""
    if len(header) > 2 + 2 * 4096:
        raise PayloadError(f"payload header lists {len(header)} tensors, more than any contract allows")
    out = {}
    for name, e in header.items():
        where = f"payload header, tensor {name[:80]!r}"
        if not isinstance(e, dict) or set(e) != _ENTRY_KEYS:
            raise PayloadError(f"{where}: entry must hold exactly dtype, shape, data_offsets")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
            raise PayloadError(f"{where}: dtype {str(dtype)[:20]!r} is not one of {', '.join(_ITEMSIZE)}")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(is_int(s) and s >= 0 for s in shape):
            raise PayloadError(f"{where}: shape must be a list of at most {MAX_RANK} non-negative integers")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise PayloadError(f"{where}: data_offsets {str(offsets)[:60]} not within the {data_len}-byte data section")
        size = math.prod(shape) * _ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != size:
            raise PayloadError(
                f"{where}: shape {shape} in {dtype} needs {size} bytes, data_offsets span {offsets[1] - offsets[0]}"
            )
        out[name] = (dtype, shape, (offsets[0], offsets[1]))
    end = 0
    for name, (_, _, (a, b)) in sorted(out.items(), key=lambda kv: kv[1][2]):
        if a != end:
            raise PayloadError(
                f"payload tensor {name[:80]!r} starts at byte {base + a}, expected {base + end} "
                "(tensors must tile the data section)"
            )
        end = b
    if end != data_len:
        state = "unaccounted for" if end < data_len else "missing"
        raise PayloadError(
            f"payload data section is {data_len} bytes but its tensors cover {end} "
            f"(bytes {base + min(end, data_len)}..{base + max(end, data_len)} {state})"
        )
    return out


def contract_of_metadata(text: str) -> CacheContract:
    """The contract a payload header carries; any problem with it is a PayloadError."""
    try:
        return CacheContract.from_json(text)
    except RopeKVError as exc:
        raise PayloadError(f"payload __metadata__.contract: {exc}") from None
    except Exception as exc:
        raise PayloadError(f"payload __metadata__.contract is unusable ({type(exc).__name__}: {exc})") from None


def _sequence(text: str) -> tuple[str | int, int]:
    try:
        seq = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise PayloadError(f"payload __metadata__.sequence is not JSON: {exc}") from None
    if not isinstance(seq, dict) or set(seq) != {"seq_id", "num_tokens"}:
        raise PayloadError("payload __metadata__.sequence must be an object with exactly seq_id, num_tokens")
    n, seq_id = seq["num_tokens"], seq["seq_id"]
    if not is_int(n) or not 1 <= n <= MAX_TOKENS:
        raise PayloadError(f"payload __metadata__.sequence.num_tokens {str(n)[:40]} not in [1, {MAX_TOKENS}]")
    if not (isinstance(seq_id, str) and len(seq_id) <= 256) and not is_int(seq_id):
        raise PayloadError("payload __metadata__.sequence.seq_id must be a string (<= 256 chars) or an integer")
    return seq_id, n


def _check_layout(entries: dict, c: CacheContract, n: int) -> None:
    """Names, dtypes and shapes the contract and token count call for, before allocating anything."""
    want = {"tokens": ("I64", [n]), "positions": ("I64", [n])}
    dtype = _ST_DTYPE[c.dtype]
    for i in range(c.num_layers):
        rows = len(held_rows(c, i, n))
        for part in ("keys", "values"):
            want[f"layers.{i}.{part}"] = (
                dtype,
                wire_shape(c.block_layout, rows, c.num_kv_heads, c.head_dim, c.block_size),
            )
        if c.kv_quant is not None:
            want[f"layers.{i}.k_scale"] = want[f"layers.{i}.v_scale"] = ("F32", [scale_size(c)])
    missing, extra = sorted(set(want) - set(entries)), sorted(set(entries) - set(want))
    if missing or extra:
        raise PayloadError(
            f"payload tensors do not match its contract ({c.num_layers} layers): "
            f"missing {missing[:6]}, unexpected {[e[:40] for e in extra[:6]]}"
        )
    for name, (dtype, shape) in want.items():
        got_dtype, got_shape, _ = entries[name]
        if (got_dtype, got_shape) != (dtype, shape):
            raise PayloadError(
                f"payload tensor {name!r} is {got_dtype} {got_shape}; its contract and "
                f"num_tokens={n} call for {dtype} {shape}"
            )


# ---------------------------------------------------------------------- validation


def check_token_ids(tokens: torch.Tensor, what: str, vocab_size: int = MAX_TOKEN_ID) -> None:
    """Token ids ``[n]`` in ``[0, vocab_size)``; the default bound is any vocabulary's (int32 ids)."""
    bad = torch.nonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.numel():
        i = int(bad[0])
        t = int(tokens[i])
        if t < 0:
            raise PayloadError(f"{what} token id {t} (token {i}) is negative")
        bound = (
            "any vocabulary (ids are below 2**31)" if vocab_size == MAX_TOKEN_ID else f"the vocabulary of {vocab_size}"
        )
        raise PayloadError(f"{what} token id {t} (token {i}) is beyond {bound}")


def _finite_rows(t: torch.Tensor) -> int | None:
    """The flat index of the first NaN or infinite entry of ``t``, None when there is none. e4m3fn
    codes have no infinity; their NaN is the byte pattern ``s1111111``."""
    if t.dtype == torch.float8_e4m3fn:
        nan = (t.reshape(-1).view(torch.uint8) & 0x7F) == 0x7F
        return int(torch.nonzero(nan)[0]) if bool(nan.any()) else None
    lo, hi = torch.aminmax(t)  # NaN propagates
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return None
    return int(torch.nonzero(~torch.isfinite(t).flatten())[0])


def _check_scales(h: Handoff) -> None:
    """An 8-bit contract's handoff carries one :class:`LayerScales` per layer, of the contract's size."""
    c = h.contract
    if c.kv_quant is None:
        if h.scales is not None:
            raise PayloadError(f"handoff scales come with an 8-bit contract only; this one stores {c.dtype}")
        return
    if not isinstance(h.scales, tuple) or len(h.scales) != c.num_layers:
        raise PayloadError(
            f"handoff of an 8-bit cache needs one LayerScales per layer ({c.num_layers}): codes never travel without them"
        )
    size = scale_size(c)
    for i, sc in enumerate(h.scales):
        if not isinstance(sc, LayerScales) or sc.k.numel() != size or sc.v.numel() != size:
            raise PayloadError(
                f"handoff scales of layer {i} must be LayerScales of {size} entries ({c.kv_quant.scale})"
            )


def _check_handoff(h: Handoff) -> None:
    c = h.contract
    if not isinstance(c, CacheContract):
        raise PayloadError(f"handoff contract must be a CacheContract, got {type(c).__name__}")
    if not ((isinstance(h.seq_id, str) and len(h.seq_id) <= 256) or is_int(h.seq_id)):
        raise PayloadError(f"handoff seq_id must be a string (<= 256 chars) or an integer, got {h.seq_id!r}")
    for name in ("tokens", "positions"):
        t = getattr(h, name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise PayloadError(f"handoff {name} must be a 1-D int64 tensor")
    n = h.tokens.numel()
    if not 1 <= n <= MAX_TOKENS or h.positions.numel() != n:
        raise PayloadError(
            f"handoff has {n} token(s) and {h.positions.numel()} position(s); "
            f"both must be equal and in [1, {MAX_TOKENS}]"
        )
    check_token_ids(h.tokens, "handoff")
    pos = h.positions
    if int(pos[0]) < 0:
        raise PayloadError(f"handoff position {int(pos[0])} (token 0) is negative")
    if int(pos.max()) >= MAX_POSITIONS:
        i = int(torch.nonzero(pos >= MAX_POSITIONS)[0])
        raise PayloadError(
            f"handoff position {int(pos[i])} (token {i}) is beyond any model's positions (at most 2**40)"
        )
    steps = pos[1:] - pos[:-1]
    if n > 1 and not bool((steps > 0).all()):
        i = int(torch.nonzero(steps <= 0)[0])
        raise PayloadError(
            f"handoff positions must strictly increase: token {i + 1} has position "
            f"{int(pos[i + 1])} after {int(pos[i])}"
        )
    _check_scales(h)
    for part in ("keys", "values"):
        ts = getattr(h, part)
        if not isinstance(ts, tuple) or len(ts) != c.num_layers:
            raise PayloadError(f"handoff {part} must be a tuple of {c.num_layers} tensors (one per layer)")
        for i, t in enumerate(ts):
            rows = len(held_rows(c, i, n))
            want = (rows, c.num_kv_heads, c.head_dim)
            if not isinstance(t, torch.Tensor) or t.dtype != c.torch_dtype or tuple(t.shape) != want:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise PayloadError(f"handoff {part} of layer {i}: {got}, contract calls for {c.dtype} {want}")
            finite = _finite_rows(t)
            if finite is not None:
                bad = finite // (c.num_kv_heads * c.head_dim)
                raise PayloadError(
                    f"handoff {part} of layer {i} hold NaN or infinite values "
                    f"(first at row {bad}, position {int(pos[h.layer_rows(i)[bad]])})"
                )
