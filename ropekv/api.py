"""``ropekv.check``: the parity harness on an engine adapter, or on a checkpoint with ropekv's own engine.

The one place above both the harness (:mod:`ropekv.parity`) and the adapters (:mod:`ropekv.adapters`):
the harness drives any adapter and knows none, so turning a checkpoint into ropekv's engine
happens here.
"""

from __future__ import annotations

import os

from .adapters.native import NativeAdapter
from .contract import KeyForm, KvDtype, KvScale
from .engine.attention import BackendName
from .errors import UsageError
from .models.config import Checkpoint
from .parity.cases import Case
from .parity.compare import Tolerance, kv_tolerance
from .parity.harness import check as _check
from .parity.protocol import EngineAdapter
from .parity.reference_cache import ReferenceStore
from .parity.report import ParityReport


def check(
    engine: EngineAdapter | Checkpoint,
    *,
    lengths: list[int] | None = None,
    block_sizes: list[int] | None = None,
    prefix_offsets: list[int] | None = None,
    window: int | None = None,
    sink_tokens: int = 0,
    chunk: int | None = None,
    decode_steps: int | None = None,
    dtype: str | None = None,
    reference: str = "float64",
    key_form: KeyForm | None = None,
    backend: BackendName | None = None,
    seed: int = 0,
    cases: list[Case] | None = None,
    progress: bool | str = False,
    tolerance: Tolerance | None = None,
    reference_cache: str | os.PathLike[str] | ReferenceStore | None = None,
    kv_dtype: KvDtype | None = None,
    kv_scale: KvScale = "per_tensor",
) -> ParityReport:
    """:func:`ropekv.parity.harness.check` on ``engine``; a :class:`Checkpoint` runs on ropekv's own
    engine with ``key_form`` (default rotated), ``backend`` and ``dtype`` (default float32), and with
    ``kv_dtype="fp8"`` an 8-bit KV cache (``kv_scale`` scales) judged at its own tolerance
    (:func:`~ropekv.parity.compare.kv_tolerance`) unless ``tolerance`` is given.
    ``reference_cache``: a folder where the float64 reference's per-case rows are stored and reused by
    later checks of the same model on any engine (:mod:`ropekv.parity.reference_cache`)."""
    if kv_dtype is not None and not isinstance(engine, Checkpoint):
        raise UsageError("kv_dtype chooses ropekv's own cache: pass a Checkpoint, or build the adapter with it")
    if isinstance(engine, Checkpoint):
        engine = NativeAdapter(
            engine,
            key_form=key_form or "rotated",
            backend=backend,
            dtype=dtype or "float32",
            kv_dtype=kv_dtype,
            kv_scale=kv_scale,
        )
        if kv_dtype is not None and tolerance is None:
            tolerance = kv_tolerance(kv_dtype)
    return _check(
        engine,
        lengths=lengths,
        block_sizes=block_sizes,
        prefix_offsets=prefix_offsets,
        window=window,
        sink_tokens=sink_tokens,
        chunk=chunk,
        decode_steps=decode_steps,
        dtype=dtype,
        reference=reference,
        key_form=key_form,
        backend=backend,
        seed=seed,
        cases=cases,
        progress=progress,
        tolerance=tolerance,
        reference_cache=reference_cache,
    )
