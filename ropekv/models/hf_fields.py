"""Typed reads of one ``config.json`` dict's fields, each error naming the file and the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..numbers import is_finite_number, is_int, is_real
from .limits import MAX_CONFIG_INT, bound_text, check_int, shown


class ConfigFields:
    """Reads fields of ``config`` (a transformers ``config.json`` dict, already normalized for its
    architecture); ``source`` names the file in every error."""

    def __init__(self, config: Mapping[str, Any], source: str) -> None:
        self.config = config
        self.source = source

    def need(self, name: str, kind: type = int) -> Any:
        """A required field: an integer (``kind=int``) or a finite number (``kind=float``)."""
        config, source = self.config, self.source
        if name not in config or config[name] is None:
            raise ConfigError(f"{source}: missing field {name!r}")
        value = config[name]
        if kind is int and not is_int(value):
            raise ConfigError(f"{source}: field {name!r} must be an integer, got {shown(value)}")
        if kind is int and abs(value) > MAX_CONFIG_INT:
            raise ConfigError(
                f"{source}: field {name!r} = {shown(value)} is implausible (at most {bound_text(MAX_CONFIG_INT)})"
            )
        if kind is float and not (is_real(value) and is_finite_number(value)):
            raise ConfigError(f"{source}: field {name!r} must be a finite number, got {value!r}")
        return value

    def flag(self, name: str) -> bool:
        """A boolean field (0/1 too); absent or null is False."""
        value = self.config.get(name)
        if value is None:
            return False
        if not isinstance(value, bool) and value not in (0, 1):
            raise ConfigError(f"{self.source}: field {name!r} must be true or false, got {value!r}")
        return bool(value)

    def rule(self, value: bool | str) -> bool:
        """A family's flag: a constant, or the config field that decides it."""
        return value if isinstance(value, bool) else self.flag(value)

    def number(self, name: str, default: float | None) -> float | None:
        """A finite number, ``default`` where absent; None where null (or absent with no default)."""
        value = self.config.get(name, default)
        if value is None:
            return None
        if not (is_real(value) and is_finite_number(value)):
            raise ConfigError(f"{self.source}: field {name!r} must be a finite number, got {value!r}")
        return float(value)

    def optional_int(self, name: str, low: int, high: int = MAX_CONFIG_INT) -> int | None:
        """An integer in ``[low, high]``, or None where absent or null."""
        value = self.config.get(name)
        if value is not None:
            check_int(f"{self.source}: field {name!r}", value, low, high)
        return value
