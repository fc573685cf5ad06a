"""Replaying a corpus: each entry's buggy and fixed releases, each in its own venv, judged side by side.

For each entry: build (or reuse) the tiny model, then for the buggy release and the fixed one build (or
reuse) its venv and run :mod:`ropekv.replay.worker` there on the entry's case. An entry replays when

- the buggy release FAILS and ropekv names the entry's expected bug class, and
- the fixed release PASSES.

Anything else is the entry's failure, with its reason: a venv that did not install, a worker that
crashed or ran past its time, a release that is not the one asked for, the buggy release passing, the
buggy release failing under another name than the expected one (the corpus says what is right for the
bug; a wrong name is ropekv's to fix), the fixed release failing. Nothing is skipped.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .corpus import Corpus, Entry
from .model import model_dir
from .venvs import InstallFailed, VenvStore

WORKER_TIMEOUT_S = 900  # one side: python, torch and the engine start, then one tiny case


@dataclass(frozen=True)
class Side:
    """One release of an entry as it ran: its verdict and what ropekv named, or why it could not run."""

    version: str
    ran_version: str | None = None
    passed: bool | None = None
    kind: str | None = None
    evidence: str | None = None
    divergence: str | None = None
    max_dlogit: float | None = None
    case: str | None = None
    reading: tuple[str, ...] = ()  # where the engine reads the config otherwise than transformers
    error: str | None = None
    install_seconds: float = 0.0
    run_seconds: float = 0.0

    def verdict(self) -> str:
        if self.error is not None:
            return "ERROR"
        return "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Outcome:
    """An entry's two sides and whether they replay the bug as the corpus records it."""

    entry: Entry
    buggy: Side
    fixed: Side
    problems: tuple[str, ...] = field(default=())

    @property
    def replayed(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        e = self.entry
        return {
            "name": e.name,
            "engine": e.engine,
            "upstream": e.upstream,
            "expect": e.expect.value,
            "replayed": self.replayed,
            "problems": list(self.problems),
            "buggy": self.buggy.to_dict(),
            "fixed": self.fixed.to_dict(),
        }


def judge(entry: Entry, buggy: Side, fixed: Side) -> Outcome:
    """The entry's problems (none: it replays): see the module doc."""
    problems = []
    for label, side in (("buggy", buggy), ("fixed", fixed)):
        if side.error is not None:
            problems.append(f"{label} {side.version}: {side.error}")
        elif side.ran_version != side.version:
            problems.append(f"{label}: asked for {entry.engine} {side.version}, the venv ran {side.ran_version}")
    if buggy.error is None and buggy.passed:
        problems.append(f"buggy {buggy.version} PASSES: the bug does not show on this case")
    elif buggy.error is None and buggy.kind != entry.expect.value:
        problems.append(f"buggy {buggy.version} named {buggy.kind}, expected {entry.expect.value}: {buggy.evidence}")
    if fixed.error is None and not fixed.passed:
        problems.append(
            f"fixed {fixed.version} FAILS ({fixed.kind}, max |dlogit| {fixed.max_dlogit:.3g}, {fixed.divergence})"
        )
    return Outcome(entry, buggy, fixed, tuple(problems))


def replay(corpus: Corpus, root: Path, *, log: Callable[[str], None] = lambda _: None, seed: int = 0) -> list[Outcome]:
    """Every entry of ``corpus``, in order; venvs and models under ``root``."""
    store = VenvStore(root, log)
    outcomes = []
    total = len(corpus.entries)
    for i, entry in enumerate(corpus.entries, 1):
        start = time.monotonic()
        log(f"[{i}/{total}] {entry.name}: tiny {entry.model['model_type']} model")
        folder = model_dir(root, entry)
        sides = []
        for label, version in (("buggy", entry.buggy), ("fixed", entry.fixed)):
            log(f"[{i}/{total}] {entry.name}: {entry.engine} {version} ({label})")
            sides.append(_side(store, entry, version, folder, seed))
        outcome = judge(entry, *sides)
        outcomes.append(outcome)
        verdict = "replays" if outcome.replayed else "DOES NOT replay: " + "; ".join(outcome.problems)
        log(f"[{i}/{total}] {entry.name}: {verdict} ({time.monotonic() - start:.0f} s)")
    return outcomes


def _side(store: VenvStore, entry: Entry, version: str, folder: Path, seed: int) -> Side:
    try:
        venv = store.release(entry.engine, version)
    except InstallFailed as exc:
        return Side(version, error=str(exc))
    request = {
        "engine": entry.engine,
        "model_dir": str(folder),
        "case": dataclasses.asdict(entry.case),
        "options": dict(entry.options),
        "seed": seed,
    }
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ropekv-replay-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        try:
            done = subprocess.run(
                [str(venv.python), "-m", "ropekv.replay.worker", str(req), str(out)],
                capture_output=True,
                text=True,
                timeout=WORKER_TIMEOUT_S,
                env={**_base_env(), **env},
                check=False,
            )
        except subprocess.TimeoutExpired:
            return Side(version, error=f"the check ran past {WORKER_TIMEOUT_S} s", install_seconds=venv.seconds)
        seconds = time.monotonic() - start
        if done.returncode != 0 or not out.is_file():
            tail = [line for line in done.stderr.splitlines() if line.strip()]
            reason = tail[-1].strip() if tail else f"exit code {done.returncode}"
            return Side(version, error=f"the worker crashed: {reason}", install_seconds=venv.seconds)
        result = json.loads(out.read_text())
    if "error" in result:
        return Side(version, error=str(result["error"]), install_seconds=venv.seconds, run_seconds=seconds)
    return Side(
        version,
        ran_version=result.get("version"),
        passed=bool(result.get("passed")),
        kind=result.get("kind"),
        evidence=result.get("evidence"),
        divergence=result.get("divergence"),
        max_dlogit=result.get("max_dlogit"),
        case=result.get("case"),
        reading=tuple(result.get("reading", ())),
        install_seconds=venv.seconds,
        run_seconds=seconds,
    )


def _base_env() -> dict[str, str]:
    """The caller's environment less anything that would point the worker at another Python or venv."""
    import os

    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    return {k: v for k, v in os.environ.items() if k not in drop}
