"""``ropekv check --engine module:Class`` / ``--engine path/to/file.py:Class``: your own adapter.

The named class (any attribute of the module) is constructed with its ``load`` classmethod,
``Class.load(model, dtype=dtype)``: ``model`` is the command line's MODEL argument as given (a path
string, or None for the default model), ``dtype`` the ``--dtype`` name (``"float32"``, ...). The
object it returns is checked against the adapter protocol (:func:`ropekv.parity.validate.check_adapter`)
before any case runs. ``ropekv.adapters.hf:HFEngine`` follows this convention too.

This runs user code, as ``pytest`` or ``python file.py`` does: the named module is imported, or the
named file is executed (its folder first on ``sys.path``, so it can import its neighbours). Nothing
else is imported or executed: no discovery, no entry points, no code from the checkpoint.
Every refusal is one line: no such module or file, no such attribute, no ``load``, not an adapter.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .. import user_code
from ..errors import AdapterError, RopeKVError, UsageError
from .adapter_guard import AdapterGuard, GuardedAdapter, safe_text

if TYPE_CHECKING:
    from ..parity.protocol import EngineAdapter


@dataclass(frozen=True)
class CustomEngine:
    """A parsed ``--engine`` value naming user code: ``module:attribute`` or ``file.py:attribute``."""

    spec: str  # as given on the command line
    target: str  # a dotted module name, or a path to a .py file
    attribute: str
    is_file: bool

    @staticmethod
    def parse(spec: str) -> CustomEngine | None:
        """None where ``spec`` has no ``:`` (a registered engine's name); UsageError if malformed."""
        if ":" not in spec:
            return None
        target, _, attribute = spec.rpartition(":")
        is_file = target.endswith(".py") or "/" in target or "\\" in target
        if not target or not attribute.isidentifier():
            raise UsageError(f"--engine {spec}: expected module:Class or path/to/file.py:Class")
        if not is_file and not all(part.isidentifier() for part in target.split(".")):
            raise UsageError(f"--engine {spec}: {target!r} is not a module name (a file needs the .py suffix)")
        return CustomEngine(spec, target, attribute, is_file)

    def load(
        self, model: str | None, dtype: str, *, guard: AdapterGuard | None = None, kv_dtype: str | None = None
    ) -> EngineAdapter:
        """The adapter: ``Class.load(model, dtype=dtype)`` (and ``kv_dtype=`` where one is asked for),
        checked against the protocol, every later call into it fenced by ``guard``
        (:mod:`ropekv.cli.adapter_guard`: one line for an exit, an interrupt, a print, a hang)."""
        guard = guard or AdapterGuard(self.spec)
        owner = guard.call("import", self._import)
        if not hasattr(owner, self.attribute):
            raise UsageError(f"--engine {self.spec}: {self.target} has no attribute {self.attribute!r}")
        factory = getattr(owner, self.attribute)
        load = factory.load if hasattr(factory, "load") else None  # the one constructor ropekv calls
        if not callable(load):
            raise UsageError(
                f"--engine {self.spec}: {self.attribute} has no load(model, dtype) classmethod "
                "(see docs/adapters.md, 'From the command line')"
            )
        extra = {} if kv_dtype is None else {"kv_dtype": kv_dtype}
        what = "load(model, dtype" + (", kv_dtype" if extra else "") + ")"
        adapter = guard.call(what, lambda: load(model, dtype=dtype, **extra))
        return cast("EngineAdapter", GuardedAdapter(adapter, guard))  # its members are checked there

    def _import(self) -> Any:
        if self.is_file or self.target.split(".")[0] != "ropekv":  # ropekv's own adapters are not user code
            user_code.mark_loaded(self.spec)  # before it runs: from here on this process runs the user's code
        if not self.is_file:
            try:
                return importlib.import_module(self.target)
            except ModuleNotFoundError as exc:
                if exc.name is not None and (self.target == exc.name or self.target.startswith(exc.name + ".")):
                    raise UsageError(f"--engine {self.spec}: no module named {exc.name!r}") from None
                raise _user_error(self, "import", exc) from exc
            except Exception as exc:
                raise _user_error(self, "import", exc) from exc
        path = Path(self.target).expanduser()
        if not path.is_file():
            why = "is not a file" if path.exists() else "no such file"
            raise UsageError(f"--engine {self.spec}: {path}: {why}")
        name = "ropekv_user_engine_" + "".join(c if c.isalnum() else "_" for c in path.stem)
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise UsageError(f"--engine {self.spec}: {path} cannot be imported as a Python file")
        module = importlib.util.module_from_spec(spec)
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # as `python file.py` does: the file may import its neighbours
        sys.modules[name] = module  # dataclasses and typing look the module up while it executes
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:  # SystemExit too: the guard around this call reports it
            del sys.modules[name]
            if not isinstance(exc, Exception):
                raise
            raise _user_error(self, "import", exc) from exc
        return module


def _user_error(engine: CustomEngine, what: str, exc: Exception) -> RopeKVError:
    if isinstance(exc, RopeKVError):
        return exc
    return AdapterError(engine.spec, what, "no exception", safe_text(exc))
