"""What a newcomer writing an adapter for an engine of their own meets: the default model's files
without loading its weights, one ``tiny_checkpoint``, docs that say what ``run_case`` does for each
cache operation and what the probe's optional fields are, and star imports that work."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
from test_default_model import _tiny_convert

import ropekv.adapters
from ropekv.models import default, resolve_model_dir
from ropekv.parity.cases import OP_KINDS
from ropekv.parity.explain.cells import span_text
from ropekv.probe import LayerProbe
from ropekv.testing import plugin
from ropekv.testing import tiny as tiny_module

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_plugin_fixture_and_the_library_function_share_one_signature(tmp_path):
    factory = plugin.cached_tiny_checkpoint()
    assert inspect.signature(factory) == inspect.signature(tiny_module.tiny_checkpoint)
    saved = factory("llama", save_to=tmp_path / "m")
    assert (Path(saved) / "config.json").is_file()
    assert factory("llama") is factory("llama")  # in memory: cached per arguments


def test_the_default_models_files_are_reached_without_loading_a_weight(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default, "_convert", _tiny_convert(tiny_llama_dir))
    resolve_model_dir(None)  # the first call converts (here: the tiny stand-in)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(default, "_load_verified", no_weights)
    monkeypatch.setattr("ropekv.models.safetensors_dir.load_safetensors_dir", no_weights)
    folder = resolve_model_dir(None)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert "ropekv_default_model_dir" in vars(plugin)
    text = (DOCS / "adapters.md").read_text()
    assert "ropekv.models.resolve_model_dir(model)" in text and "`ropekv_default_model_dir`" in text


def test_the_docs_say_what_run_case_does_for_every_cache_operation():
    text = (DOCS / "adapters.md").read_text()
    for kind in OP_KINDS:
        assert re.search(rf"^\| `{kind}` \| ", text, re.M), kind
    for name in ("draft_tokens", "evicted_positions", "batch_lengths", "spec_draft", "spec_records"):
        assert f"case.{name}" in text, name


def test_the_docs_describe_every_probe_field():
    text = (DOCS / "adapters.md").read_text()
    for field in inspect.signature(LayerProbe).parameters:
        assert re.search(rf"^\| (`LayerProbe`[^|]*)?\| `{field}` \|", text, re.M), field


def test_positions_are_printed_as_runs_in_ascending_order():
    # a ring's keys: recorded 0..36, truly 37..72 then 36
    assert span_text([*range(37, 73), 36]) == "36..72"
    text = span_text([*range(41, 80, 2), 36, 37])
    numbers = [int(n) for n in re.findall(r"\d+", text.split(" (")[0])]
    assert numbers == sorted(numbers) and text.endswith("(22 in all)")


def _adapter_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(ropekv.adapters.__path__, "ropekv.adapters.")]


ENGINE_PACKAGES = {"vllm", "mlx", "mlx_lm", "llama_cpp", "onnxruntime_genai", "ctranslate2", "flashinfer"}


@pytest.mark.parametrize("name", _adapter_modules())
def test_star_import_of_every_adapter_module_works(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:  # a module that imports its engine at the top, outside its venv
        assert exc.name is not None and exc.name.split(".")[0] in ENGINE_PACKAGES, exc
        return
    exec(f"from {name} import *", {})  # every name in __all__ exists
