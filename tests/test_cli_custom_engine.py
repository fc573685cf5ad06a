"""``ropekv check --engine module:Class`` and ``--engine path/to/file.py:Class``: a user's own adapter,
built by ``Class.load(MODEL, dtype=DTYPE)``, judged with the same report, JSON and plot; every way the
name can be wrong is one line and exit 2."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from ropekv.cli.main import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "adapters"

# The docs' logits-tier example, made loadable from the command line (docs/adapters.md).
ADAPTER = """
import torch
from transformers import AutoModelForCausalLM

from logits_tier import MyEngine  # a neighbour of this file


class CliEngine(MyEngine):
    @classmethod
    def load(cls, model, dtype):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), attn_implementation="eager")
        return cls(hf.eval(), name="cli-engine")


class OffByOne(CliEngine):  # one-token forwards one position too far
    def forward(self, ids, start, cache):
        return super().forward(ids, start + (1 if cache is not None and len(ids) == 1 else 0), cache)


class NotAnAdapter:
    @classmethod
    def load(cls, model, dtype):
        return object()


class LoadFails:
    @classmethod
    def load(cls, model, dtype):
        raise ZeroDivisionError("the user's load divided by zero")


class RunFails(CliEngine):
    def run_case(self, case, tokens):
        raise KeyError("cache slot")
"""


@pytest.fixture
def adapter_file(tmp_path: Path) -> Path:
    folder = tmp_path / "my_engine"
    folder.mkdir()
    shutil.copy(EXAMPLES / "logits_tier.py", folder / "logits_tier.py")
    path = folder / "my_adapter.py"
    path.write_text(ADAPTER)
    return path


def _check(capsys, model: Path, engine: str, *flags: str) -> tuple[int, str, str]:
    code = main(["check", str(model), "--engine", engine, "--lengths", "1,9", "--no-progress", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_file_adapter_passes_with_the_same_report_json_and_plot(tiny_llama_dir, adapter_file, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code, out, err = _check(
        capsys, tiny_llama_dir, f"{adapter_file}:CliEngine", "--json", str(out_json), "--plot", str(out_png)
    )
    assert code == 0, err
    assert out.startswith("model: ") and "engine: cli-engine (logits tier); 2 cases" in out.splitlines()[0]
    assert "parity holds in all 2 cases" in out
    report = json.loads(out_json.read_text())
    assert report["passed"] and report["tier"] == "logits" and report["engine"]["name"] == "cli-engine"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_buggy_file_adapter_fails_with_exit_1(tiny_llama_dir, adapter_file, capsys):
    code, out, err = _check(capsys, tiny_llama_dir, f"{adapter_file}:OffByOne")
    assert code == 1 and "FAIL" in out


def test_a_module_adapter_is_loaded_by_its_load_classmethod(tiny_llama_dir, capsys):
    code, out, err = _check(capsys, tiny_llama_dir, "ropekv.adapters.hf:HFEngine")
    assert code == 0, err
    assert re.search(r"engine: transformers [0-9.]+ LlamaForCausalLM", out.splitlines()[0])


@pytest.mark.parametrize(
    "engine,named",
    [
        ("no_such_module_ropekv:Cls", "no module named 'no_such_module_ropekv'"),
        ("ropekv.no_such_submodule:Cls", "no module named 'ropekv.no_such_submodule'"),
        ("ropekv.adapters.hf:NoSuchClass", "ropekv.adapters.hf has no attribute 'NoSuchClass'"),
        ("ropekv.errors:UsageError", "UsageError has no load(model, dtype) classmethod"),
        ("{file}:Missing", "has no attribute 'Missing'"),
        ("{file}:NotAnAdapter", "protocol: expected the members name, tier"),
        ("{file}:LoadFails", "load(model, dtype): expected no exception, got ZeroDivisionError: the user's load"),
        ("{file}:RunFails", "run_case(L=1 P=0 B=16 S=3): expected no exception, got KeyError: 'cache slot'"),
        ("{folder}/nope.py:Cls", "nope.py: no such file"),
        ("{folder}:Cls", "is not a file"),
        ("{file}:not-an-identifier", "expected module:Class or path/to/file.py:Class"),
    ],
)
def test_a_wrong_engine_name_is_one_line(engine, named, tiny_llama_dir, adapter_file, capsys):
    engine = engine.format(file=adapter_file, folder=adapter_file.parent)
    code, out, err = _check(capsys, tiny_llama_dir, engine)
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("ropekv: error: ") and named in last and "Traceback" not in err
    assert err.count("ropekv: error:") == 1


def test_an_import_that_raises_is_one_line(tiny_llama_dir, tmp_path, capsys):
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('import-time failure')\n")
    code, out, err = _check(capsys, tiny_llama_dir, f"{bad}:Cls")
    assert code == 2 and err.count("\n") == 1
    assert "import: expected no exception, got RuntimeError: import-time failure" in err


def test_a_file_adapter_reads_the_reference_cache_but_writes_it_only_when_trusted(
    tiny_llama_dir, adapter_file, tmp_path, capsys
):
    refs = tmp_path / "refs"
    code, out, err = _check(capsys, tiny_llama_dir, f"{adapter_file}:CliEngine", "--reference-cache", str(refs))
    assert code == 0, err
    assert not list(refs.glob("*.safetensors")), "a process running adapter code stored reference rows"
    assert "computed but not stored (this process loaded adapter code" in out
    code, out, err = _check(
        capsys,
        tiny_llama_dir,
        f"{adapter_file}:CliEngine",
        "--reference-cache",
        str(refs),
        "--reference-cache-trust-engine",
    )
    assert code == 0, err
    assert len(list(refs.glob("*.safetensors"))) == 2
