"""Ctrl-C during ``ropekv handoff``: one line, exit 130, every rank stopped and reaped, nothing leaked.

``ropekv handoff`` runs as a subprocess in its own session (a terminal's foreground process group), and
SIGINT goes either to the whole group (what Ctrl-C in a terminal does) or to the launcher alone (a
supervisor's kill -INT). The launcher's temporary folder (under ``TMPDIR``) tells the test when the
ranks are being started and when they run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Several seconds of decoding once the ranks run (the tiny model has 256 positions), so the interrupt
# finds them at work, never a run that already finished.
LONG_RUN = ["--lengths", "120,130,140,150", "--decode-steps", "100"]


def _wait_for(predicate, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the handoff to reach the phase")
        time.sleep(0.05)


def _group_is_empty(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _start_session(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python ARGV`` from the repository root in a session of its own (a terminal's foreground
    process group), SIGINT at its default so Ctrl-C reaches Python as KeyboardInterrupt."""
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.parametrize("phase,target", [("starting", "launcher"), ("running", "group")])
def test_ctrl_c_stops_every_rank_with_one_line(tiny_llama_dir, tmp_path, phase, target):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _start_session(
        ["-m", "ropekv.cli.main", "handoff", str(tiny_llama_dir), *LONG_RUN], {**os.environ, "TMPDIR": str(tmp)}
    )
    try:
        workdirs = lambda: list(tmp.glob("ropekv-handoff-*"))
        _wait_for(lambda: bool(workdirs()), 120)  # the launcher is starting the ranks
        if phase == "running":
            _wait_for(lambda: any((w / "rank1.log").exists() for w in workdirs()), 120)
            time.sleep(0.5)  # the ranks load the model, shake hands, transfer
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert out == "" and proc.returncode == 130, err  # interrupted before any table
    assert err == "ropekv: interrupted\n"  # no traceback, no rank's output, no "leaked semaphore" warning
    # every process of the session is gone: the ranks, the forkserver and the resource tracker
    _wait_for(lambda: _group_is_empty(proc.pid), 20)
    assert not list(tmp.glob("ropekv-handoff-*"))  # the launcher's folder was removed


_LAUNCH = """
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from handoff_hooks import HangWithProgressBar
from ropekv.handoff.workers import launch
model, workdir, marker = sys.argv[1:]
try:
    launch([model, "--lengths", "3,5", "--timeout", "30"], 2, timeout=30, workdir=Path(workdir),
           hooks=HangWithProgressBar(0, marker))
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
"""


def test_interrupted_launcher_stops_a_busy_rank_without_leaking(tiny_llama_dir, tmp_path):
    """A rank busy in its work (a progress bar open, a wait in progress) when the launcher alone is
    interrupted: the launcher stops and reaps it; the resource tracker has nothing to warn about."""
    marker = tmp_path / "rank-is-busy"
    proc = _start_session(["-c", _LAUNCH, str(tiny_llama_dir), str(tmp_path), str(marker)])
    try:
        _wait_for(marker.exists, 120)
        busy = int(marker.read_text())
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and err == "interrupted\n", err  # no "leaked semaphore" warning
    _wait_for(lambda: _group_is_empty(proc.pid), 20)
    with pytest.raises(ProcessLookupError):
        os.kill(busy, 0)
