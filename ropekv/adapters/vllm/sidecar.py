"""The contract a vLLM KV store entry carries: a JSON sidecar beside the connector's per-layer files.

vLLM's ExampleConnector stores a prompt's KV as ``<store>/<hash of the token ids>/<layer>.safetensors``
(one tensor ``kv_cache`` per attention layer, whole blocks only) and nothing else: a consumer running
another RoPE, model, dtype or kernel layout loads the files without a word. The contract connector
(:mod:`.connector`) writes :data:`SIDECAR` into the same folder after every layer file is on disk: the
producer's :class:`EngineContract` (its :class:`~ropekv.contract.CacheContract` plus what vLLM adds:
cache dtype, kernel ISA, attention backend, layer names), the tokens and positions the entry holds,
and the sha256 of each layer file. A consumer compares it with its own before it reports a single
matched token (:func:`compare`, :func:`verify_files`), and refuses with the handshake's wording.

This module imports nothing from vLLM, so the format is tested in ropekv's own environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ...contract import CacheContract, FieldDiff, consequence, mismatch
from ...errors import ConfigError, ContractMismatch
from ...files import open_regular, read_exactly

SIDECAR = "ropekv-contract.json"
REFUSALS = "ropekv-refusals.jsonl"  # one JSON line per refused load, at the top of the store
RUN_KEY = "ropekv_run"  # kv_connector_extra_config: the run id the connector marks its refusals with
FORMAT = "ropekv.vllm_kv_entry"
FORMAT_VERSION = 1
MAX_SIDECAR_BYTES = 1 << 20  # a contract and a few hundred layers take a few tens of KiB
MAX_LAYERS = 1024
MAX_LAYER_FILE_BYTES = 1 << 36  # 64 GiB: one layer of a long prompt of a large model stays far below
MAX_TOKENS = 1 << 24
LAYER_HEADER_BYTES = 64 << 10  # a layer file's safetensors header: ~80 bytes for its one tensor, some metadata
MAX_ITEMSIZE = 4  # bytes per cached value: float32 at most (bfloat16, float16 2, fp8 1)
Policy = Literal["fail", "recompute"]  # vLLM's KVTransferConfig.kv_load_failure_policy
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LAYER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")  # a file name in the entry, never a path

# What goes wrong when a field of the entry beyond the cache contract's own is ignored.
_CONSEQUENCES: dict[str, str] = {
    "sidecar": (
        "the entry carries no readable contract (never written, half-written, or written by another "
        "connector): nothing says which model, RoPE, dtype or layout produced its keys"
    ),
    "checksum": (
        "the layer's file is not the one the producer wrote (truncated, overwritten or corrupted after "
        "it was stored): its keys and values are not the ones the producer computed"
    ),
    "contract": "this instance has no contract of its own to compare with: nothing can be checked",
    "kv_cache_dtype": "cache bytes would be read as another element type (e.g. fp8 vs the model dtype): garbage",
    "kernel_isa": (
        "vLLM's CPU kernels keep each block's keys in an ISA-specific order (vec: channel-major, amx: VNNI "
        "tiles): the copied bytes would be read in another order"
    ),
    "attention_backend": "another attention backend lays the paged cache out otherwise: rows would be misread",
    "kv_row_shape": "per-token rows have another shape (heads, channels): tensors would not fit, or be misread",
    "layer_names": "files are matched to layers by name: layers would read another layer's keys, or none",
    "injected": (
        "the paged cache no longer holds the rows the connector injected (changed after the injection, "
        "before attention read them: e.g. keys turned to other positions): attention would read other "
        "keys and values than the producer's"
    ),
    "tokens": "the entry holds the KV of other tokens than the request's prompt: attention would read another text",
    "positions": (
        "the stored keys were rotated at other positions than the ones this request gives its tokens: "
        "every key would sit at the wrong angle"
    ),
}


def entry_consequence(diff: FieldDiff) -> str:
    """What goes wrong if ``diff`` (a cache contract field or one of the entry's own) is ignored."""
    head = diff.field.split(".", 1)[0]
    if head in _CONSEQUENCES:
        return _CONSEQUENCES[head]
    return consequence(diff)


def refusal(diffs: list[FieldDiff]) -> ContractMismatch:
    """The consumer's refusal of an entry: the handshake's wording (``consumer`` reads, ``producer`` wrote)."""
    return mismatch(diffs, ours="consumer", theirs="producer", explain=entry_consequence)


@dataclass(frozen=True)
class EngineContract:
    """What one vLLM instance's cached KV means: ``contract`` (model fingerprint, per-layer RoPE as vLLM
    runs it, key form, block size, dtype of the cached bytes) and what vLLM adds to it: its
    ``kv_cache_dtype`` setting, the CPU kernel ISA and attention backend that fix the order of bytes in
    a block, the per-token row shape of a stored file (``[num_kv_heads, 2 * head_dim]`` on CPU) and the
    attention layers' names, in model order (a stored file per name)."""

    contract: CacheContract
    kv_cache_dtype: str
    kernel_isa: str
    attention_backend: str
    kv_row_shape: tuple[int, ...]
    layer_names: tuple[str, ...]

    def __post_init__(self) -> None:
        for name in ("kv_cache_dtype", "kernel_isa", "attention_backend"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > 200:
                raise ConfigError(f"vLLM entry contract: {name} must be a non-empty string, got {value!r}")
        if not 1 <= len(self.kv_row_shape) <= 4 or not all(_is_int(d, 1, 1 << 20) for d in self.kv_row_shape):
            raise ConfigError(
                f"vLLM entry contract: kv_row_shape must be 1-4 sizes in [1, 2**20], got {self.kv_row_shape}"
            )
        names = self.layer_names
        if not 1 <= len(names) <= MAX_LAYERS or len(set(names)) != len(names):
            raise ConfigError(
                f"vLLM entry contract: layer_names must be 1..{MAX_LAYERS} distinct names, got {len(names)}"
            )
        for name in names:
            if not isinstance(name, str) or not _LAYER_NAME.fullmatch(name):
                raise ConfigError(f"vLLM entry contract: layer name {name!r} is not a plain file name")

    def diff(self, other: EngineContract) -> list[FieldDiff]:
        """Every differing field: the cache contract's (``rope.theta``), then vLLM's own."""
        diffs = self.contract.diff(other.contract)
        for f in dataclasses.fields(self):
            if f.name != "contract" and getattr(self, f.name) != getattr(other, f.name):
                diffs.append(FieldDiff(f.name, getattr(self, f.name), getattr(other, f.name)))
        return diffs

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["contract"] = json.loads(self.contract.to_json())
        d["kv_row_shape"], d["layer_names"] = list(self.kv_row_shape), list(self.layer_names)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> EngineContract:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ConfigError(f"vLLM entry contract must be an object with exactly {sorted(names)}")
        for name in ("kv_row_shape", "layer_names"):
            if not isinstance(data[name], list):
                raise ConfigError(f"vLLM entry contract: {name} must be a list")
        return cls(
            contract=CacheContract.from_json(json.dumps(data["contract"])),
            kv_cache_dtype=data["kv_cache_dtype"],
            kernel_isa=data["kernel_isa"],
            attention_backend=data["attention_backend"],
            kv_row_shape=tuple(data["kv_row_shape"]),
            layer_names=tuple(data["layer_names"]),
        )


@dataclass(frozen=True)
class LayerFile:
    """One stored layer file of an entry: its name in the folder, its size and its sha256."""

    name: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.endswith(".safetensors") or "/" in self.name:
            raise ConfigError(f"vLLM entry: layer file {self.name!r} must be a .safetensors file name")
        if not _is_int(self.size, 1, MAX_LAYER_FILE_BYTES):
            raise ConfigError(f"vLLM entry: layer file size must be in [1, {MAX_LAYER_FILE_BYTES}], got {self.size!r}")
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise ConfigError(f"vLLM entry: sha256 of {self.name} must be 64 lowercase hex digits")


@dataclass(frozen=True)
class Sidecar:
    """One store entry's record: the producer's :class:`EngineContract`; ``key`` (the entry's folder
    name); the stored tokens (``tokens_sha256`` over their int64 ids) at positions
    ``position_start .. position_start + num_tokens - 1``; one :class:`LayerFile` per layer, in the
    order of ``engine.layer_names``."""

    engine: EngineContract
    key: str
    num_tokens: int
    position_start: int
    tokens_sha256: str
    layers: tuple[LayerFile, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not _LAYER_NAME.fullmatch(self.key):
            raise ConfigError(f"vLLM entry: key {self.key!r} is not a plain folder name")
        if not _is_int(self.num_tokens, 1, MAX_TOKENS) or not _is_int(self.position_start, 0, MAX_TOKENS):
            raise ConfigError(
                f"vLLM entry: num_tokens must be in [1, {MAX_TOKENS}] and position_start in [0, {MAX_TOKENS}], "
                f"got {self.num_tokens!r}, {self.position_start!r}"
            )
        if not isinstance(self.tokens_sha256, str) or not _SHA256.fullmatch(self.tokens_sha256):
            raise ConfigError("vLLM entry: tokens_sha256 must be 64 lowercase hex digits")
        expected = tuple(f"{n}.safetensors" for n in self.engine.layer_names)
        if tuple(f.name for f in self.layers) != expected:
            raise ConfigError("vLLM entry: one layer file per layer name, in the same order")

    def to_json(self) -> str:
        d = {"format": FORMAT, "version": FORMAT_VERSION, "engine": self.engine.to_dict()}
        for f in dataclasses.fields(self):
            if f.name not in ("engine", "layers"):
                d[f.name] = getattr(self, f.name)
        d["layers"] = [dataclasses.asdict(layer) for layer in self.layers]
        return json.dumps(d, sort_keys=True, indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> Sidecar:
        """Inverse of :meth:`to_json`; anything malformed is :class:`~ropekv.errors.ConfigError`."""
        try:
            data = json.loads(text)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ConfigError(f"vLLM entry sidecar does not parse: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
            raise ConfigError(f"vLLM entry sidecar: expected format {FORMAT!r} version {FORMAT_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)} | {"format", "version"}
        if set(data) != names:
            raise ConfigError(f"vLLM entry sidecar must have exactly the fields {sorted(names)}")
        layers = data["layers"]
        if not isinstance(layers, list) or len(layers) > MAX_LAYERS or not all(isinstance(x, dict) for x in layers):
            raise ConfigError(f"vLLM entry sidecar: layers must be a list of at most {MAX_LAYERS} objects")
        try:
            return cls(
                engine=EngineContract.from_dict(data["engine"]),
                key=data["key"],
                num_tokens=data["num_tokens"],
                position_start=data["position_start"],
                tokens_sha256=data["tokens_sha256"],
                layers=tuple(LayerFile(**x) for x in layers),
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"vLLM entry sidecar has a value of the wrong type: {exc}") from None


def tokens_digest(token_ids: list[int]) -> str:
    """sha256 over the int64 little-endian bytes of ``token_ids`` (what the entry holds, in order)."""
    h = hashlib.sha256()
    for t in token_ids:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return h.hexdigest()


def file_digest(path: Path) -> tuple[int, str]:
    """``(size, sha256)`` of the regular file ``path``; ConfigError if it cannot be read."""
    data = read_layer_file(path, MAX_LAYER_FILE_BYTES)
    return len(data), hashlib.sha256(data).hexdigest()


def read_layer_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` (a regular file of at most ``limit`` bytes), read once."""
    f, size = open_regular(path, "vLLM KV entry file", ConfigError)
    with f:
        if size > limit:
            raise ConfigError(f"{path}: {size} bytes, more than the {limit} expected")
        buffer = bytearray(size)
        read_exactly(f, memoryview(buffer), str(path), ConfigError)
        return bytes(buffer)


def write_sidecar(folder: Path, sidecar: Sidecar) -> Path:
    """Write ``sidecar`` into ``folder`` atomically (a temporary file, fsync, rename): a reader sees the
    whole sidecar or none. Called only after every layer file is written, so a sidecar never describes
    KV that is not yet on disk."""
    path = folder / SIDECAR
    tmp = folder / f".{SIDECAR}.{os.getpid()}.tmp"
    data = sidecar.to_json().encode()
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_sidecar(folder: Path) -> Sidecar | None:
    """The sidecar of the entry ``folder``; None when it has none. A malformed one is ConfigError."""
    path = folder / SIDECAR
    if not path.exists():
        return None
    return Sidecar.from_json(read_layer_file(path, MAX_SIDECAR_BYTES))


def compare(ours: EngineContract, theirs: Sidecar, token_ids: list[int]) -> list[FieldDiff]:
    """What the consumer ``ours`` and the entry ``theirs`` disagree on, for a request whose first
    ``theirs.num_tokens`` prompt tokens are ``token_ids`` (the ones the entry would be loaded for, at
    positions ``0..``): the engine contracts, the tokens, the positions."""
    diffs = ours.diff(theirs.engine)
    if len(token_ids) != theirs.num_tokens:
        diffs.append(FieldDiff("tokens", f"{len(token_ids)} tokens", f"{theirs.num_tokens} tokens"))
    elif tokens_digest(token_ids) != theirs.tokens_sha256:
        diffs.append(FieldDiff("tokens", tokens_digest(token_ids)[:16], theirs.tokens_sha256[:16]))
    if theirs.position_start != 0:
        diffs.append(
            FieldDiff(
                "positions",
                f"0..{len(token_ids) - 1}",
                f"{theirs.position_start}..{theirs.position_start + theirs.num_tokens - 1}",
            )
        )
    return diffs


def layer_bytes_bound(sidecar: Sidecar) -> int:
    """The most bytes one layer file of ``sidecar``'s entry can hold: its ``num_tokens`` rows of
    ``kv_row_shape`` values of at most :data:`MAX_ITEMSIZE` bytes, and a header. Checked against what
    the sidecar declares before a file is read, so a sidecar declaring a 20 GiB layer for 64 tokens is
    refused without reading (or allocating) it. ``compare`` has checked the rows and the token count
    against the consumer's own first."""
    values = sidecar.num_tokens
    for d in sidecar.engine.kv_row_shape:
        values *= d
    return 8 + LAYER_HEADER_BYTES + values * MAX_ITEMSIZE


def entry_location(store: Path, folder: Path) -> list[FieldDiff]:
    """The entry ``folder`` must be a folder directly inside ``store``, not a symbolic link (to a copy
    elsewhere, or anything else): what is checked and injected is then what the store holds. A
    ``FieldDiff`` named ``entry`` otherwise (none when it is)."""
    if folder.is_symlink():
        try:
            target = os.readlink(folder)
        except OSError as exc:
            target = exc.strerror or str(exc)
        return [FieldDiff("entry", "a folder inside the store", f"a symbolic link to {str(target)[:160]}")]
    if folder.exists() and Path(os.path.realpath(folder)).parent != Path(os.path.realpath(store)):
        return [FieldDiff("entry", "a folder inside the store", f"a folder at {os.path.realpath(folder)[:160]}")]
    return []


def verify_files(folder: Path, sidecar: Sidecar) -> tuple[list[FieldDiff], dict[str, bytes]]:
    """Read every layer file of the entry once and check it against the sidecar: ``(diffs, bytes by
    layer name)``; a differing layer ``i`` is ``checksum.layers.{i}``. What is checked is what the
    caller injects (the bytes returned), so a file changed after the check cannot slip in. A layer the
    sidecar declares larger than its entry can be (:func:`layer_bytes_bound`), or a layer file that is
    a symbolic link, is refused without being read."""
    diffs, data = [], {}
    bound = layer_bytes_bound(sidecar)
    for i, (name, layer) in enumerate(zip(sidecar.engine.layer_names, sidecar.layers)):
        field = f"checksum.layers.{i}"
        if layer.size > bound:
            diffs.append(
                FieldDiff(
                    field,
                    f"at most {bound} bytes ({sidecar.num_tokens} tokens of {list(sidecar.engine.kv_row_shape)})",
                    f"{layer.size} bytes declared",
                )
            )
            continue
        if (folder / layer.name).is_symlink():
            diffs.append(FieldDiff(field, "a file inside the entry", "a symbolic link"))
            continue
        try:
            raw = read_layer_file(folder / layer.name, layer.size)
        except ConfigError as exc:
            diffs.append(FieldDiff(field, str(exc).split(": ", 1)[-1][:160], f"{layer.size} bytes"))
            continue
        digest = hashlib.sha256(raw).hexdigest()
        if len(raw) != layer.size or digest != layer.sha256:
            diffs.append(
                FieldDiff(
                    field, f"{len(raw)} bytes sha256 {digest[:16]}", f"{layer.size} bytes sha256 {layer.sha256[:16]}"
                )
            )
        else:
            data[name] = raw
    return diffs, data


def append_refusal(
    store: Path, *, request_id: str, key: str, error: ContractMismatch, policy: Policy, run: str | None = None
) -> dict:
    """Append one JSON line ``{"request_id", "key", "fields", "message", "policy", "run"}`` to the store's
    :data:`REFUSALS` (one ``write`` of the whole line on a file opened for appending). ``run``: the id
    of the run whose connector refused (``kv_connector_extra_config["ropekv_run"]``), so a reader of a
    store that outlives runs counts its own run's refusals only (:mod:`ropekv.handoff.refusals`)."""
    record = {
        "request_id": request_id,
        "key": key,
        "fields": list(error.fields),
        "message": str(error),
        "policy": policy,
        "run": run,
    }
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(store / REFUSALS, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return record


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
