"""One exception hierarchy for every user-facing failure in ropekv.

Every public entry point raises a subclass of :class:`RopeKVError`. The CLI turns each into a one-line
message on stderr and the class's ``exit_code`` (documented in docs/errors.md); a traceback is printed
only with ``--debug``. Exit code 1 is reserved for "parity does not hold", which is a result, not an error.
"""

from __future__ import annotations


class RopeKVError(Exception):
    """Base class of every error ropekv raises on purpose."""

    exit_code = 2


class UsageError(RopeKVError):
    """A call or command line that cannot be honoured (bad flag value, unknown fault name, ...)."""


class NotApplicable(UsageError):
    """A request that does not apply to this model or engine: a cache operation the RoPE or the engine
    cannot run, a case longer than the model's positions, a case parameter the engine ignores that
    would change the expected output. The parity harness reports such a case as ``n/a`` with this
    message and judges the others; where nothing is left to judge it is raised (exit 2)."""


class ConfigError(RopeKVError):
    """A model or RoPE configuration that is malformed, incomplete or of an unsupported kind."""


class CheckpointError(RopeKVError):
    """A checkpoint that cannot be loaded: missing files, pickles, bad headers, wrong tensors."""


class ContractMismatch(RopeKVError):
    """Two cache contracts disagree where keys cross a boundary (append, import, handshake)."""

    exit_code = 3

    def __init__(self, message: str, fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.fields = tuple(fields)


class CacheError(RopeKVError):
    """An operation on cached state that would break it: non-increasing positions, unknown sequence,
    a fork longer than the cached prefix. The cache is left exactly as it was."""


class CapacityError(CacheError):
    """The block pool has no room for the request. Nothing is evicted silently."""


class PayloadError(RopeKVError):
    """A handoff payload that is truncated, corrupted, inconsistent or of an unknown format."""


class AdapterError(RopeKVError):
    """An engine adapter that does not keep the protocol: a missing member, a result that does not fit
    its case (steps, layers, shapes, dtypes, positions, non-finite values), or an option it cannot
    honour. The message names the adapter, the field, what was expected and what came."""

    def __init__(self, adapter: str, field: str, expected: str, got: str):
        super().__init__(f"adapter {adapter!r}: {field}: expected {expected}, got {got}")
        self.adapter, self.field, self.expected, self.got = adapter, field, expected, got


class EngineUnavailable(RopeKVError):
    """An engine whose package is not importable in this environment (run it from its own venv)."""


class TransportError(RopeKVError):
    """A peer in a prefill->decode handoff failed or went silent."""

    exit_code = 4


ALL_ERRORS: tuple[type[RopeKVError], ...] = (
    RopeKVError,
    UsageError,
    NotApplicable,
    ConfigError,
    CheckpointError,
    ContractMismatch,
    CacheError,
    CapacityError,
    PayloadError,
    AdapterError,
    EngineUnavailable,
    TransportError,
)
