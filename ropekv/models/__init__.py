"""Model loading: checkpoints from disk (or the embedded default) and the reference decoder.

``load_checkpoint`` picks the loader by what ``path`` is: nothing (the embedded default), the name of
an embedded model (``gemma3-270m``, :mod:`~ropekv.models.embedded`), a transformers directory
(config.json + safetensors) or a ``.gguf`` file. Pickled weights are refused
by name and never opened, and checkpoint-supplied code is never run (``trust_remote_code=True`` is
an error, not an option).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError
from .config import Checkpoint, ModelConfig
from .embedded import is_embedded_name
from .reference import LayerProbe, ReferenceDecoder, ReferenceOutput
from .safetensors_dir import PICKLE_SUFFIXES, load_safetensors_dir, read_dir_config

__all__ = [
    "Checkpoint",
    "LayerProbe",
    "ModelConfig",
    "ReferenceDecoder",
    "ReferenceOutput",
    "load",
    "load_checkpoint",
    "load_config",
    "resolve_gguf",
    "resolve_model_dir",
]


def load_checkpoint(
    path: str | Path | None = None, *, gguf_layout: str = "neox", trust_remote_code: bool = False
) -> Checkpoint:
    """Load a validated :class:`Checkpoint` from ``path``.

    - None: the embedded default checkpoint (SmolLM2-135M); an embedded model's name: that model;
    - a directory: a transformers checkpoint (``config.json`` + safetensors, sharded or not);
    - a ``.gguf`` file: dequantized to float32; ``gguf_layout`` is the Q/K pairing to produce.

    ``trust_remote_code`` exists only to be refused: ropekv never runs code shipped with a checkpoint.
    """
    if trust_remote_code:
        raise ConfigError("trust_remote_code=True is refused: ropekv never runs code shipped with a checkpoint")
    kind, p = _kind(path)
    if kind == "default" or p is None:  # p is None exactly for the default model
        from .default import default_checkpoint

        return default_checkpoint()
    if kind == "embedded":
        from .default import default_checkpoint

        return default_checkpoint(str(path))
    if kind == "dir":
        return load_safetensors_dir(p)
    from .gguf_file import load_gguf

    return load_gguf(p, layout=gguf_layout)


def load_config(path: str | Path | None = None, *, gguf_layout: str = "neox") -> ModelConfig:
    """The validated :class:`ModelConfig` that :func:`load_checkpoint` would load from ``path``, reading
    only ``config.json`` or the GGUF metadata: lets a command refuse bad arguments before loading weights.
    Refuses the same paths (pickles, missing or unsupported files) with the same errors."""
    kind, p = _kind(path)
    if kind == "default" or p is None:  # p is None exactly for the default model
        from .default import default_config

        return default_config()
    if kind == "embedded":
        from .default import default_config

        return default_config(str(path))
    if kind == "dir":
        return read_dir_config(p)
    from .gguf_file import read_gguf_config

    return read_gguf_config(p, layout=gguf_layout)


def _kind(path: str | Path | None) -> tuple[str, Path | None]:
    """``("default", None)``, ``("embedded", path)`` (a name of :data:`~ropekv.models.embedded.EMBEDDED`
    that is not also a path here), ``("dir", path)`` or ``("gguf", path)``; CheckpointError for anything else."""
    if path is None:
        return "default", None
    p = Path(path)
    if is_embedded_name(path):
        return "embedded", p
    if p.is_dir():
        return "dir", p
    if p.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{p}: pickled weights are refused and never loaded (unpickling can run arbitrary code); "
            "use a safetensors directory or a GGUF file"
        )
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.suffix.lower() == ".gguf" and p.is_file():
        return "gguf", p
    if p.suffix.lower() == ".safetensors":
        raise CheckpointError(f"{p}: pass the directory holding this file and its config.json, not the file")
    raise CheckpointError(f"{p}: unsupported checkpoint (expected a transformers directory or a .gguf file)")


def load(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    gguf_layout: str = "neox",
    trust_remote_code: bool = False,
) -> ReferenceDecoder:
    """``ReferenceDecoder(load_checkpoint(path), dtype)``: the checkpoint, ready for a full forward."""
    checkpoint = load_checkpoint(path, gguf_layout=gguf_layout, trust_remote_code=trust_remote_code)
    return ReferenceDecoder(checkpoint, dtype=dtype)


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """The transformers folder an engine loads for ``model``: an embedded model's converted folder
    (None: the default's; converted once), else ``model`` itself as a path."""
    if _names_embedded(model):
        from .default import default_checkpoint_dir

        return default_checkpoint_dir(None if model is None else str(model))
    return Path(str(model))


def resolve_gguf(model: str | os.PathLike | None) -> Path:
    """The GGUF file an engine loads for ``model``: an embedded model's original GGUF (None: the
    default's), else ``model`` itself as a path."""
    if _names_embedded(model):
        from .default import default_gguf_path

        return default_gguf_path(None if model is None else str(model))
    return Path(str(model))


def _names_embedded(model: str | os.PathLike | None) -> bool:
    """True when ``model`` is None or an embedded model's name that is not also a path here."""
    return model is None or is_embedded_name(model)
