"""ropekv's paged engine: the layer math, attention backends, rotation policies and the step loop."""

from .engine import Engine, StepOutput

__all__ = ["Engine", "StepOutput"]
