"""Every call into a user's adapter (``--engine module:Class``), fenced: one line and exit 2 for anything
it does wrong, never ropekv's exit 0, a traceback, or a hang.

An adapter is user code run inside ropekv's process, so besides raising it can:

- call ``sys.exit(0)`` (``SystemExit``): without a fence ``ropekv check`` would end with exit 0 and no
  verdict, which a CI job reads as parity holding;
- raise ``KeyboardInterrupt`` itself, which must not read as the user's Ctrl-C (exit 130);
- raise an exception whose ``str()`` raises in turn, or expose a ``tier`` property that raises;
- print, which would mix into the report on stdout (the report is documented as stdout);
- sleep or spin forever.

:class:`AdapterGuard` runs each call with stdout sent to stderr, under a time limit, and turns every
one of these into :class:`~ropekv.errors.AdapterError` naming the call. :class:`GuardedAdapter` is the
adapter the harness sees: the protocol's members read once through the guard, its methods called
through it.

The time limit is ``signal.setitimer`` in the main thread, not a worker thread joined with a timeout:
a thread cannot be stopped, so a spinning adapter would keep running (and holding the engine's
memory and the GIL) after the error, and the report would then race it; an alarm raises inside the
adapter's own frame, so the process unwinds and reports. A call blocked inside C code that does not
return to the interpreter is only interrupted when it does. Off the main thread (signals cannot be
handled there) calls run without a limit.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from ..argtypes import MAX_TIMEOUT_S
from ..errors import AdapterError, RopeKVError
from ..models.config import Checkpoint
from ..parity.cases import Case
from ..parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, Tier

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 600.0  # per adapter call: a real engine's load or longest case, with room


class _Timeout(BaseException):
    """Raised by the alarm inside the adapter's frame; a BaseException so ``except Exception`` in the
    adapter cannot swallow it."""


def safe_text(exc: BaseException, limit: int = 300) -> str:
    """``"Type: first line of str(exc)"``, cut to ``limit``; never raises, even where ``str()`` does."""
    try:
        text = str(exc)
    except BaseException:  # an adapter's exception whose __str__ raises: name its type only
        text = "(its message could not be read)"
    first = text.splitlines()[0] if text else ""
    try:
        kind = type(exc).__name__
    except BaseException:
        kind = "exception"
    return f"{kind}: {first}"[:limit] if first else kind


class AdapterGuard:
    """Runs calls into the adapter ``spec`` (as given to ``--engine``), each within ``timeout_s`` seconds."""

    def __init__(self, spec: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
        self.spec, self.timeout_s = spec, float(timeout_s)
        self._user_interrupt = False

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``; any way it fails is AdapterError naming ``what`` (a RopeKVError it
        raises passes unchanged: adapters may refuse with ropekv's own errors)."""
        self._user_interrupt = False
        try:
            with contextlib.redirect_stdout(sys.stderr), self._limits():
                return fn(*args, **kwargs)
        except RopeKVError:
            raise
        except _Timeout:
            raise AdapterError(
                self.spec, what, f"an answer within {self.timeout_s:g} s (--adapter-timeout)", "none"
            ) from None
        except KeyboardInterrupt as exc:
            if self._user_interrupt:
                raise  # the user's Ctrl-C: exit 130 as everywhere else
            raise AdapterError(self.spec, what, "no exception", "KeyboardInterrupt raised by the adapter") from exc
        except SystemExit as exc:
            code = _safe_repr(exc.code)
            raise AdapterError(
                self.spec, what, "a return (an adapter must not end the process)", f"sys.exit({code})"
            ) from None
        except Exception as exc:
            raise AdapterError(self.spec, what, "no exception", safe_text(exc)) from exc

    @contextlib.contextmanager
    def _limits(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
            yield  # signals are only delivered to the main thread: no limit here
            return

        def alarm(signum: int, frame: object) -> None:
            raise _Timeout()

        def interrupt(signum: int, frame: object) -> None:
            self._user_interrupt = True
            raise KeyboardInterrupt

        old_alarm = signal.signal(signal.SIGALRM, alarm)
        old_int = signal.signal(signal.SIGINT, interrupt)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_alarm)
            signal.signal(signal.SIGINT, old_int)


def _safe_repr(value: object) -> str:
    try:
        return repr(value)[:80]
    except BaseException:
        return type(value).__name__


class GuardedAdapter:
    """``adapter`` as the harness drives it: ``name``, ``tier``, ``dtype`` and ``checkpoint`` read once
    (through the guard, so a raising property is one line), each method called through the guard."""

    def __init__(self, adapter: object, guard: AdapterGuard):
        from ..parity.validate import check_adapter

        self._adapter, self._guard = adapter, guard
        self.tier: Tier = guard.call("the protocol's members", check_adapter, adapter)
        members: Any = adapter
        name = guard.call("name", lambda: members.name)
        self.name: str = name if isinstance(name, str) and name else guard.spec
        self.dtype: torch.dtype = guard.call("dtype", lambda: members.dtype)
        self.checkpoint: Checkpoint = guard.call("checkpoint", lambda: members.checkpoint)

    def describe(self) -> EngineDescription:
        return self._guard.call("describe()", self._method("describe"))

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        return self._guard.call(f"ignored({case.label()})", self._method("ignored"), case)

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        return self._guard.call(f"run_case({case.label()})", self._method("run_case"), case, tokens)

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        return self._guard.call(f"full_forward({len(tokens)} tokens)", self._method("full_forward"), tokens, rows, case)

    def _method(self, name: str) -> Callable[..., Any]:
        members: Any = self._adapter
        return lambda *args: getattr(members, name)(*args)
