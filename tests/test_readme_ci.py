"""The README's CI snippet runs as it is shown: its ``my_engine`` is the docs' logits-tier example."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ci_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## In your engine's CI", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's CI section has no python block"
    return match.group(1)


def test_readme_ci_snippet_passes(tmp_path, monkeypatch):
    snippet = _ci_snippet()
    assert "from my_engine import MyEngine" in snippet
    (tmp_path / "my_engine.py").write_text((ROOT / "examples" / "adapters" / "logits_tier.py").read_text())
    (tmp_path / "test_snippet.py").write_text(snippet)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_engine", raising=False)
    namespace = runpy.run_path(str(tmp_path / "test_snippet.py"))
    namespace["test_my_engine_keeps_rope_parity"]()  # raises AssertionError unless parity holds
