"""ropekv: make the RoPE convention of a KV cache explicit, enforce it where keys cross a boundary, and
prove, layer by layer, that cached decoding matches a full forward pass.

Entry points: :func:`check` (the parity harness on an adapter or a checkpoint, :mod:`ropekv.api`),
:func:`ropekv.testing.assert_parity` (for an engine's CI), :func:`ropekv.models.load` (a checkpoint's
float64 reference decoder), :class:`~ropekv.engine.Engine` (the paged engine),
:class:`~ropekv.contract.CacheContract`, the adapter protocol in :mod:`ropekv.parity.protocol`.
"""

from .errors import RopeKVError

__version__ = "0.1.0"
__all__ = ["check", "diagnose_row", "RopeKVError", "__version__"]


def __getattr__(name: str):
    # ``ropekv.check`` is the harness function itself (its real signature), imported on first use so
    # that ``import ropekv`` (and ``ropekv --help``) stays light.
    if name in ("check", "diagnose_row"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'ropekv' has no attribute {name!r}")
