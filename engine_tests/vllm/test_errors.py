"""What a user sees when vLLM cannot be given the model: one line and exit code 2, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ropekv.adapters.vllm import VLLMEngine
from ropekv.errors import CheckpointError, ConfigError, UsageError

_ALIVE: list = []  # engines started here, kept until the session ends


def test_a_missing_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="transformers model directory") as e:
        VLLMEngine(tmp_path / "nope", dtype="float32", block_size=32)
    assert e.value.exit_code == 2


def test_an_architecture_ropekv_cannot_reference_is_refused_before_vllm_starts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        VLLMEngine(tmp_path, dtype="float32", block_size=32)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_a_model_vllm_cannot_load_or_run_is_one_line(tmp_path):
    """A tiny llama (head_dim 16): with too few KV blocks vLLM refuses to start; with enough it starts,
    then its CPU attention has no kernel for head size 16 at the first request."""
    from ropekv.parity.cases import Case, token_stream
    from ropekv.testing.tiny import tiny_checkpoint

    tiny_checkpoint("llama", save_to=tmp_path)
    with pytest.raises(CheckpointError, match="vLLM could not load it") as e:
        VLLMEngine(tmp_path, dtype="float32", block_size=32, num_gpu_blocks_override=8, max_model_len=256)
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    engine = VLLMEngine(tmp_path, dtype="float32", block_size=32, num_gpu_blocks_override=16, max_model_len=256)
    _ALIVE.append(engine)  # an LLM torn down mid-session takes vLLM's process-wide parallel groups with it
    with pytest.raises(CheckpointError, match="vLLM failed running it.*head_dim=16") as e:
        engine.run_case(Case(length=3, block_size=32, decode_steps=1), token_stream(96, 4))
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_engine_options_are_checked_first():
    with pytest.raises(UsageError, match="multiple of 32"):
        VLLMEngine(None, dtype="float32", block_size=16)
    with pytest.raises(UsageError, match="float32, bfloat16"):
        VLLMEngine(None, dtype="float64", block_size=32)


def test_the_cli_prints_one_line_and_exits_2(tmp_path):
    env = dict(os.environ)
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ropekv"), "check", "--engine", "vllm", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
