"""A folder of float64 reference results, computed once and reused by every later check of the model.

The reference side of a check (:mod:`ropekv.parity.harness`) depends only on the model, the case's
rows and attention kind, the token stream and ropekv's reference code, never on the engine under test:
ropekv's engine with raw or rotated keys, the HF adapter or vLLM on the same weights all compare
against the same rows. So ``ropekv check --reference-cache DIR`` stores each case's reference rows
(per decode position: the next-token logits, and per layer the input hidden state and the attention
logits over every key, exactly what :func:`~ropekv.parity.compare.compare_step` reads) and later
checks read them back instead of running the float64 forward again. The engine side is never stored.

One entry is one safetensors file (never pickle), named by its key: the sha256 of a canonical JSON of
everything the rows depend on (:func:`entry_fields`): the model's computation fingerprint (config
semantics and every weight byte, in the neox presentation of the Q/K rows, so llama.cpp's gptj
presentation of the same weights shares its entries: :mod:`ropekv.models.computed`), the reference
dtype, the case's probed positions and attention (window, sinks, the model's own per-layer kinds, an image span, a cache operation), a sha256 of the tokens those rows
read, ropekv's version, a digest of the source of the code that computes the rows, and torch's
version. The key fields are stored in the file's metadata too and compared on read, with a sha256 of
the tensors' bytes. A missing entry is computed; an entry that fails any check (too large, truncated,
unparsable, another key, a checksum mismatch, tensors of the wrong shape, a value not finite, a cost
beyond :data:`MAX_SECONDS`) is recomputed and overwritten, and the report says so.

The key and the checksum are computable by anyone, so they catch accidents, not forgeries: every
read also recomputes layer 0 of each stored row with the float64 reference of this process and
compares it (:func:`sample_mismatch`, called by :mod:`ropekv.parity.references`), so rows computed
with other RoPE angles, scaled, or of another model are recomputed. Rows forged to agree in layer 0
and differ later are not caught: the folder is trusted for that (docs/performance.md). A process that
imported adapter code (:mod:`ropekv.user_code`) writes no entry unless the store trusts it
(``trust_engine``). Entries are written with mode 0644. Writes go to a temporary file in the folder, then
``os.replace``: a reader sees the old entry or the new one, never a mix, and two checks writing the
same entry at once leave one whole copy.

Attention rows are stored without their trailing columns that hold no key (``-inf``: keys after the
query position, by causality), so a short case's rows are small even when they came from a long
forward shared with other cases; on read they are padded back to the width the current check's own
full forwards have. Floating-point rounding of a forward can depend on its length in the last bit,
so a row computed inside a longer forward may differ from a fresh one by about 1e-16 (relative); the
same model and cases give bitwise the same rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from .. import user_code
from ..errors import RopeKVError, UsageError
from ..files import open_regular, read_exactly
from .cases import Case
from .compare import NextToken, RefRow

ENTRY_FORMAT = "ropekv.reference-rows"
ENTRY_VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # 30 layers x 3 rows is ~10 KB of header; anything past this is not ours
SUFFIX = ".safetensors"
MAX_SECONDS = 1e7  # an entry's recorded cost (about 116 days); a larger figure is not a measurement
ENTRY_MODE = 0o644  # entries are shared: another user's check of the model reads them too

ReferenceSource = Literal["cache hit", "computed", "recomputed (corrupt entry)"]
HIT: ReferenceSource = "cache hit"
COMPUTED: ReferenceSource = "computed"
RECOMPUTED: ReferenceSource = "recomputed (corrupt entry)"

# The code whose output an entry holds: the reference decoder and everything it reads (RoPE, configs,
# families, MoE, MLA), and the parity code that turns its probes into rows (masks, attention logits,
# the cases' positions and streams, the operations' own references). An edit to any of them makes
# new keys, so a development checkout never reads rows an older version of the code computed.
_CODE_ROOT = Path(__file__).resolve().parent.parent  # the ropekv package
_CODE_FILES = (
    "rope.py",
    "probe.py",
    "attention_kind.py",
    "numbers.py",
    "parity/cases.py",
    "parity/compare.py",
    "parity/recorder.py",
    "parity/ops.py",
    "parity/references.py",
    "parity/reference_cache.py",
)


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the source of the reference path (``models/*.py`` and :data:`_CODE_FILES`)."""
    h = hashlib.sha256()
    files = sorted((_CODE_ROOT / "models").glob("*.py")) + [_CODE_ROOT / f for f in _CODE_FILES]
    for path in files:
        h.update(str(path.relative_to(_CODE_ROOT)).encode() + b"\0")
        try:
            h.update(path.read_bytes())
        except OSError:  # a zipped or stripped install: the file's absence is part of the digest
            h.update(b"<unreadable>")
        h.update(b"\0")
    return h.hexdigest()


