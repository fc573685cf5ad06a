"""ropekv's replay corpus on the real releases: every buggy release FAILS with the bug class the corpus
records, every fixed release PASSES (run by scripts/test-replay.sh, from .venv).

The whole corpus is replayed once per session (``ropekv.replay.run.replay``: each release in its own
cached venv, the venvs under ``$ROPEKV_REPLAY_VENVS`` or ropekv's default cache folder), then each
entry is one test. Nothing here computes an expected value: the buggy and fixed verdicts come from
ropekv's check against its float64 reference and each release's own uncached forward.

An entry replays only when the buggy release FAILS under the bug class the corpus records (what is right
for the bug, never what ropekv happened to say), and the fixed release PASSES.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ropekv.replay.corpus import load_corpus
from ropekv.replay.run import Outcome, replay
from ropekv.replay.venvs import default_root

CORPUS = load_corpus()


@pytest.fixture(scope="session")
def outcomes() -> dict[str, Outcome]:
    root = Path(os.environ.get("ROPEKV_REPLAY_VENVS") or default_root())

    def log(line: str) -> None:
        print(f"replay: {line}", file=sys.stderr, flush=True)

    return {o.entry.name: o for o in replay(CORPUS, root, log=log)}


@pytest.mark.parametrize("name", [e.name for e in CORPUS.entries])
def test_entry_replays(name: str, outcomes: dict[str, Outcome]) -> None:
    o = outcomes[name]
    assert not o.problems, "; ".join(o.problems)  # an install, a crash, a buggy PASS, a fixed FAIL, a misnaming
    assert o.buggy.passed is False and o.buggy.kind == o.entry.expect.value
    assert o.fixed.passed is True


USER_CORPUS = """
[[entry]]
name = "my-starcoder2-window"
engine = "transformers"
buggy = "4.45.2"
fixed = "4.46.0"
upstream = "written by a user: the sliding-window mask of 4.45 checked on another architecture"
story = "Starcoder2's eager mask ignores sliding_window before 4.46, as Phi-3's does."
expect = "window_mismatch"
[entry.model]
model_type = "starcoder2"
sliding_window = 8
[entry.case]
length = 12
decode_steps = 4
[entry.options]
drive = "generate"
"""


def test_a_users_own_corpus_file_runs_through_the_same_command(tmp_path, capsys) -> None:
    from ropekv.cli.main import main

    corpus = tmp_path / "mine.toml"  # outside the repository
    corpus.write_text(USER_CORPUS)
    root = os.environ.get("ROPEKV_REPLAY_VENVS") or str(default_root())
    assert main(["replay", "--corpus", str(corpus), "--venvs", root, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "my-starcoder2-window  transformers  4.45.2  FAIL     window_mismatch" in out
    assert out.rstrip().endswith("1 of 1 entries replay (1 engine: transformers)")
