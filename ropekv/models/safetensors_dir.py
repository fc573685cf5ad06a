"""Load a transformers checkpoint directory: ``config.json`` plus safetensors weights.

Only safetensors are read (``model.safetensors``, or shards listed by ``model.safetensors.index.json``).
Pickled weights (``pytorch_model.bin``, ``*.pt`` ...) can run arbitrary code when unpickled, so they
are refused and never opened. Every safetensors file is sanity-checked (header length against file
size, tensor offsets inside the data section) before ``safetensors.safe_open`` reads it, and any
failure becomes a :class:`CheckpointError` naming the file, as does a tensor holding a NaN or an
infinity (named with its first bad index).

Tensors are cast to float32. Two kinds of tensors that transformers may save but that carry no
information of their own are dropped: ``*.rotary_emb.inv_freq`` (derived from the config) and
``lm_head.weight`` of a model with tied embeddings (a copy of ``model.embed_tokens.weight``).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import safe_open

from ..errors import CheckpointError, ConfigError, RopeKVError
from ..files import open_regular, read_json
from .config import Checkpoint, ModelConfig, fingerprint_of
from .families import canonical_weights
from .hf_config import read_model_config
from .weights import non_finite, weights_digest

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

_MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json / index.json / a safetensors header
# Bytes per element of the safetensors dtypes (others are left to the safetensors reader to judge).
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "C64": 8,
    "U64": 8,
    "U32": 4,
    "U16": 2,
}


def load_safetensors_dir(
    path: str | Path, *, layout: str = "neox", weights_digest_hint: str | None = None
) -> Checkpoint:
    """Load ``path`` (a directory written by ``save_pretrained``) into a validated :class:`Checkpoint`.

    ``layout`` is the RoPE pairing the Q/K weights are stored for; transformers checkpoints use
    ``"neox"`` (``rotate_half``). ``weights_digest_hint`` replaces hashing the weights when the caller
    already holds a verified digest of them (the converted default checkpoint stores one).
    """
    root = Path(path)
    config = read_dir_config(root, layout=layout)
    files = _weight_files(root)  # {file: [tensor names]} or {file: None} for "all tensors"
    weights: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        weights.update(_read_safetensors(file, names))
    weights = _drop_derived(canonical_weights(config, weights, str(root)), config, root)
    checkpoint_fingerprint = fingerprint_of(config, weights_digest_hint or weights_digest(weights))
    return Checkpoint(config, weights, source=str(root), fingerprint=checkpoint_fingerprint)


# ---------------------------------------------------------------------- config


def read_dir_config(path: str | Path, *, layout: str = "neox") -> ModelConfig:
    """The validated config of the checkpoint directory ``path``: reads ``config.json`` only, no tensor."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory (a transformers checkpoint is a directory with config.json)")
    return _read_config(root / "config.json", layout)


def _read_json(file: Path, error: type[RopeKVError]) -> Any:
    """Parse a JSON file (:func:`ropekv.files.read_json`); a missing file is a CheckpointError, anything
    else wrong with it (unreadable, not a regular file, too large or deep, malformed) ``error``."""
    if not file.exists() and not file.is_symlink():
        raise CheckpointError(f"{file}: missing (a transformers checkpoint directory needs it)")
    return read_json(file, file.name, error, max_bytes=_MAX_JSON_BYTES)


def _read_config(file: Path, layout: str) -> ModelConfig:
    data = _read_json(file, ConfigError)
    return read_model_config(data, source=str(file), layout=layout)


# ---------------------------------------------------------------------- which files


def _weight_files(root: Path) -> dict[Path, list[str] | None]:
    """The safetensors files to read and, for shards, the tensor names each must provide."""
    single, index = root / SINGLE_FILE, root / INDEX_FILE
    if single.is_file():
        return {single: None}
    if index.is_file():
        shards: dict[Path, list[str] | None] = dict(_read_index(root, index))
        return shards
    pickles = sorted(p.name for p in root.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{root}: only pickled weights ({', '.join(pickles[:3])}); pickles are refused and never "
            "loaded because unpickling can run arbitrary code. Convert the checkpoint to safetensors."
        )
    raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}")