def _ropekv_version() -> str | None:
    try:
        return importlib.metadata.version("ropekv")
    except importlib.metadata.PackageNotFoundError:
        return None


def tokens_digest(tokens: torch.Tensor) -> str:
    """sha256 of token ids ``[n]`` as little-endian int64."""
    ids = tokens.detach().to(torch.int64).cpu().contiguous()
    return hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()


def entry_fields(fingerprint: str, reference: str, case: Case, tokens: torch.Tensor) -> dict[str, Any]:
    """Everything a case's reference rows depend on, as JSON-able data (its sha256 is the entry key).

    A plain case's rows are the float64 forward's rows at its decode positions under its attention
    (a case window and sinks, else the model's own kinds, recorded by :meth:`Case.for_model`; an
    image span's positions): its block size, chunk, prefix and length matter only through the
    positions, so cases that differ only in how the cache was filled share an entry. A case with a
    cache operation is keyed by all of it (an eviction or a shift has a forward of its own).
    ``tokens``: the check's whole stream; only the tokens the rows read (up to the last probed
    token, by causality) are hashed, so a longer stream from more cases still hits.
    """
    positions = case.decode_positions
    tokens_read = max(positions) - case.shift + 1  # token index of the last probed row, plus one
    if case.op is None:
        what: dict[str, Any] = {
            "positions": positions,
            "window": case.window,
            "sink_tokens": case.sink_tokens,
            "model_attention": None if case.model_attention is None else dataclasses.asdict(case.model_attention),
            "image": None if case.image is None else dataclasses.asdict(case.image),
        }
    else:
        what = {"positions": positions, "case": case.to_dict()}
    return {
        "format": ENTRY_FORMAT,
        "version": ENTRY_VERSION,
        "model_fingerprint": fingerprint,
        "reference_dtype": reference,
        "case": what,
        "tokens": {"count": tokens_read, "sha256": tokens_digest(tokens[:tokens_read])},
        "ropekv": _ropekv_version(),
        "code": code_digest(),
        "torch": torch.__version__,
    }


def canonical(fields: dict[str, Any]) -> str:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)


def entry_key(fields: dict[str, Any]) -> str:
    """The entry's name: sha256 of the canonical JSON of :func:`entry_fields`."""
    return hashlib.sha256(canonical(fields).encode()).hexdigest()


@dataclass(frozen=True)
class RowsShape:
    """What a valid entry of a case holds: ``positions`` (sorted, distinct) and, per row, ``num_layers``
    attention rows ``[num_heads, <= max_width]`` (float64, as attention logits always are) and inputs
    ``[hidden]``, and ``[vocab]`` logits in ``dtype`` (the reference's). The file's size is bounded by
    these (:meth:`max_bytes`)."""

    positions: tuple[int, ...]
    num_layers: int
    num_heads: int
    hidden: int
    vocab: int
    dtype: torch.dtype
    origin: int = 0  # the position of the rows' column 0 (a shifted case's shift: RefRow.origin)

    @property
    def max_width(self) -> int:
        return max(self.positions) + 1 - self.origin  # keys are at positions from the origin up to the query's

    def max_bytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        attn = self.num_layers * self.num_heads * self.max_width * 8
        per_row = attn + (self.num_layers * self.hidden + self.vocab) * size + 16
        return 8 + MAX_HEADER_BYTES + len(self.positions) * per_row


