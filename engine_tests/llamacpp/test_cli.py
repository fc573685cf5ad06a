"""``ropekv check --engine llamacpp`` end to end: the registry finds the adapter, its flags parse, and
parity holds on the default float32 GGUF (exit 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_cli_check_passes_on_the_default_f32_gguf(tmp_path):
    cli = Path(sys.executable).with_name("ropekv")
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            str(cli),
            "check",
            "--engine",
            "llamacpp",
            "--lengths",
            "9",
            "--prefix-offsets",
            "4",
            "--n-batch",
            "5",
            "--no-progress",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["passed"] and report["tier"] == "forensics"
    assert report["engine"]["engine"] == "llama.cpp" and report["engine"]["n_ubatch"] == 5
    assert report["engine"]["weights"] == "f32" and report["engine"]["type_k"] == "f32"
