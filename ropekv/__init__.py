"""ropekv: make the RoPE convention of a KV cache explicit, enforce it where keys cross a boundary, and
prove, layer by layer, that cached decoding matches a full forward pass.

Entry points: :func:`check` (the parity harness), :func:`ropekv.models.load` (a checkpoint's float64
reference decoder), :class:`~ropekv.engine.Engine` (the paged engine), :class:`~ropekv.contract.CacheContract`.
"""

from .errors import RopeKVError

__version__ = "0.1.0"


def check(engine, **kwargs):
    """Run the parity harness; see :func:`ropekv.parity.harness.check`."""
    from .parity.harness import check as _check

    return _check(engine, **kwargs)


__all__ = ["check", "RopeKVError", "__version__"]