@dataclass(frozen=True)
class StoredRows:
    """An entry read back: rows by position (attention trimmed of trailing ``-inf`` columns), the width
    each row had when computed, and the reference seconds it cost then."""

    rows: dict[int, RefRow]
    widths: dict[int, int]
    seconds: float


class EntryProblem(RopeKVError):
    """An entry that cannot be trusted (internal: the harness recomputes it, the report says why)."""


class ReferenceStore:
    """Entries in one folder (module doc). ``folder`` must be a writable directory, or a path whose
    parent is one (it is created when the first entry is stored, so a check refused later leaves
    nothing behind); anything else is a UsageError before any work, naming ``what`` (the CLI flag,
    or the API's keyword)."""

    def __init__(self, folder: str | os.PathLike[str], what: str = "--reference-cache", trust_engine: bool = False):
        if not isinstance(trust_engine, bool):
            raise UsageError(f"trust_engine must be True or False, got {trust_engine!r}")
        self.folder = _usable_folder(folder, what)
        self.trust_engine = trust_engine

    def writes_refused(self) -> str | None:
        """Why this process must not write entries (None: it may). A process that imported adapter code
        (:mod:`ropekv.user_code`) may have changed the reference it computes; its rows would be believed
        by every later check, so it writes none unless the store was made with ``trust_engine=True``."""
        spec = user_code.loaded()
        if spec is None or self.trust_engine:
            return None
        return f"this process loaded adapter code ({spec}); --reference-cache-trust-engine stores it"

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def load(self, fields: dict[str, Any], shape: RowsShape) -> StoredRows | None:
        """The entry of ``fields`` if there is one (None: none yet); EntryProblem if it is not valid."""
        key = entry_key(fields)
        path = self.path(key)
        if not path.exists():
            return None
        try:
            f, size = open_regular(path, "reference cache entry", EntryProblem)
        except EntryProblem as exc:
            raise EntryProblem(f"not a readable file ({exc})") from None
        with f:
            if size > shape.max_bytes():
                raise EntryProblem(f"{size} bytes, more than the {shape.max_bytes()} an entry of this case can hold")
            data = bytearray(size)
            read_exactly(f, memoryview(data), str(path), EntryProblem)
        meta, tensors = _parse(bytes(data))
        if meta.get("key") != key or meta.get("fields") != canonical(fields):
            raise EntryProblem("its key is not this case's (edited, or another entry's file)")
        if meta.get("checksum") != _checksum(tensors):
            raise EntryProblem("checksum mismatch (the tensors' bytes changed)")
        return _rows_of(tensors, meta, shape)

    def save(self, fields: dict[str, Any], rows: dict[int, RefRow], widths: dict[int, int], seconds: float) -> None:
        """Store ``rows`` (by position) under ``fields``, atomically (temporary file, then os.replace).
        OSError when the folder cannot be written (the caller notes it; the check goes on)."""
        from safetensors.torch import save

        tensors = _tensors_of(rows, widths)
        key = entry_key(fields)
        meta = {
            "format": ENTRY_FORMAT,
            "version": str(ENTRY_VERSION),
            "key": key,
            "fields": canonical(fields),
            "checksum": _checksum(tensors),
            "seconds": repr(float(seconds)),
        }
        blob = save(tensors, metadata=meta)
        self.folder.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=self.folder)
        try:
            os.fchmod(fd, ENTRY_MODE)  # mkstemp's 0600 would hide the entry from every other user
            with os.fdopen(fd, "wb") as out:
                out.write(blob)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            with contextlib.suppress(OSError):  # the write's own error is the one to raise
                os.unlink(tmp)
            raise


def _usable_folder(folder: str | os.PathLike[str], what: str) -> Path:
    try:
        p = Path(folder)
    except TypeError:
        raise UsageError(f"{what} must be a folder path, got {type(folder).__name__}") from None
    where = f"{what} {os.fspath(p)}"
    if "\0" in os.fspath(p):
        raise UsageError(f"{where!r}: a path cannot hold a NUL byte")
    if p.exists() and not p.is_dir():
        raise UsageError(f"{where}: not a directory")
    if not p.exists():
        parent = p.parent
        if not parent.is_dir():
            raise UsageError(f"{where}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{where}: cannot create it ({parent} is not writable)")
    elif not os.access(p, os.W_OK | os.X_OK):
        raise UsageError(f"{where}: not writable")
    return p


