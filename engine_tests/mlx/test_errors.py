"""A bad model directory or an architecture mlx-lm/ropekv cannot run: one typed error, and from the
CLI one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ropekv.adapters.mlx import MLXEngine
from ropekv.errors import CheckpointError, ConfigError, UsageError


def _ropekv(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "ropekv.cli.main", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        MLXEngine(tmp_path / "nope")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError):
        MLXEngine(tmp_path)


def test_config_without_weights(engine, tmp_path):
    (tmp_path / "config.json").write_text((Path(engine.path) / "config.json").read_text())
    with pytest.raises(CheckpointError):
        MLXEngine(tmp_path)


def test_bad_options():
    with pytest.raises(UsageError):
        MLXEngine(None, keep=4)  # keep without max_kv_size
    with pytest.raises(UsageError):
        MLXEngine(None, dtype="float64")


def test_cli_one_line_exit_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    for model in (str(tmp_path / "missing"), str(tmp_path)):
        proc = _ropekv("check", "--engine", "mlx", model, "--lengths", "5", "--no-progress")
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_with_options_validates(engine):
    with pytest.raises(UsageError):
        engine.with_options(keep=3)  # keep needs max_kv_size
    with pytest.raises(UsageError):
        engine.with_options(dtype="bfloat16")  # a dtype needs a new load
    assert engine.with_options(max_kv_size=37, keep=4).keep == 4 and engine.keep is None


def test_default_cases_drop_only_the_sinks():
    """The CLI's default list is the whole default matrix with its sinks case run without sinks: the
    cache-operation cases (run through the engine's own options, not --ops) and the cases the model is
    too short for stay listed and are reported as n/a, never dropped silently."""
    import argparse

    from ropekv.adapters import mlx
    from ropekv.parity.cases import default_matrix

    default = default_matrix()
    cases = mlx.default_cases(argparse.Namespace(model=None))
    assert len(cases) == len(default) == 15 and any(c.op for c in cases)
    for mine, theirs in zip(cases, default):
        assert mine.sink_tokens == 0
        assert (mine.length, mine.window, mine.chunk, mine.prefix, mine.op) == (
            theirs.length,
            theirs.window,
            theirs.chunk,
            theirs.prefix,
            theirs.op,
        )
    assert any(c.sink_tokens for c in default)
