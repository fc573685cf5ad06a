"""One catalogued fault, whatever it runs on: the record every entry of the fault registry is.

The fields every fault has are here; what it takes to run one depends on what it runs on, so each
engine's catalogue subclasses :class:`Fault` with that payload (policies for ropekv's engine
(:mod:`.native`), an import policy for the handoff (:mod:`.handoff`), a patch of the live engine for
vLLM (:mod:`.vllm`) and mlx-lm (:mod:`.mlx`)). This module imports no engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ..errors import ConfigError
from ..parity.bug_class import BugClass

FaultEngine = Literal["ropekv", "handoff", "vllm", "mlx", "ort"]
FAULT_ENGINES: tuple[str, ...] = get_args(FaultEngine)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """A named bug, injected to prove the harness catches it and names it.

    - ``name``: what ``--inject`` takes (unique across every engine's catalogue).
    - ``engine``: what it runs on: ropekv's engine, the handoff's import boundary, vLLM or mlx-lm
      patched in the running process. Each subclass fixes it.
    - ``kind``: the :class:`~ropekv.parity.bug_class.BugClass` the check must name (its module under
      :mod:`ropekv.bugs` holds the explanation; a string that spells one is taken as it).
    - ``description``: one line, for listings.
    - ``shows_when``: what a case needs for the fault to show ("" where the catalogue does not say).
    """

    name: str
    engine: FaultEngine
    kind: BugClass
    description: str
    shows_when: str = ""

    def __post_init__(self) -> None:
        if self.engine not in FAULT_ENGINES:
            raise ConfigError(f"fault {self.name!r}: engine must be one of {FAULT_ENGINES}, got {self.engine!r}")
        if not isinstance(self.kind, str) or self.kind not in {k.value for k in BugClass}:
            raise ConfigError(f"fault {self.name!r}: kind must be a BugClass, got {self.kind!r}")
        object.__setattr__(self, "kind", BugClass(self.kind))
        for name in ("name", "description"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"fault {self.name!r}: {name} must be a non-empty string, got {value!r}")
        if not isinstance(self.shows_when, str):
            raise ConfigError(f"fault {self.name!r}: shows_when must be a string, got {self.shows_when!r}")