def _read_index(root: Path, index: Path) -> dict[Path, list[str]]:
    data = _read_json(index, CheckpointError)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file")
    files: dict[Path, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index}: shard of tensor {name!r} must be a file name, got {shard!r}")
        # Judge the name, not where symlinks point: the HF hub cache links shards into a blobs dir.
        posix = PurePosixPath(shard.replace("\\", "/"))
        if posix.is_absolute() or ".." in posix.parts or ":" in shard:
            raise CheckpointError(f"{index}: shard {shard!r} of tensor {name!r} is outside the checkpoint directory")
        file = root.joinpath(*posix.parts)
        if not file.is_file():
            raise CheckpointError(f"{index}: shard {shard!r} (tensor {name!r}) does not exist")
        files.setdefault(file, []).append(name)
    return files


# ---------------------------------------------------------------------- reading


def _check_header(file: Path) -> None:
    """Validate the safetensors framing before the native reader sees the file.

    Layout: 8-byte little-endian header length ``n``, ``n`` bytes of JSON header, then the data
    section; every tensor's ``data_offsets`` must lie inside that data section.
    """
    f, size = open_regular(file, "safetensors file", CheckpointError)  # no FIFO, no unreadable-file traceback
    with f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8 or n > _MAX_JSON_BYTES:
            raise CheckpointError(
                f"{file}: corrupt or truncated safetensors file: header claims {n} bytes, file has {size - 8} after the length"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{file}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header: not a JSON object")
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise CheckpointError(f"{file}: corrupt safetensors header: tensor {name!r} has no valid data_offsets")
        start, end = offsets
        if not 0 <= start <= end <= data_len:
            raise CheckpointError(
                f"{file}: truncated or corrupt safetensors file: tensor {name!r} needs bytes {start}..{end} "
                f"of a {data_len}-byte data section"
            )
        shape, dtype = info.get("shape"), info.get("dtype")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise CheckpointError(f"{file}: corrupt safetensors header: tensor {name!r} has no valid shape ({shape!r})")
        itemsize = _DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
        if itemsize is not None and math.prod(shape) * itemsize != end - start:
            raise CheckpointError(
                f"{file}: corrupt safetensors header: tensor {name!r} declares {dtype} {shape} "
                f"({math.prod(shape) * itemsize} bytes) but data_offsets span {end - start} bytes"
            )


def _read_safetensors(file: Path, names: list[str] | None) -> dict[str, torch.Tensor]:
    """Tensors of one file (``names``, or all when None); floating tensors cast to float32.

    The reader memory-maps the file, and every page a read touches counts as resident for as long as
    the map lives: read under one map, a 2.5 GB file would sit in the process's resident memory (its
    peak RSS) beside the float32 copies until the last tensor. So each tensor is read under a map of
    its own, dropped once the tensor is copied out."""
    _check_header(file)
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            available = set(f.keys())
            if names is not None:
                missing = [n for n in names if n not in available]
                if missing:
                    raise CheckpointError(
                        f"{file}: index lists tensor(s) {', '.join(missing[:5])} that this shard lacks"
                    )
                unlisted = sorted(available - set(names))
                if unlisted:
                    raise CheckpointError(
                        f"{file}: holds tensor(s) {', '.join(unlisted[:5])} that {INDEX_FILE} does not map to it"
                    )
        for name in names if names is not None else sorted(available):
            with safe_open(str(file), framework="pt") as f:
                t = f.get_tensor(name)
            problem = non_finite(t)
            if problem is not None:
                raise CheckpointError(f"{file}: tensor {name!r} holds {problem}: a checkpoint's weights must be finite")
            out[name] = t.to(torch.float32) if t.is_floating_point() else t
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises SafetensorError, OSError, RuntimeError ...
        raise CheckpointError(f"{file}: unreadable safetensors file: {exc}") from None
    return out


def _drop_derived(weights: dict[str, torch.Tensor], config: ModelConfig, root: Path) -> dict[str, torch.Tensor]:
    """Remove tensors that only repeat the config or another tensor (see module docstring)."""
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings and "lm_head.weight" in weights:
        head, embed = weights["lm_head.weight"], weights.get("model.embed_tokens.weight")
        if embed is not None and (head.shape != embed.shape or not torch.equal(head, embed)):
            raise CheckpointError(
                f"{root}: config ties word embeddings but tensor lm_head.weight differs from model.embed_tokens.weight"
            )
        del weights["lm_head.weight"]
    return weights
