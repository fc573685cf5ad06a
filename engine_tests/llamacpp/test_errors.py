"""A bad model file: one typed error, one line on the command line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ropekv.adapters.llamacpp import LlamaCppEngine
from ropekv.errors import CheckpointError, UsageError


def _bad_files(tmp_path: Path) -> list[Path]:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    truncated = tmp_path / "truncated.gguf"
    from ropekv.adapters.llamacpp.f32_gguf import default_f32_gguf

    with open(default_f32_gguf(), "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    return [junk, truncated, tmp_path / "missing.gguf"]


def test_bad_model_files_raise_checkpoint_error(tmp_path):
    for path in _bad_files(tmp_path):
        with pytest.raises(CheckpointError) as err:
            LlamaCppEngine(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_bad_options_raise_usage_error():
    with pytest.raises(UsageError):
        LlamaCppEngine(type_k="q4_0")
    with pytest.raises(UsageError):
        LlamaCppEngine(n_batch=0)


def test_cli_bad_model_file_is_one_line_and_exit_2(tmp_path):
    cli = Path(sys.executable).with_name("ropekv")
    for path in _bad_files(tmp_path)[:2]:
        proc = subprocess.run(
            [str(cli), "check", "--engine", "llamacpp", "--gguf", str(path), "--no-progress"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in proc.stderr and str(path) in lines[0], proc.stderr