def _tensors_of(rows: dict[int, RefRow], widths: dict[int, int]) -> dict[str, torch.Tensor]:
    """``positions [R]``, ``widths [R]``, ``logits [R, V]``, ``hidden.{r} [L, hidden]``, ``attn.{r}.{l} [H, w]``
    (columns from the row's origin, which the case gives back on read: :class:`RowsShape`)."""
    order = sorted(rows)
    out = {
        "positions": torch.tensor(order, dtype=torch.int64),
        "widths": torch.tensor([widths[t] for t in order], dtype=torch.int64),
        "logits": torch.stack([rows[t].logits.values for t in order]).contiguous(),
    }
    for r, t in enumerate(order):
        row = rows[t]
        if row.logits.token_ids is not None or any(h is None for h in row.hidden_in):
            raise ValueError("a reference row has full logits and every layer's input")  # the decoder's output
        out[f"hidden.{r}"] = torch.stack([h for h in row.hidden_in if h is not None]).contiguous()
        for layer, attn in enumerate(row.attn_logits):
            out[f"attn.{r}.{layer}"] = _trim(attn).contiguous()
    return out


def _trim(attn: torch.Tensor) -> torch.Tensor:
    """``[H, T]`` without the trailing columns that are ``-inf`` in every head (keys after the query)."""
    kept = (attn != float("-inf")).any(dim=0).nonzero()
    width = int(kept.max()) + 1 if kept.numel() else 0
    return attn[:, :width].clone()


def fit(row: RefRow, width: int) -> RefRow | None:
    """``row`` with every attention row padded with ``-inf`` to ``width`` columns (None if wider)."""
    attn = []
    for a in row.attn_logits:
        if a.shape[1] > width:
            return None
        pad = torch.full((a.shape[0], width - a.shape[1]), float("-inf"), dtype=a.dtype)
        attn.append(torch.cat([a, pad], dim=1))
    return dataclasses.replace(row, attn_logits=tuple(attn))


def _rows_of(tensors: dict[str, torch.Tensor], meta: dict[str, str], shape: RowsShape) -> StoredRows:
    """The entry's rows, after checking every tensor's name, dtype and shape against ``shape``."""
    R, L = len(shape.positions), shape.num_layers
    expected = {"positions", "widths", "logits"} | {f"hidden.{r}" for r in range(R)}
    expected |= {f"attn.{r}.{layer}" for r in range(R) for layer in range(L)}
    if set(tensors) != expected:
        raise EntryProblem("its tensors are not those of this case's rows")
    positions = tensors["positions"]
    if positions.dtype != torch.int64 or positions.tolist() != list(shape.positions):
        raise EntryProblem("its positions are not this case's")
    widths = tensors["widths"]
    if widths.dtype != torch.int64 or tuple(widths.shape) != (R,) or bool((widths < 1).any()):
        raise EntryProblem("its row widths are malformed")
    logits = tensors["logits"]
    _expect(logits, (R, shape.vocab), shape.dtype, "logits")
    rows = {}
    for r, t in enumerate(shape.positions):
        hidden = tensors[f"hidden.{r}"]
        _expect(hidden, (L, shape.hidden), shape.dtype, f"hidden.{r}")
        attn = []
        for layer in range(L):
            a = tensors[f"attn.{r}.{layer}"]
            if a.dim() != 2 or a.shape[0] != shape.num_heads or a.shape[1] > min(shape.max_width, int(widths[r])):
                raise EntryProblem(f"attn.{r}.{layer} has shape {tuple(a.shape)}")
            _expect(a, tuple(a.shape), torch.float64, f"attn.{r}.{layer}", masked=True)  # always float64
            attn.append(a)
        rows[t] = RefRow(
            hidden_in=tuple(hidden.unbind(0)), attn_logits=tuple(attn), logits=NextToken(logits[r]), origin=shape.origin
        )
    try:
        seconds = float(meta.get("seconds", "0"))
    except ValueError:
        raise EntryProblem("its seconds are not a number") from None
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS):
        raise EntryProblem(f"its seconds are not a duration from 0 to {MAX_SECONDS:g}")
    return StoredRows(rows=rows, widths=dict(zip(shape.positions, widths.tolist())), seconds=seconds)


