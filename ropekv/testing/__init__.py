"""ropekv for an engine's own CI: ``assert_parity`` in any pytest suite, and tiny checkpoints.

    from ropekv.testing import assert_parity
    def test_my_engine_keeps_rope_parity():
        assert_parity(MyEngineAdapter(...), lengths=[1, 17, 100], block_sizes=[16])

The pytest plugin (``ropekv.testing.plugin``, registered as a ``pytest11`` entry point) adds the
fixtures ``ropekv_default_checkpoint`` and ``tiny_checkpoint``.
"""

from __future__ import annotations

from ..api import check
from ..parity.report import ParityReport
from .tiny import tiny_checkpoint

__all__ = ["assert_parity", "tiny_checkpoint"]


def assert_parity(engine, **options) -> ParityReport:
    """Run :func:`ropekv.check` on ``engine`` with ``options`` (its keyword arguments) and raise
    ``AssertionError`` unless parity holds; the message is the report table with the first divergence
    and the diagnosis. Returns the report when it passes. Adapter and usage errors propagate as the
    typed :mod:`ropekv.errors` they are (a broken adapter is not a parity failure)."""
    report = check(engine, **options)
    if not report.passed:
        raise AssertionError(f"ropekv parity does not hold for {report.engine.get('name', engine)}:\n{report.table()}")
    return report
