"""The tiny model of a corpus entry: generated from its config, saved once, read by every release.

The weights come from transformers' own classes for the architecture (``ropekv.testing.tiny``: unit-scale
random weights, seeded by the config), saved as ``model.safetensors`` (never a pickle). ``config.json``
is then written exactly as the entry gives it (over :data:`~ropekv.testing.tiny.TINY_BASE` sizes), in
the spelling of the releases the entry replays (``rope_scaling``, ``sliding_window_pattern``), not in the
spelling of the transformers that generated the weights. Both releases of an entry and ropekv's float64
reference load these same two files. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..testing.tiny import TINY_BASE, tiny_model
from .corpus import Entry

STAMP = ".ropekv-replay-model"


def model_config(entry: Entry) -> dict[str, Any]:
    """The entry's config.json: TINY_BASE sizes, then the entry's keys (which win)."""
    return copy.deepcopy({**TINY_BASE, **entry.model})  # transformers' config classes edit nested dicts in place


def model_dir(root: Path, entry: Entry) -> Path:
    """The entry's model folder under ``root/models``, built if missing (keyed by the config's digest)."""
    config = model_config(entry)
    text = json.dumps(config, sort_keys=True)
    path = Path(root) / "models" / f"{entry.name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if (path / STAMP).is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        build = Path(tmp) / "model"
        settings = {k: v for k, v in config.items() if k != "model_type"}
        model: Any = _quiet_tiny_model(config["model_type"], settings)
        with contextlib.redirect_stderr(io.StringIO()):  # transformers' "Writing model shards" bar
            model.save_pretrained(build)
        weights = sorted(build.glob("*.safetensors"))
        if [w.name for w in weights] != ["model.safetensors"]:
            raise UsageError(
                f"{entry.name}: expected one model.safetensors, transformers wrote {[w.name for w in weights]}"
            )
        for other in build.iterdir():
            if other.name != "model.safetensors":
                other.unlink()
        written = {**config, "architectures": [type(model).__name__], "torch_dtype": "float32"}
        (build / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
        (build / STAMP).write_text(text + "\n")
        if path.exists():
            shutil.rmtree(path)  # a folder without its stamp was left half-written
        os.replace(build, path)
    return path


def _quiet_tiny_model(model_type: str, settings: dict[str, Any]) -> Any:
    """A transformers PreTrainedModel of the config, built without transformers' warnings about the
    old spellings the entry keeps on purpose (they are the releases' own)."""
    import transformers

    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        return tiny_model(model_type, **copy.deepcopy(settings))
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()
