"""The files of the FlashInfer GPU check: the bundle that travels to the GPU, and the recordings that
come back. Both are safetensors files with one JSON metadata entry, read here with torch, safetensors
and json only (the GPU machine has no more of ropekv than this package).

- the bundle (``weights.safetensors``): the truncated model's layers in the dtype they were rounded
  to, ``embeddings [T, hidden]`` (the embedding rows of the check's token stream, same dtype) and
  ``tokens [T]``; the metadata holds the :class:`~ropekv.adapters.flashinfer.model.Shapes`, the cases,
  the model fingerprint the reference must match and the rows the full forward is probed at;
- a recording: the tensors :mod:`~ropekv.adapters.flashinfer.driver` produced for one dtype and
  :class:`~ropekv.adapters.flashinfer.driver.Setup` (cases ``c0.``, ``c1.``, ... and the full forward),
  with the versions, the device and the seconds it took in its metadata. A recording may be
  xz-compressed (``.safetensors.xz``, as the ones kept under docs/engines/flashinfer/ are).

Everything read is bounded before use: a recording is a file from another machine.
"""

from __future__ import annotations

import json
import lzma
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from ...errors import UsageError
from ...files import regular_file_size
from .model import Shapes

BUNDLE_FORMAT = "ropekv.flashinfer_bundle"
RECORDING_FORMAT = "ropekv.flashinfer_recording"
VERSION = 1
META_KEY = "ropekv.flashinfer"
WEIGHTS_FILE = "weights.safetensors"
MAX_FILE_BYTES = 512 * 1024 * 1024  # a bundle of a few layers is tens of MB; a recording a few MB
MAX_LENGTH = 480  # prompt tokens per case (the probe reads every key: driver.MAX_PROBED_KEYS)
MAX_STEPS = 16
MAX_CASES = 8
DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BundleCase:
    """A case the GPU runs: ``length`` prompt tokens (no prefix hit), pages of ``block_size`` entries,
    ``decode_steps`` decoded tokens."""

    length: int
    block_size: int
    decode_steps: int

    def __post_init__(self) -> None:
        for name, high in (("length", MAX_LENGTH), ("block_size", 1024), ("decode_steps", MAX_STEPS)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= high:
                raise UsageError(f"FlashInfer case: {name} must be an integer in 1..{high}, got {v!r}")

    @property
    def total(self) -> int:
        return self.length + self.decode_steps


@dataclass(frozen=True, eq=False)
class Bundle:
    shapes: Shapes
    weights: dict[str, torch.Tensor]
    embeddings: torch.Tensor  # [T, hidden]
    tokens: torch.Tensor  # [T] int64
    cases: tuple[BundleCase, ...]
    meta: dict[str, Any] = field(default_factory=dict)  # fingerprint, seed, source, weight_dtype, rows

    @property
    def full_rows(self) -> list[int]:
        """The rows of the full forward: every case's decode positions (a cache-free forward serves all)."""
        return sorted({c.length + s for c in self.cases for s in range(c.decode_steps)})


def save_bundle(bundle: Bundle, folder: str | os.PathLike[str]) -> Path:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {**bundle.weights, "embeddings": bundle.embeddings, "tokens": bundle.tokens}
    meta = {
        "format": BUNDLE_FORMAT,
        "version": VERSION,
        "shapes": bundle.shapes.to_dict(),
        "cases": [c.__dict__ for c in bundle.cases],
        **bundle.meta,
    }
    path = out / WEIGHTS_FILE
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={META_KEY: json.dumps(meta)})
    return path


def load_bundle(folder: str | os.PathLike[str]) -> Bundle:
    tensors, meta = _read(Path(folder) / WEIGHTS_FILE, BUNDLE_FORMAT, "FlashInfer bundle")
    try:
        shapes = Shapes(**meta["shapes"])
        cases = tuple(BundleCase(**c) for c in meta["cases"])
    except (KeyError, TypeError) as exc:
        raise UsageError(f"FlashInfer bundle: malformed metadata ({exc})") from None
    if not 1 <= len(cases) <= MAX_CASES:
        raise UsageError(f"FlashInfer bundle: 1..{MAX_CASES} cases, got {len(cases)}")
    embeddings, tokens = tensors.pop("embeddings", None), tensors.pop("tokens", None)
    if embeddings is None or tokens is None or embeddings.dim() != 2 or embeddings.shape[1] != shapes.hidden_size:
        raise UsageError("FlashInfer bundle: embeddings [T, hidden] and tokens [T] are needed")
    if tokens.shape != (embeddings.shape[0],) or embeddings.shape[0] < max(c.total for c in cases):
        raise UsageError("FlashInfer bundle: one embedding row per token, as many as the longest case")
    rest = {k: v for k, v in meta.items() if k not in ("format", "version", "shapes", "cases")}
    return Bundle(shapes, tensors, embeddings, tokens, cases, rest)


def save_recording(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    full = {"format": RECORDING_FORMAT, "version": VERSION, **meta}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={META_KEY: json.dumps(full)})


def load_recording(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A recording's tensors and metadata, from ``.safetensors`` or ``.safetensors.xz``."""
    p = Path(path)
    if p.suffix == ".xz":
        return _read_xz(p, RECORDING_FORMAT, "FlashInfer recording")
    return _read(p, RECORDING_FORMAT, "FlashInfer recording")


def _read(path: Path, fmt: str, what: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    size = regular_file_size(path, what)
    if size > MAX_FILE_BYTES:
        raise UsageError(f"{what} {path}: {size} bytes, more than the {MAX_FILE_BYTES} this check reads")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in list(f.keys())}
    except Exception as exc:  # safetensors raises its own SafetensorError for a damaged file
        raise UsageError(f"{what} {path}: not a readable safetensors file ({exc})") from None
    return tensors, _meta(raw, path, fmt, what)


def _read_xz(path: Path, fmt: str, what: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An xz-compressed safetensors file, decompressed in memory up to :data:`MAX_FILE_BYTES`."""
    size = regular_file_size(path, what)
    if size > MAX_FILE_BYTES:
        raise UsageError(f"{what} {path}: {size} bytes, more than the {MAX_FILE_BYTES} this check reads")
    decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        data = decompressor.decompress(path.read_bytes(), max_length=MAX_FILE_BYTES + 1)
    except lzma.LZMAError as exc:
        raise UsageError(f"{what} {path}: not a readable xz file ({exc})") from None
    if len(data) > MAX_FILE_BYTES or not decompressor.eof:
        raise UsageError(f"{what} {path}: truncated, or more than {MAX_FILE_BYTES} bytes once decompressed")
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n]) if 8 + n <= len(data) else None
        tensors = load_bytes(data)
    except Exception as exc:  # a damaged header or tensor table, whatever safetensors calls it
        raise UsageError(f"{what} {path}: not a readable safetensors file ({exc})") from None
    raw = header.get("__metadata__", {}).get(META_KEY) if isinstance(header, dict) else None
    return tensors, _meta(raw, path, fmt, what)


def _meta(raw: object, path: Path, fmt: str, what: str) -> dict[str, Any]:
    try:
        meta = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != fmt or meta.get("version") != VERSION:
        raise UsageError(f"{what} {path}: not a {fmt} file of version {VERSION}")
    return meta
