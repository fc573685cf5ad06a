"""The CLI's happy paths and exit codes on a tiny checkpoint (error paths: tests/test_errors_cli.py)."""

from __future__ import annotations

import json

import pytest

from ropekv.cli.main import main

SMALL = ["--lengths", "1,17", "--block-sizes", "7", "--prefix-offsets", "0,5", "--decode-steps", "2", "--no-progress"]


def test_check_passes_writes_json_and_plot(tiny_llama_dir, tmp_path, capsys):
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["check", str(tiny_llama_dir), *SMALL, "--json", str(js), "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "parity holds in all 4 cases" in out
    report = json.loads(js.read_text())
    assert report["passed"] is True and len(report["cases"]) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("key_form", ["raw", "rotated"])
def test_check_key_forms(tiny_llama_dir, capsys, key_form):
    assert main(["check", str(tiny_llama_dir), *SMALL, "--key-form", key_form]) == 0


def test_injected_fault_exits_1_and_names_it(tiny_llama_dir, tmp_path, capsys):
    js = tmp_path / "r.json"
    code = main(["check", str(tiny_llama_dir), *SMALL, "--inject", "block-local-position", "--json", str(js)])
    out = capsys.readouterr().out
    assert code == 1
    assert "diagnosis: block_local_position" in out
    assert json.loads(js.read_text())["diagnosis"]["kind"] == "block_local_position"


def test_backend_that_cannot_honour_the_key_form_exits_3(tiny_llama_dir, capsys):
    code = main(["check", str(tiny_llama_dir), *SMALL, "--key-form", "rotated", "--backend", "rotate_on_read"])
    err = capsys.readouterr().err
    assert code == 3
    assert err.count("\n") == 1 and "twice their position" in err


def test_list_faults(capsys):
    assert main(["check", "--list-faults"]) == 0
    out = capsys.readouterr().out
    assert "double-rotation" in out and "stale-dynamic-scaling" in out


def test_run_predicts_with_token_ids(tiny_llama_dir, capsys):
    assert main(["run", str(tiny_llama_dir), "--token-ids", "5,6,7,8", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "float64 reference next token" in out and "agrees with the reference" in out


def test_ignored_config_fields_are_warned_in_output_and_report(make_tiny_checkpoint, tmp_path, capsys):
    """llama ignores partial_rotary_factor (transformers rotates the whole head): checked as llama reads
    it, and said so on stderr, above the table and in the JSON, never silently reinterpreted."""
    model = make_tiny_checkpoint("llama", partial_rotary_factor=0.5)
    out_json = tmp_path / "r.json"
    code = main(
        ["check", str(model), "--lengths", "5", "--decode-steps", "1", "--no-progress", "--json", str(out_json)]
    )
    captured = capsys.readouterr()
    assert code == 0
    assert "warning:" in captured.err and "partial_rotary_factor" in captured.err
    # stdout: the model line, then the table (whose first line repeats the warning)
    lines = captured.out.splitlines()
    assert lines[0].startswith("model: ") and lines[1].startswith("warning:") and "partial_rotary_factor" in lines[1]
    report = json.loads(out_json.read_text())
    assert any("partial_rotary_factor" in w for w in report["model"]["warnings"])
    assert report["provenance"]["exit_code"] == 0 and report["provenance"]["command"].startswith("ropekv check")


def test_list_faults_includes_architecture_faults(capsys):
    assert main(["check", "--list-faults"]) == 0
    out = capsys.readouterr().out
    assert "nope-layer-rotated" in out and "partial-rotary-all-channels" in out and "double-rotation" in out


def test_model_header_is_on_stdout_with_the_table(tiny_llama_dir, capsys):
    """`ropekv check > out.txt` keeps which model and engine were judged; progress stays on stderr."""
    assert main(["check", str(tiny_llama_dir), "--lengths", "5", "--decode-steps", "1"]) == 0
    captured = capsys.readouterr()
    first = captured.out.splitlines()[0]
    assert first.startswith("model: ") and "fingerprint" in first and first.endswith("; 1 case")
    assert "model: " not in captured.err


def test_check_runs_float16(tiny_llama_dir, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    argv = ["check", str(tiny_llama_dir), "--dtype", "float16", "--lengths", "5", "--no-progress"]
    assert main([*argv, "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert report["engine"]["dtype"] == "float16"


def test_python_dash_m_ropekv_is_the_command_line() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ropekv", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("ropekv ")