def _expect(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, name: str, masked: bool = False) -> None:
    """``t`` has ``shape`` and ``dtype`` and finite values; ``masked`` (attention logits): ``-inf`` too,
    where a key is hidden from the query."""
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise EntryProblem(f"{name} is {t.dtype} {tuple(t.shape)}, not {dtype} {shape}")
    if not t.is_floating_point():
        return
    bad = ~torch.isfinite(t)
    if masked:
        bad &= t != float("-inf")
    if bool(bad.any()):
        raise EntryProblem(f"{name} holds NaN or infinity")


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the sorted ``(name, dtype, shape, raw bytes)`` of every tensor."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _data_length(header: dict[str, Any]) -> int:
    """The data section's length a safetensors header declares (the largest end offset)."""
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise EntryProblem(f"tensor {name!r} has malformed data_offsets")
        end = max(end, offsets[1])
    return end


def _parse(data: bytes) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Metadata and tensors of safetensors bytes; EntryProblem for anything safetensors or we refuse."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if len(data) < 8:
        raise EntryProblem(f"truncated ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if not 2 <= n <= MAX_HEADER_BYTES or 8 + n > len(data):
        raise EntryProblem(f"truncated or not safetensors (header of {n} bytes in a {len(data)}-byte file)")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise EntryProblem("its header is not JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise EntryProblem("no metadata")
    if meta.get("format") != ENTRY_FORMAT or meta.get("version") != str(ENTRY_VERSION):
        raise EntryProblem(f"format {meta.get('format')!r} version {meta.get('version')!r} is not this one's")
    declared = 8 + n + _data_length(header)
    if declared != len(data):
        what = "truncated" if declared > len(data) else "trailing bytes"
        raise EntryProblem(f"{what}: {len(data)} bytes where its header declares {declared}")
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError, OverflowError) as exc:  # safetensors' parse errors
        raise EntryProblem(f"safetensors cannot read it ({str(exc)[:120]})") from None
    return meta, tensors


def sample_mismatch(stored: RefRow, fresh: RefRow, dtype: torch.dtype) -> str | None:
    """How a stored row's layer 0 differs from the same row recomputed now (None: it does not).

    ``fresh`` holds at least layer 0 (its input and attention logits, as :class:`RefRow` has them). The
    input is the embedding row, bitwise the same; the attention logits may differ in the last bits
    when the stored row came from a longer forward (module doc), so they are compared within 64 units
    in the last place of ``dtype`` relative to the row's largest logit, their ``-inf`` columns exactly.
    Rotated with other angles, scaled, or from another model, a row differs far beyond that."""
    if not stored.hidden_in or not stored.attn_logits or not fresh.hidden_in or not fresh.attn_logits:
        return "it has no layer 0 to compare"
    h_old, h_new = stored.hidden_in[0], fresh.hidden_in[0]
    if h_old is None or h_new is None or not torch.equal(h_old, h_new):
        return "layer 0's input differs from the reference's (another model's rows, or edited)"
    a_old, a_new = stored.attn_logits[0], _trim(fresh.attn_logits[0])
    if stored.origin != fresh.origin:
        return f"its rows start at position {stored.origin}, the reference's at {fresh.origin}"
    if a_old.shape != a_new.shape or not torch.equal(a_old == float("-inf"), a_new == float("-inf")):
        return "layer 0's attention logits cover other keys than the reference's"
    seen = a_new != float("-inf")
    if not bool(seen.any()):
        return None
    scale = max(1.0, float(a_new[seen].abs().max()))
    worst = float((a_old[seen] - a_new[seen]).abs().max())
    if not worst <= 64 * torch.finfo(dtype).eps * scale:
        return f"layer 0's attention logits differ from the reference's by {worst:.3g} (computed otherwise)"
    return None
