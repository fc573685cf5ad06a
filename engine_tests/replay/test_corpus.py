"""ropekv's replay corpus on the real releases: every buggy release FAILS with the bug class the corpus
records, every fixed release PASSES (run by scripts/test-replay.sh, from .venv).

The whole corpus is replayed once per session (``ropekv.replay.run.replay``: each release in its own
cached venv, the venvs under ``$ROPEKV_REPLAY_VENVS`` or ropekv's default cache folder), then each
entry is one test. Nothing here computes an expected value: the buggy and fixed verdicts come from
ropekv's check against its float64 reference and each release's own uncached forward.

Where ropekv's forensics name a real bug otherwise than the corpus (which records what is right for the
bug), the entry is a strict xfail naming what ropekv says instead: the buggy release must still FAIL
and the fixed one PASS, and the xfail turns into a failure the day the forensics name it right.
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

# entry -> what ropekv's forensics name it today instead of the corpus's class (why, in a few words)
MISNAMED = {
    "tf-hybrid-cache-rolls-early": "unknown: the shifted slots hold other tokens' keys, which no rotation explains",
    "mlx-gemma3-window-mask": "unknown: the mask bug is in the prefill, whose attention ropekv does not record",
    "tf-phi3-longrope-reset-drops-prompt": "unknown: the decode reads only the keys written since the reset",
}


@pytest.fixture(scope="session")
def outcomes() -> dict[str, Outcome]:
    root = Path(os.environ.get("ROPEKV_REPLAY_VENVS") or default_root())

    def log(line: str) -> None:
        print(f"replay: {line}", file=sys.stderr, flush=True)

    return {o.entry.name: o for o in replay(CORPUS, root, log=log)}


@pytest.mark.parametrize("name", [e.name for e in CORPUS.entries])
def test_entry_replays(name: str, outcomes: dict[str, Outcome], request: pytest.FixtureRequest) -> None:
    o = outcomes[name]
    naming_only = [p for p in o.problems if f"named {o.buggy.kind}, expected {o.entry.expect.value}" in p]
    other = [p for p in o.problems if p not in naming_only]
    assert not other, "; ".join(other)  # an install, a crash, a buggy PASS or a fixed FAIL: never excused
    assert o.buggy.passed is False and o.fixed.passed is True
    if name in MISNAMED:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"ropekv names it {MISNAMED[name]}"))
    assert not naming_only, naming_only[0]


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
