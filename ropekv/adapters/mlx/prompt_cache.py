"""mlx-lm prompt caches that carry their cache contract: :func:`save_checked` and :func:`load_checked`.

mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` store keys, values and each cache's counters,
but nothing about the RoPE the keys were rotated with, the model, or the window: a file loads into
any model of the same shapes and decodes wrong without a word (docs/engines/mlx.md, "Prompt caches").

:func:`save_checked` writes the same file through mlx-lm's own ``save_prompt_cache`` and adds, in its
str -> str metadata (keys without dots: mlx-lm unflattens dotted keys into nested dicts):

- ``ropekv_format`` / ``ropekv_version``;
- ``ropekv_contract``: the writer's :class:`~ropekv.contract.CacheContract` JSON, read from the loaded
  model and its caches (:mod:`.cache_contract`);
- ``ropekv_sequence``: the token count (cached tokens sit at logical positions ``0 .. n-1``, the next
  one at ``n``) and each layer's cache class, offset and ring (``max_size``, ``keep``);
- ``ropekv_checksum``: sha256 over the metadata, every tensor's name, dtype, shape and byte range,
  and the data section.

The file stays a valid mlx-lm prompt cache (``load_prompt_cache`` reads it). It is written to a
temporary file in the target's folder and renamed into place: a crash leaves no half-written file.

:func:`load_checked` believes nothing early: a regular file of bounded size; its header bounded and
validated (:mod:`.prompt_file`); ropekv's metadata present and well formed; the writer's contract
compared with the reader's (the reader's model and the caches it would use) and refused with
:class:`~ropekv.errors.ContractMismatch` naming each field and its consequence, before any tensor byte
is read; mlx-lm's own metadata (class names: mlx-lm constructs whatever class the file names)
checked against the contract; the data copied to a private file while hashed, the checksum verified;
only then does mlx-lm's ``load_prompt_cache`` build the caches (from the private copy: what it reads
is what was verified), and their counters are checked once more against the sequence record.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...contract import CacheContract
from ...errors import CacheError, ConfigError, ContractMismatch, PayloadError, RopeKVError, UsageError
from ...files import open_regular, read_exactly
from .cache_contract import SUPPORTED_CACHES, WINDOW_CACHES, dtype_name, mlx_contract, model_dtype, model_fingerprint
from .prompt_file import Header, header_bytes, read_header

FORMAT = "ropekv.mlx_prompt_cache"
VERSION = 1
PREFIX = "ropekv_"
KEY_FORMAT, KEY_VERSION = PREFIX + "format", PREFIX + "version"
KEY_CONTRACT, KEY_SEQUENCE, KEY_CHECKSUM = PREFIX + "contract", PREFIX + "sequence", PREFIX + "checksum"
MAX_TOKENS = 1 << 24
MAX_FILE_BYTES = 64 << 30
MAX_JSON_CHARS = 1 << 20
_CHUNK = 8 << 20
_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# cache.state per class: tensor count, and which entries are scalars (mlx-lm stores them as 0-d arrays)
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


@dataclass(frozen=True, eq=False)
class LoadedPromptCache:
    """What :func:`load_checked` returns: mlx-lm's cache objects (one per layer, ready for
    ``model(tokens, cache=caches)``), the contract they were written under (equal to the reader's),
    the sequence record and the caller's own metadata."""

    caches: list[Any]
    contract: CacheContract
    sequence: SavedSequence
    metadata: dict[str, str]


def reader_contract(
    model: Any, caches: Sequence[Any] | None = None, *, fingerprint: str | None = None
) -> CacheContract:
    """The contract a reader holds: ``model`` with ``caches`` (default ``make_prompt_cache(model)``, the
    caches it would prefill itself); the dtype is the one its keys are computed in."""
    if caches is None:
        from mlx_lm.models.cache import make_prompt_cache

        caches = make_prompt_cache(model)
    fp = model_fingerprint(model) if fingerprint is None else fingerprint
    return mlx_contract(model, caches, dtype=model_dtype(model), fingerprint=fp)


def save_checked(
    path: str | os.PathLike,
    cache: Sequence[Any],
    model: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    fingerprint: str | None = None,
) -> int:
    """Write ``cache`` (mlx-lm cache objects, one per layer of ``model``) to ``path`` (``*.safetensors``)
    with its contract; returns the bytes written. ``metadata``: the caller's own str -> str entries
    (no dots, not ``ropekv_*``). ``fingerprint``: :func:`~.cache_contract.model_fingerprint` of
    ``model`` when already computed."""
    target = Path(path)
    if target.suffix != ".safetensors":
        raise UsageError(f"{target}: an mlx-lm prompt cache is a .safetensors file (mlx.load reads it by suffix)")
    if not target.parent.is_dir():
        raise UsageError(f"cannot write {target}: {target.parent} is not a directory")
    user = _user_metadata(metadata)
    caches = list(cache)
    sequence = SavedSequence.of(caches)
    dtypes = {dtype_name(c.keys.dtype, f"layer {i} keys") for i, c in enumerate(caches)}
    if len(dtypes) != 1:
        raise CacheError(f"the layers' keys have different dtypes ({sorted(dtypes)})")
    fp = model_fingerprint(model) if fingerprint is None else fingerprint
    contract = mlx_contract(model, caches, dtype=dtypes.pop(), fingerprint=fp)
    meta = dict(user)
    meta.update({KEY_FORMAT: FORMAT, KEY_VERSION: str(VERSION), KEY_CONTRACT: contract.to_json()})
    meta[KEY_SEQUENCE] = sequence.to_json()
    from mlx_lm.models.cache import save_prompt_cache

    stem = f".{target.name}.{os.getpid()}"
    raw_file = target.with_name(stem + ".mlx.safetensors")
    out_file = target.with_name(stem + ".tmp")
    try:
        save_prompt_cache(str(raw_file), caches, meta)
        f, size = open_regular(raw_file, "prompt cache just written", CacheError)
        with f:
            header = read_header(f, size, str(raw_file))
            digest = _checksum_start(header.metadata, header)
            _copy_data(f, header, digest, None, str(raw_file))
            final = dict(header.metadata)
            final["0." + KEY_CHECKSUM] = "sha256:" + digest.hexdigest()
            f.seek(header.data_start)
            with open(out_file, "wb") as out:
                out.write(header_bytes(header, final))
                _copy_data(f, header, None, out, str(raw_file))
                out.flush()
                os.fsync(out.fileno())
        os.replace(out_file, target)
        return target.stat().st_size
    except OSError as exc:
        raise UsageError(f"cannot write the prompt cache {target}: {exc.strerror or exc}") from None
    finally:
        for tmp in (raw_file, out_file):
            tmp.unlink(missing_ok=True)


def load_checked(
    path: str | os.PathLike,
    model: Any,
    *,
    caches: Sequence[Any] | None = None,
    fingerprint: str | None = None,
    max_bytes: int = MAX_FILE_BYTES,
) -> LoadedPromptCache:
    """Load the prompt cache at ``path`` for ``model`` if, and only if, it was written under the
    reader's contract (``model`` with ``caches``, default ``make_prompt_cache(model)``).

    Raises ContractMismatch (exit 3) naming every differing field, UsageError for a path that is not a
    readable regular file, PayloadError for a file without ropekv's metadata, truncated, corrupt or
    inconsistent; in every case before any cache is built."""
    where = f"prompt cache {os.fspath(path)}"
    f, size = open_regular(path, "prompt cache")
    with f:
        if size > max_bytes:
            raise PayloadError(f"{where}: {size} bytes, more than the {max_bytes} accepted")
        header = read_header(f, size, where)
        writer, sequence = _ropekv_metadata(header.metadata, where)
        reader = reader_contract(model, caches, fingerprint=fingerprint)
        try:
            reader.require_compatible(writer, ours="reader", theirs="writer")
        except ContractMismatch as exc:
            raise ContractMismatch(f"{where}: {exc}", fields=exc.fields) from None
        _check_layout(header, writer, sequence, where)
        fd, private = tempfile.mkstemp(prefix="ropekv-mlx-", suffix=".safetensors")
        try:
            with os.fdopen(fd, "wb") as out:
                f.seek(0)
                raw = bytearray(header.data_start)
                read_exactly(f, memoryview(raw), where, PayloadError)
                out.write(raw)
                digest = _checksum_start(header.metadata, header)
                _copy_data(f, header, digest, out, where)
            expected = header.metadata.get("0." + KEY_CHECKSUM, "")
            if "sha256:" + digest.hexdigest() != expected:
                raise PayloadError(
                    f"{where}: checksum mismatch: the keys, values or header changed after the file was written"
                )
            built = _mlx_load(private, where)
        finally:
            os.unlink(private)
    _check_built(built, writer, sequence, where)
    user = {k[2:]: v for k, v in header.metadata.items() if k.startswith("0.") and not k.startswith("0." + PREFIX)}
    return LoadedPromptCache(caches=built, contract=writer, sequence=sequence, metadata=user)


def read_saved_contract(path: str | os.PathLike) -> tuple[CacheContract, SavedSequence]:
    """The contract and sequence record of a checked file, from its header only (no tensor is read)."""
    where = f"prompt cache {os.fspath(path)}"
    f, size = open_regular(path, "prompt cache")
    with f:
        return _ropekv_metadata(read_header(f, size, where).metadata, where)


# ---------------------------------------------------------------------- helpers


def _user_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise UsageError(f"prompt-cache metadata must map strings to strings, got {k!r}: {type(v).__name__}")
        if "." in k or k.startswith(PREFIX) or not k:
            raise UsageError(
                f"prompt-cache metadata key {k!r}: keys must be non-empty, without '.' (mlx-lm nests dotted keys) "
                f"and not start with {PREFIX!r} (ropekv's own)"
            )
        out[k] = v
    return out


def _ropekv_metadata(meta: dict[str, str], where: str) -> tuple[CacheContract, SavedSequence]:
    """The writer's contract and sequence record from mlx-lm's flattened metadata (``"0.{key}"``)."""
    mine = {k[2:]: v for k, v in meta.items() if k.startswith("0." + PREFIX)}
    if KEY_FORMAT not in mine:
        raise PayloadError(
            f"{where}: no ropekv contract in its metadata (a plain save_prompt_cache file, or not a prompt cache): "
            "the RoPE, model and window its keys were computed with are unknown, so it is not loaded"
        )
    if mine[KEY_FORMAT] != FORMAT or mine.get(KEY_VERSION) != str(VERSION):
        raise PayloadError(
            f"{where}: metadata format {mine[KEY_FORMAT]!r} version {mine.get(KEY_VERSION)!r}, "
            f"expected {FORMAT!r} version {VERSION}"
        )
    missing = [k for k in (KEY_CONTRACT, KEY_SEQUENCE, KEY_CHECKSUM) if k not in mine]
    if missing:
        raise PayloadError(f"{where}: ropekv metadata without {', '.join(missing)}")
    try:
        contract = CacheContract.from_json(mine[KEY_CONTRACT])
        sequence = SavedSequence.from_json(mine[KEY_SEQUENCE], contract.num_layers)
    except ConfigError as exc:
        raise PayloadError(f"{where}: {exc}") from None
    return contract, sequence


def _check_layout(header: Header, contract: CacheContract, sequence: SavedSequence, where: str) -> None:
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
            want = _ST_DTYPE[contract.dtype]
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


def _checksum_start(meta: dict[str, str], header: Header) -> Any:
    h = hashlib.sha256(FORMAT.encode())
    covered = {k: v for k, v in meta.items() if k != "0." + KEY_CHECKSUM}
    h.update(json.dumps(covered, sort_keys=True, separators=(",", ":")).encode())
    h.update(header.entries_json().encode())
    return h


def _copy_data(f: Any, header: Header, digest: Any, out: Any, where: str) -> None:
    """Stream the data section of ``f`` (positioned at its start) into ``digest`` and/or ``out``."""
    left = header.data_len
    buffer = bytearray(min(_CHUNK, max(left, 1)))
    while left:
        view = memoryview(buffer)[: min(len(buffer), left)]
        read_exactly(f, view, where, PayloadError)
        if digest is not None:
            digest.update(view)
        if out is not None:
            out.write(view)
        left -= len(view)


def _mlx_load(path: str, where: str) -> list[Any]:
    from mlx_lm.models.cache import load_prompt_cache

    try:
        return list(load_prompt_cache(path))
    except RopeKVError:
        raise
    except Exception as exc:  # mlx raises ValueError / RuntimeError on what it cannot read
        raise PayloadError(
            f"{where}: mlx-lm cannot load it: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None


def _check_built(caches: list[Any], contract: CacheContract, sequence: SavedSequence, where: str) -> None:
    """The caches mlx-lm built have the counters the record says (a forged offset is refused here)."""
    if len(caches) != contract.num_layers:
        raise PayloadError(f"{where}: mlx-lm built {len(caches)} caches for {contract.num_layers} layers")
    for i, (c, s) in enumerate(zip(caches, sequence.layers)):
        got = LayerState(
            type(c).__name__,
            int(c.offset),
            int(c.max_size) if s.max_size is not None else None,
            int(c.keep) if s.keep is not None else None,
        )
        if got != s:
            raise PayloadError(f"{where}: layer {i}: the file's counters give {got}, ropekv's record {s}")
        if s.kind == "RotatingKVCache" and not 0 <= int(c._idx) <= int(c.keys.shape[2]):
            raise PayloadError(f"{where}: layer {i}: ring write index {int(c._idx)} outside its {c.keys.shape[2]} rows")


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
