"""A vLLM instance in its own process (connector_instance.py), for the connector tests."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

INSTANCE = Path(__file__).with_name("connector_instance.py")
ROOT = Path(__file__).resolve().parents[2]


class Instance:
    """One vLLM process: ``request()`` sends one prompt and waits for its answer (bounded by ``timeout``)."""

    def __init__(self, name: str, spec: dict, log_dir: Path):
        self.name = name
        self.log = log_dir / f"{name}.log"
        # INFO: the tests read the connector's inject lines from the log (an in-process engine test
        # earlier in the session sets VLLM_LOGGING_LEVEL=WARNING in this process's environment).
        env = dict(
            os.environ,
            PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            VLLM_LOGGING_LEVEL="INFO",
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(INSTANCE), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),  # noqa: SIM115 - the child owns it until it exits
            text=True,
            env=env,
        )
        self.ready: float | None = None

    def _line(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"{self.name}: no answer in {timeout} s (log: {self.log})")
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited (rc {self.proc.wait()}): {self.log.read_text()[-3000:]}")
            if line.startswith("{"):
                return json.loads(line)

    def wait_ready(self, timeout: float = 400) -> float:
        if self.ready is None:
            self.ready = float(self._line(timeout)["ready"])
        return self.ready

    def request(self, prompt: list[int], max_tokens: int = 3, timeout: float = 120) -> dict:
        self.wait_ready()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)  # vLLM's orderly shutdown; nothing is left to save
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_text(self) -> str:
        return self.log.read_text()
