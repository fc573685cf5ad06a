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
from .cache_contract import dtype_name, mlx_contract, model_dtype, model_fingerprint
from .prompt_file import Header, header_bytes, read_header
from .prompt_record import LayerState, SavedSequence, check_layout

FORMAT = "ropekv.mlx_prompt_cache"
VERSION = 1
PREFIX = "ropekv_"
KEY_FORMAT, KEY_VERSION = PREFIX + "format", PREFIX + "version"
KEY_CONTRACT, KEY_SEQUENCE, KEY_CHECKSUM = PREFIX + "contract", PREFIX + "sequence", PREFIX + "checksum"
MAX_FILE_BYTES = 64 << 30
_CHUNK = 8 << 20


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
        check_layout(header, writer, sequence, where)
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
