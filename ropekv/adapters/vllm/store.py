"""vLLM's ``ExampleConnector`` store, as ropekv reads and writes it (torch and safetensors only: no vLLM).

What a producer instance (``kv_role="kv_producer"``) writes for a prompt, read from vLLM's
``example_connector.py`` (0.32.0) and checked against a real producer's files
(engine_tests/vllm/test_store.py):

- a directory ``<shared_storage_path>/<key>``, ``key = md5(token ids as little-endian int64 bytes)``
  in hex (:func:`entry_key`; sha256 where md5 is unavailable, FIPS) over the first
  :func:`producer_tokens` tokens of the prompt only: whole blocks, and never the prompt's last token;
- in it one file per attention layer, ``<layer name>.safetensors`` (``model.layers.N.self_attn.attn``),
  holding one tensor ``kv_cache [tokens, num_kv_heads, 2 * head_dim]`` and no metadata at all.

The tensor is not keys and values by token. ``extract_kv_from_layer`` indexes the layer's paged cache
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` as ``layer[block, :, offset]``, but vLLM's CPU
attention backend does not store a token's key and value in that row: it views each block and head
as ``[2 * block_size, head_dim]``, keys in the first half and values in the second, each in the cell
order of its kernel ISA (:mod:`.kv_layout`). So row ``k * block_size + o`` of the file holds cells
``o * 2 * head_dim .. (o + 1) * 2 * head_dim`` of block ``k``'s memory: the first half of a block's rows
are its keys in the ISA's order (transposed, ``[head_dim][block_size]``, for ``vec``), the second
half its values. A consumer injects the rows back the same way, so between two vLLM instances of the
same ISA the bytes land where they came from; nothing in the file says which ISA wrote it, and a
reader that takes row ``i`` as token ``i``'s key gets other tokens' channels (:func:`read_entry`
unpacks it, :func:`write_entry` packs it).

What the store does not carry: the token ids (only their hash), the positions, the RoPE (theta,
scaling, layout), the model, the dtype's intent, the block size, the ISA, the key form. Anything with
the same layer names and the same prompt hash is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import PayloadError, RopeKVError
from ...files import open_regular, read_exactly
from ...numbers import is_int
from . import kv_layout
from .sidecar import SIDECAR

TENSOR = "kv_cache"  # the one tensor name ExampleConnector writes and reads
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 64 << 10  # a one-tensor header is ~80 bytes; a little metadata is allowed
MAX_TOKENS = 1 << 20
MAX_LAYERS = 1024
MAX_ENTRIES = 1 << 20  # names in a store directory ropekv lists
MAX_FILE_BYTES = 1 << 32  # one layer's file: 4 GiB (the embedded model's is 98 KiB for 64 tokens)
MAX_TOKEN_ID = 1 << 31
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}
_KEY = re.compile(r"[0-9a-f]{32}|[0-9a-f]{64}")  # md5, or sha256 (vLLM's safe_hash fallback)
_LAYER_NAME = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
DEFAULT_LAYER_NAME = "model.layers.{}.self_attn.attn"  # vLLM's name of a llama-family attention layer
_TEMP_PREFIX = ".ropekv-tmp-"  # not a key: list_entries and vLLM's lookup never see a half-written entry


# ---------------------------------------------------------------------- the key


def entry_key(token_ids: Sequence[int] | torch.Tensor, *, hash_name: str = "md5") -> str:
    """The directory name ExampleConnector gives the KV of exactly ``token_ids``: the hex digest of their
    bytes as little-endian int64 (``torch.tensor(ids).numpy().tobytes()`` on every platform vLLM
    runs on). ``hash_name="sha256"`` is vLLM's fallback where md5 is disabled (FIPS). Text prompts
    only: vLLM appends multimodal hashes to the bytes, which ropekv does not model."""
    ids = _token_ids(token_ids)
    data = struct.pack(f"<{len(ids)}q", *ids)
    if hash_name == "md5":
        return hashlib.md5(data, usedforsecurity=False).hexdigest()
    if hash_name == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise PayloadError(f"vLLM store key: hash_name must be 'md5' or 'sha256', got {hash_name!r}")


def producer_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """How many leading tokens of a ``num_prompt_tokens`` prompt a producer stores (and hashes):
    whole blocks of the prompt without its last token, ``(n - 1) // B * B`` (vLLM's
    ``align_to_block_size``). 64 for 70 tokens at block 32; 0 (nothing stored) below ``B + 1``."""
    _check_counts(num_prompt_tokens, block_size)
    return (num_prompt_tokens - 1) // block_size * block_size


def consumer_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """How many leading tokens of a ``num_prompt_tokens`` prompt a consumer looks up (the key it
    hashes) and injects: ``(n - 2) // B * B``, one token fewer than the producer aligns. The two differ
    when ``n % B == 1``: a 65-token prompt is stored under its first 64 tokens and looked up under 32,
    so a consumer never finds what a producer of the same prompt wrote."""
    _check_counts(num_prompt_tokens, block_size)
    return max(num_prompt_tokens - 2, 0) // block_size * block_size


# ---------------------------------------------------------------------- entries


@dataclass(frozen=True)
class StoreEntry:
    """One prompt's entry: ``directory`` (``store_dir / key``), its ``layer_names`` sorted by layer
    index (index ``i`` is layer ``i``: the indices are exactly ``0..L-1``), and ``num_tokens``, the
    tokens every layer's file holds (whole blocks, read from the files' headers)."""

    directory: Path
    key: str
    layer_names: tuple[str, ...]
    num_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.directory, Path) or not _KEY.fullmatch(self.key) or self.directory.name != self.key:
            raise PayloadError(f"vLLM store entry: directory {self.directory!s} is not named by its key {self.key!r}")
        if not self.layer_names or not all(isinstance(n, str) for n in self.layer_names):
            raise PayloadError(f"vLLM store entry {self.key}: no layer names")
        if [layer_index(n) for n in self.layer_names] != list(range(len(self.layer_names))):
            raise PayloadError(
                f"vLLM store entry {self.key}: layer names are not layers 0..{len(self.layer_names) - 1}"
            )
        if not is_int(self.num_tokens) or not 1 <= self.num_tokens <= MAX_TOKENS:
            raise PayloadError(f"vLLM store entry {self.key}: num_tokens {self.num_tokens!r} not in [1, {MAX_TOKENS}]")

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def path(self, layer: int) -> Path:
        return self.directory / f"{self.layer_names[layer]}{SUFFIX}"


def layer_index(name: str) -> int:
    """The layer index in a vLLM layer name: its one all-digit component (``model.layers.7.self_attn.attn`` -> 7)."""
    found = _LAYER_INDEX.findall(name) if _LAYER_NAME.fullmatch(name) else []
    if len(found) != 1:
        raise PayloadError(f"vLLM store: {name[:120]!r} is not a layer name with one layer index")
    return int(found[0])


def find_entry(store_dir: str | os.PathLike, token_ids: Sequence[int] | torch.Tensor) -> StoreEntry | None:
    """The entry holding exactly ``token_ids`` (their count included: pass the
    :func:`producer_tokens` / :func:`consumer_tokens` prefix of a prompt), or None when the store has
    no directory of their key. A directory that is there but is not a whole entry, or holds another
    number of tokens (a forged or colliding entry), is a :class:`PayloadError`."""
    ids = _token_ids(token_ids)
    root = _store_root(store_dir)
    entry = _entry_at(root / entry_key(ids), missing_ok=True)
    if entry is not None and entry.num_tokens != len(ids):
        raise PayloadError(
            f"vLLM store entry {entry.key} holds {entry.num_tokens} tokens under the key of {len(ids)} tokens "
            "(a forged or colliding entry)"
        )
    return entry


def list_entries(store_dir: str | os.PathLike) -> tuple[StoreEntry, ...]:
    """Every entry of the store, by key; names that are not keys (ropekv's own temp dirs) are skipped."""
    root = _store_root(store_dir)
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise PayloadError(f"cannot list the vLLM store {root}: {exc.strerror or exc}") from None
    if len(names) > MAX_ENTRIES:
        raise PayloadError(f"vLLM store {root} holds {len(names)} names, more than the {MAX_ENTRIES} ropekv lists")
    out = []
    for name in names:
        if _KEY.fullmatch(name):
            entry = _entry_at(root / name, missing_ok=False)
            assert entry is not None
            out.append(entry)
    return tuple(out)


def _store_root(store_dir: str | os.PathLike) -> Path:
    try:
        root = Path(store_dir)
    except TypeError as exc:
        raise PayloadError(f"vLLM store directory: {exc}") from None
    if not root.is_dir():
        raise PayloadError(f"vLLM store {root}: not a directory")
    return root


def _entry_at(directory: Path, *, missing_ok: bool) -> StoreEntry | None:
    if not directory.exists() and missing_ok:
        return None
    if directory.is_symlink():  # what is checked must be what the store holds, not a copy elsewhere
        raise PayloadError(f"vLLM store entry {directory}: a symbolic link, not a folder in the store (refused)")
    if not directory.is_dir():
        raise PayloadError(f"vLLM store entry {directory}: not a directory")
    try:
        files = sorted(os.listdir(directory))
    except OSError as exc:
        raise PayloadError(f"cannot list the vLLM store entry {directory}: {exc.strerror or exc}") from None
    if len(files) > MAX_LAYERS:
        raise PayloadError(f"vLLM store entry {directory}: {len(files)} files, more than {MAX_LAYERS} layers")
    names = [f[: -len(SUFFIX)] for f in files if f.endswith(SUFFIX)]
    others = [f for f in files if not f.endswith(SUFFIX) and f != SIDECAR]  # ropekv's connector adds its sidecar
    if others:
        raise PayloadError(f"vLLM store entry {directory}: unexpected files {others[:4]}")
    if not names:
        raise PayloadError(f"vLLM store entry {directory}: no layer files (a producer stopped before writing?)")
    by_index: dict[int, str] = {}
    for name in names:
        i = layer_index(name)
        if i in by_index:
            raise PayloadError(f"vLLM store entry {directory}: layer {i} twice ({by_index[i]}, {name})")
        by_index[i] = name
    missing = sorted(set(range(len(by_index))) - set(by_index))
    if missing:
        raise PayloadError(
            f"vLLM store entry {directory}: layer(s) {missing[:8]} missing of {max(by_index) + 1} "
            "(half-written, or another model's)"
        )
    ordered = tuple(by_index[i] for i in range(len(by_index)))
    counts = {_header(directory / f"{n}{SUFFIX}").shape[0] for n in ordered}
    if len(counts) != 1:
        raise PayloadError(f"vLLM store entry {directory}: layers hold different token counts {sorted(counts)}")
    return StoreEntry(directory, directory.name, ordered, counts.pop())


# ---------------------------------------------------------------------- one layer file


@dataclass(frozen=True)
class _Header:
    dtype: str  # safetensors' name: F32, BF16, F16
    shape: tuple[int, int, int]  # [tokens, num_kv_heads, 2 * head_dim]
    data_start: int
    size: int  # the whole file's


def _header(path: Path) -> _Header:
    """The validated header of one layer file: one tensor ``kv_cache`` of rank 3, a float dtype, data
    exactly filling the file. Opened once, as a regular file, reading only the header."""
    opened, size = open_regular(path, "vLLM store file", PayloadError)
    with opened as f:
        first = bytearray(8)
        if size < 8:
            raise PayloadError(f"vLLM store file {path}: {size} byte(s), truncated")
        read_exactly(f, memoryview(first), f"vLLM store file {path}", PayloadError)
        header_len = int.from_bytes(first, "little")
        if not 2 <= header_len <= min(MAX_HEADER_BYTES, size - 8):
            raise PayloadError(f"vLLM store file {path}: header length {header_len} out of bounds (not safetensors?)")
        raw = bytearray(header_len)
        read_exactly(f, memoryview(raw), f"vLLM store file {path}", PayloadError)
    where = f"vLLM store file {path}"
    try:
        header = json.loads(bytes(raw).decode("utf-8").rstrip(" "))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PayloadError(f"{where}: header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise PayloadError(f"{where}: header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise PayloadError(f"{where}: __metadata__ is not a map of strings")
    if set(header) != {TENSOR}:
        raise PayloadError(f"{where}: expected exactly one tensor {TENSOR!r}, got {sorted(header)[:4]}")
    e = header[TENSOR]
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        raise PayloadError(f"{where}: tensor entry must hold exactly dtype, shape, data_offsets")
    dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if dtype not in _ST_DTYPES:
        raise PayloadError(f"{where}: dtype {str(dtype)[:20]!r} is not one of {', '.join(_ST_DTYPES)}")
    if not (isinstance(shape, list) and len(shape) == 3 and all(is_int(s) and s >= 1 for s in shape)):
        raise PayloadError(f"{where}: shape {str(shape)[:60]} is not [tokens, num_kv_heads, 2 * head_dim]")
    need = shape[0] * shape[1] * shape[2] * _ITEMSIZE[dtype]
    if shape[0] > MAX_TOKENS or need > MAX_FILE_BYTES:
        raise PayloadError(
            f"{where}: shape {shape} ({need} bytes) beyond what ropekv reads ({MAX_FILE_BYTES} bytes a file)"
        )
    if offsets != [0, need] or 8 + header_len + need != size:
        raise PayloadError(
            f"{where}: {dtype} {shape} needs {need} data bytes; data_offsets {str(offsets)[:40]} and the file's "
            f"{size} bytes (header {8 + header_len}) do not match (truncated or padded)"
        )
    return _Header(dtype, (shape[0], shape[1], shape[2]), 8 + header_len, size)


def _load(path: Path, header: _Header) -> torch.Tensor:
    """The file's ``kv_cache`` tensor: the file is read once (its size was bounded by the header check)
    and parsed by safetensors; the file changing in between is caught by the size and shape checks."""
    from safetensors.torch import load

    opened, size = open_regular(path, "vLLM store file", PayloadError)
    with opened as f:
        if size != header.size:
            raise PayloadError(f"vLLM store file {path}: changed while reading")
        data = bytearray(header.size)
        read_exactly(f, memoryview(data), f"vLLM store file {path}", PayloadError)
    try:
        tensor = load(bytes(data))[TENSOR]
    except Exception as exc:  # safetensors' own errors: SafetensorError, KeyError...
        raise PayloadError(f"vLLM store file {path}: safetensors could not read it: {exc}") from None
    if tuple(tensor.shape) != header.shape or tensor.dtype != _ST_DTYPES[header.dtype]:
        raise PayloadError(f"vLLM store file {path}: changed while reading")
    return tensor


# ---------------------------------------------------------------------- decoding


@dataclass(frozen=True, eq=False)
class StoredKV:
    """An entry's KV decoded into logical order: ``keys[i]`` / ``values[i]`` ``[num_tokens, num_kv_heads,
    head_dim]`` of layer ``i`` (token ``t`` is the prompt's ``t``-th; what position it was rotated at
    is not in the store: ropekv.adapters.vllm.store_check recovers it)."""

    layer_names: tuple[str, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    dtype: torch.dtype
    num_tokens: int

    def __post_init__(self) -> None:
        n = len(self.layer_names)
        if not n or len(self.keys) != n or len(self.values) != n:
            raise PayloadError(f"stored KV: {n} layer names, {len(self.keys)} keys, {len(self.values)} values")
        shape = tuple(self.keys[0].shape)
        for part in (self.keys, self.values):
            for t in part:
                if tuple(t.shape) != shape or t.dtype != self.dtype or len(shape) != 3 or shape[0] != self.num_tokens:
                    raise PayloadError(f"stored KV: every layer must be {self.dtype} [{self.num_tokens}, KVH, D]")

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)


def read_entry(entry: StoreEntry, *, num_kv_heads: int, head_dim: int, block_size: int, isa: str) -> StoredKV:
    """Read and unpack every layer of ``entry`` (see the module docstring for the packing), for a model
    with ``num_kv_heads`` and ``head_dim``, written by a vLLM instance with ``block_size`` and kernel
    ``isa`` (``VLLMContract.kernel_isa``). Files that are missing, unreadable, of another shape or
    dtype, or not whole blocks are a :class:`PayloadError`; nothing else is raised."""
    _check_counts(entry.num_tokens, block_size)
    for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not is_int(value) or value < 1:
            raise PayloadError(f"read_entry: {name} must be a positive integer, got {value!r}")
    if entry.num_tokens % block_size:
        raise PayloadError(
            f"vLLM store entry {entry.key}: {entry.num_tokens} tokens are not whole blocks of {block_size}"
        )
    keys, values, dtypes = [], [], set()
    for i in range(entry.num_layers):
        path = entry.path(i)
        header = _header(path)
        want = (entry.num_tokens, num_kv_heads, 2 * head_dim)
        if header.shape != want:
            raise PayloadError(f"vLLM store file {path}: shape {list(header.shape)}, expected {list(want)}")
        dtypes.add(header.dtype)
        if len(dtypes) > 1:
            raise PayloadError(f"vLLM store entry {entry.key}: layers of different dtypes {sorted(dtypes)}")
        k, v = unpack(_load(path, header), block_size=block_size, isa=isa)
        keys.append(k)
        values.append(v)
    return StoredKV(entry.layer_names, tuple(keys), tuple(values), _ST_DTYPES[dtypes.pop()], entry.num_tokens)


def unpack(kv_cache: torch.Tensor, *, block_size: int, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)``, each ``[T, KVH, D]`` in token order, from one layer's stored
    ``kv_cache [T, KVH, 2D]`` (``T`` whole blocks): rows of a block are its block-and-head memory
    ``[2 * B * D]`` (keys' cells, then values'), each half in ``isa``'s cell order."""
    T, KVH, two_d = kv_cache.shape
    B, D = block_size, two_d // 2
    memory = _block_memory(kv_cache, B)  # [T/B, KVH, 2*B*D]
    try:
        k_order = kv_layout.key_cell_order(isa, B, D).reshape(-1)  # [B*D]
        v_order = kv_layout.value_cell_order(isa, B, D).reshape(-1)
    except RopeKVError as exc:
        raise PayloadError(f"vLLM store: {exc}") from None
    keys = memory[..., : B * D][..., k_order]  # [T/B, KVH, B*D] in (offset, channel) order
    values = memory[..., B * D :][..., v_order]

    def tokens(x: torch.Tensor) -> torch.Tensor:  # [T/B, KVH, B*D] -> [T, KVH, D]
        return x.view(T // B, KVH, B, D).permute(0, 2, 1, 3).reshape(T, KVH, D).contiguous()

    return tokens(keys), tokens(values)


def pack(keys: torch.Tensor, values: torch.Tensor, *, block_size: int, isa: str) -> torch.Tensor:
    """The inverse of :func:`unpack`: ``kv_cache [T, KVH, 2D]`` as a vLLM producer of ``isa`` stores
    ``keys`` and ``values [T, KVH, D]`` (``T`` whole blocks)."""
    T, KVH, D = keys.shape
    B = block_size
    try:
        k_order = kv_layout.key_cell_order(isa, B, D).reshape(-1)
        v_order = kv_layout.value_cell_order(isa, B, D).reshape(-1)
    except RopeKVError as exc:
        raise PayloadError(f"vLLM store: {exc}") from None

    def cells(x: torch.Tensor) -> torch.Tensor:  # [T, KVH, D] -> [T/B, KVH, B*D] in (offset, channel) order
        return x.reshape(T // B, B, KVH, D).permute(0, 2, 1, 3).reshape(T // B, KVH, B * D)

    memory = torch.empty(T // B, KVH, 2 * B * D, dtype=keys.dtype)
    memory[..., : B * D][..., k_order] = cells(keys)
    memory[..., B * D :][..., v_order] = cells(values)
    return memory.view(T // B, KVH, B, 2 * D).permute(0, 2, 1, 3).reshape(T, KVH, 2 * D).contiguous()


def _block_memory(kv_cache: torch.Tensor, B: int) -> torch.Tensor:
    """``[T/B, KVH, 2*B*D]``: each block and head's memory, the concatenation of its ``B`` stored rows."""
    T, KVH, two_d = kv_cache.shape
    return kv_cache.reshape(T // B, B, KVH, two_d).permute(0, 2, 1, 3).reshape(T // B, KVH, B * two_d)


# ---------------------------------------------------------------------- writing


def write_entry(
    store_dir: str | os.PathLike,
    token_ids: Sequence[int] | torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    *,
    isa: str,
    block_size: int,
    layer_names: Sequence[str] | None = None,
    overwrite: bool = False,
) -> StoreEntry:
    """Write the KV of exactly ``token_ids`` (``T``, whole blocks) as an ExampleConnector entry a vLLM
    consumer of kernel ``isa`` and ``block_size`` injects: per layer ``keys[i]`` / ``values[i]`` ``[T, KVH, D]``
    in one float dtype, packed (:func:`pack`) into ``<layer name>.safetensors``. ``layer_names``
    default to vLLM's llama-family names. A consumer hits it for a prompt ``P`` with ``P[:T] == token_ids``
    and :func:`consumer_tokens` ``(len(P)) == T``.

    Atomic: the files are written into a temp directory beside the entry, which is renamed into place
    only when complete, so neither vLLM nor :func:`find_entry` ever sees a half-written entry; on any
    error the store is as it was. An existing entry is refused unless ``overwrite``."""
    ids = _token_ids(token_ids)
    T = len(ids)
    _check_counts(T, block_size)
    if T % block_size:
        raise PayloadError(f"write_entry: {T} tokens are not whole blocks of {block_size}")
    keys, values = tuple(keys), tuple(values)
    names = tuple(DEFAULT_LAYER_NAME.format(i) for i in range(len(keys))) if layer_names is None else tuple(layer_names)
    if not keys or len(values) != len(keys) or len(names) != len(keys) or len(keys) > MAX_LAYERS:
        raise PayloadError(
            f"write_entry: {len(keys)} key, {len(values)} value tensors and {len(names)} layer names must be equal "
            f"and in [1, {MAX_LAYERS}]"
        )
    if [layer_index(n) for n in names] != list(range(len(names))):
        raise PayloadError("write_entry: layer names must be layers 0..L-1, in order")
    shape, dtype = tuple(keys[0].shape), keys[0].dtype
    for t in keys + values:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            raise PayloadError("write_entry: every key and value tensor must have the first key's shape and dtype")
    if len(shape) != 3 or shape[0] != T or dtype not in _ST_DTYPES.values():
        raise PayloadError(
            f"write_entry: tensors must be [{T}, KVH, D] float32/bfloat16/float16, got {dtype} {list(shape)}"
        )
    root = _store_root(store_dir)
    key = entry_key(ids)
    final = root / key
    if final.exists() and not overwrite:
        raise PayloadError(f"vLLM store entry {final} already exists")
    from safetensors.torch import save_file

    packed = [pack(k.detach().cpu(), v.detach().cpu(), block_size=block_size, isa=isa) for k, v in zip(keys, values)]
    try:
        temp = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=root))
    except OSError as exc:
        raise PayloadError(f"cannot write into the vLLM store {root}: {exc.strerror or exc}") from None
    old = None
    try:
        for name, kv in zip(names, packed):
            save_file({TENSOR: kv}, str(temp / f"{name}{SUFFIX}"))
        if final.exists():  # overwrite: move the old entry aside first, remove it once the new one is in place
            old = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=root))
            os.replace(final, old / key)
        os.replace(temp, final)
    except Exception as exc:
        shutil.rmtree(temp, ignore_errors=True)
        if old is not None and (old / key).exists() and not final.exists():
            os.replace(old / key, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if isinstance(exc, RopeKVError):
            raise
        raise PayloadError(f"cannot write the vLLM store entry {final}: {exc}") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return StoreEntry(final, key, names, T)


# ---------------------------------------------------------------------- checks


def _token_ids(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.is_floating_point() or token_ids.is_complex():
            raise PayloadError("vLLM store: token ids must be a 1-D integer tensor")
        ids = [int(t) for t in token_ids.tolist()]
    else:
        if isinstance(token_ids, (str, bytes)) or not all(is_int(t) for t in token_ids):
            raise PayloadError("vLLM store: token ids must be integers")
        ids = [int(t) for t in token_ids]
    if not 1 <= len(ids) <= MAX_TOKENS:
        raise PayloadError(f"vLLM store: {len(ids)} token ids, expected 1..{MAX_TOKENS}")
    bad = next((t for t in ids if not 0 <= t < MAX_TOKEN_ID), None)
    if bad is not None:
        raise PayloadError(f"vLLM store: token id {bad} outside [0, 2**31)")
    return ids


def _check_counts(num_tokens: int, block_size: int) -> None:
    if not is_int(block_size) or not 1 <= block_size <= 1 << 16:
        raise PayloadError(f"vLLM store: block_size must be an integer in [1, 65536], got {block_size!r}")
    if not is_int(num_tokens) or not 0 <= num_tokens <= MAX_TOKENS:
        raise PayloadError(f"vLLM store: token count {num_tokens!r} not in [0, {MAX_TOKENS}]")


__all__ = [
    "DEFAULT_LAYER_NAME",
    "StoreEntry",
    "StoredKV",
    "consumer_tokens",
    "entry_key",
    "find_entry",
    "layer_index",
    "list_entries",
    "pack",
    "producer_tokens",
    "read_entry",
    "unpack",
    "write_entry",
]
