"""Every call into a user's adapter (``--engine file.py:Class``) is fenced (ropekv/cli/adapter_guard.py):
an adapter that ends the process, raises KeyboardInterrupt, raises an exception that cannot be printed,
has a raising ``tier``, no checkpoint, prints, or never answers gives one line and exit 2 (never exit 0
without a verdict, 130, a traceback, a hang, or text in the report on stdout)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

import ropekv.cli.check_cmd as check_cmd
from ropekv.cli.main import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "adapters"

ADAPTER = """
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from logits_tier import MyEngine


class CliEngine(MyEngine):
    @classmethod
    def load(cls, model, dtype, **kw):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), attn_implementation="eager")
        engine = cls(hf.eval(), name="cli-engine")
        engine.kw = kw
        return engine


class Exits(CliEngine):
    def run_case(self, case, tokens):
        sys.exit(0)


class Sleeps(CliEngine):
    def run_case(self, case, tokens):
        time.sleep(3600)


class Spins(CliEngine):
    def run_case(self, case, tokens):
        while True:
            pass


class InterruptsLoad:
    @classmethod
    def load(cls, model, dtype):
        raise KeyboardInterrupt


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


class BadStr(CliEngine):
    def run_case(self, case, tokens):
        raise Unprintable()


class BadTier(CliEngine):
    @property
    def tier(self):
        raise ValueError("tier unknown")


class NoCheckpoint(CliEngine):
    @property
    def checkpoint(self):
        return None

    @checkpoint.setter
    def checkpoint(self, value):
        pass


class Prints(CliEngine):
    def run_case(self, case, tokens):
        print("NOISE FROM THE ADAPTER")
        return super().run_case(case, tokens)


class Fp8(CliEngine):
    def run_case(self, case, tokens):
        print(f"asked for kv_dtype={self.kw.get('kv_dtype')}")
        return super().run_case(case, tokens)
"""


@pytest.fixture
def adapter_file(tmp_path: Path) -> Path:
    folder = tmp_path / "guarded"
    folder.mkdir()
    shutil.copy(EXAMPLES / "logits_tier.py", folder / "logits_tier.py")
    path = folder / "guarded_adapter.py"
    path.write_text(ADAPTER)
    return path


def _check(capsys, model: Path, engine: str, *flags: str) -> tuple[int, str, str]:
    code = main(["check", str(model), "--engine", engine, "--lengths", "3", "--no-progress", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(err: str) -> str:
    assert "Traceback" not in err and err.count("ropekv: error:") == 1, err
    return err.splitlines()[-1]


@pytest.mark.parametrize(
    "cls,named",
    [
        (
            "Exits",
            "run_case(L=3 P=0 B=16 S=3): expected a return (an adapter must not end the process), got sys.exit(0)",
        ),
        ("InterruptsLoad", "load(model, dtype): expected no exception, got KeyboardInterrupt raised by the adapter"),
        ("BadStr", "run_case(L=3 P=0 B=16 S=3): expected no exception, got Unprintable"),
        ("BadTier", "the protocol's members: expected no exception, got ValueError: tier unknown"),
        ("NoCheckpoint", "checkpoint: expected a ropekv Checkpoint (ropekv.models.load_checkpoint), got NoneType"),
    ],
)
def test_an_adapter_that_misbehaves_is_one_line_and_exit_2(cls, named, tiny_llama_dir, adapter_file, capsys):
    code, out, err = _check(capsys, tiny_llama_dir, f"{adapter_file}:{cls}")
    assert code == 2, (out, err)
    assert named in _one_line(err)
    assert "parity holds" not in out


@pytest.mark.parametrize("cls", ["Sleeps", "Spins"])
def test_an_adapter_that_never_answers_is_stopped_by_the_time_limit(cls, tiny_llama_dir, adapter_file, capsys):
    start = time.monotonic()
    code, out, err = _check(capsys, tiny_llama_dir, f"{adapter_file}:{cls}", "--adapter-timeout", "1")
    assert code == 2 and time.monotonic() - start < 30
    assert "run_case(L=3 P=0 B=16 S=3): expected an answer within 1 s (--adapter-timeout), got none" in _one_line(err)


def test_an_adapters_prints_go_to_stderr_not_into_the_report(tiny_llama_dir, adapter_file, capsys):
    code, out, err = _check(capsys, tiny_llama_dir, f"{adapter_file}:Prints")
    assert code == 0, err
    assert "NOISE FROM THE ADAPTER" not in out and "NOISE FROM THE ADAPTER" in err
    assert "parity holds" in out


def test_fp8_reaches_a_custom_adapters_load(tiny_llama_dir, adapter_file, capsys):
    code, out, err = _check(capsys, tiny_llama_dir, f"{adapter_file}:Fp8", "--kv-dtype", "fp8")
    assert code == 0, err
    assert "asked for kv_dtype=fp8" in err


@pytest.mark.parametrize("value", ["0", "-1", "1e9", "nan", "inf"])
def test_the_adapter_timeout_is_bounded(value, tiny_llama_dir, capsys):
    code, out, err = _check(capsys, tiny_llama_dir, "x.py:Cls", "--adapter-timeout", value)
    assert code == 2 and "--adapter-timeout: expected a number of seconds" in _one_line(err)


def test_exit_0_is_never_returned_when_a_subcommand_ends_the_process(tiny_llama_dir, monkeypatch, capsys):
    def exits(args):
        raise SystemExit(0)  # library or engine code calling sys.exit(0) before any verdict

    monkeypatch.setattr(check_cmd, "run", exits)
    code = main(["check", str(tiny_llama_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "check stopped without a verdict: sys.exit(0) was called" in _one_line(err)
