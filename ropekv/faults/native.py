"""Faults of ropekv's own engine: policies handed to :class:`~ropekv.adapters.native.NativeAdapter`.

A fault here is a small variant of correct code: a :class:`~ropekv.engine.rotation.RotationPolicy`
subclass (how queries and keys turn), a :class:`~ropekv.cache.policy.CacheOpPolicy` subclass (what a
cache operation does to stored keys), a changed model (stale dynamic scaling needs length-dependent
RoPE) or a changed contract (chunked layers read as full). The engine itself has no fault switches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..adapters.native import NativeAdapter
from ..cache.policy import CacheOpPolicy
from ..contract import CacheContract, KeyForm, KvDtype, KvScale
from ..engine.rotation import RotationPolicy
from ..errors import ConfigError, UsageError
from ..models.config import Checkpoint, ModelConfig
from ..parity.cases import CacheOp, Case
from .record import Fault, FaultEngine


@dataclass(frozen=True, kw_only=True)
class NativeFault(Fault):
    """A :class:`Fault` of ropekv's engine.

    - ``key_form``: the key form it runs under (``--key-form`` may choose another unless
      ``fixed_key_form``: the fault only exists in its own key form).
    - ``rotation`` / ``cache_ops``: the policies handed to the engine (None: the correct one).
    - ``model``: the model the fault needs, from the one given (None: that one).
    - ``contract_change``: the contract the faulty engine runs under, from the model's (None: that one).
    - ``needs`` / ``applies``: a model feature the fault needs to show ("": every model has it), and
      whether a model config has it; a model without it is refused.
    - ``exposing``: cases that expose the fault where the default matrix cannot (positions past
      2**15, a non-aligned prefix hit, ...); empty: any matrix with a decode past position 0 does.
    - ``kv_dtype``: the cache dtype the fault needs besides the compute dtype (``"fp8"``: an 8-bit
      cache, :mod:`ropekv.bugs.kv_scale_mismatch`); None: the compute dtype, or what the caller asks for.
    """

    engine: FaultEngine = field(default="ropekv", init=False)
    key_form: KeyForm
    rotation: Callable[[], RotationPolicy] | None = None
    cache_ops: Callable[[], CacheOpPolicy] | None = None
    model: Callable[[Checkpoint], Checkpoint] | None = None
    fixed_key_form: bool = False
    contract_change: Callable[[CacheContract], CacheContract] | None = None
    needs: str = ""
    applies: Callable[[ModelConfig], bool] | None = None
    exposing: tuple[Case, ...] = ()
    kv_dtype: KvDtype | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not all(isinstance(c, Case) for c in self.exposing):
            raise ConfigError(f"fault {self.name!r}: exposing must hold Case objects, got {self.exposing!r}")
        if (self.needs == "") != (self.applies is None):
            raise ConfigError(f"fault {self.name!r}: a needed model feature comes with the test for it (applies)")

    def adapter(
        self,
        checkpoint: Checkpoint,
        *,
        dtype: str = "float32",
        key_form: KeyForm | None = None,
        kv_dtype: KvDtype | None = None,
        kv_scale: KvScale = "per_tensor",
    ) -> NativeAdapter:
        """ropekv's engine with this fault's policies handed in (an 8-bit cache where the fault needs
        one, or where ``kv_dtype`` asks for it; ``kv_scale``: its scales' granularity)."""
        if self.applies is not None and not self.applies(checkpoint.config):
            raise UsageError(
                f"fault {self.name!r} needs a model with {self.needs}; {checkpoint.config.architecture} here has none"
            )
        if self.model is not None:
            checkpoint = self.model(checkpoint)
        form = self.key_form if self.fixed_key_form else (key_form or self.key_form)
        return NativeAdapter(
            checkpoint,
            key_form=form,
            dtype=dtype,
            rotation=self.rotation() if self.rotation else None,
            cache_ops=self.cache_ops() if self.cache_ops else None,
            name=f"ropekv engine with fault {self.name}",
            contract_change=self.contract_change,
            kv_dtype=self.kv_dtype or kv_dtype,
            kv_scale=kv_scale,
        )


@dataclass(frozen=True, kw_only=True)
class OpFault(NativeFault):
    """A :class:`NativeFault` that shows only in a case running ``op``; ``needs_window``: only where the
    ring has wrapped, too."""

    op: CacheOp
    needs_window: bool = False
