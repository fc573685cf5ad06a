"""``ropekv.check``: the parity harness on an engine adapter, or on a checkpoint with ropekv's own engine.

The one place above both the harness (:mod:`ropekv.parity`) and the adapters (:mod:`ropekv.adapters`):
the harness drives any adapter and knows none, so turning a checkpoint into ropekv's engine
happens here.
"""

from __future__ import annotations

import os

import torch

from .adapters.native import NativeAdapter
from .attention_kind import LayerAttention
from .bugs.registry import EXPLANATIONS
from .contract import KeyForm, KvDtype, KvScale
from .engine.attention import BackendName
from .errors import UsageError
from .models.config import Checkpoint
from .parity.cases import Case
from .parity.compare import Tolerance, kv_tolerance
from .parity.diagnose import operation_offsets
from .parity.diagnosis import Diagnosis
from .parity.explain.combine import diagnose_cases
from .parity.explain.evidence import CaseEvidence
from .parity.explain.facts import CaseFacts, ModelFacts
from .parity.harness import check as _check
from .parity.keymap.fit import FitInput, Geometry, fit_keymap
from .parity.keymap.record import NOISE
from .parity.protocol import EngineAdapter
from .parity.reference_cache import ReferenceStore
from .parity.report import Divergence, ParityReport
from .rope import RopeSpec


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
    later checks of the same model on any engine (:mod:`ropekv.parity.reference_cache`). The diagnosis
    tries every registered bug class (:data:`ropekv.bugs.registry.EXPLANATIONS`)."""
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
        explanations=EXPLANATIONS,
    )


def diagnose_row(
    rope: RopeSpec | None,
    *,
    q_raw: torch.Tensor,
    q_eff: torch.Tensor,
    k_raw: torch.Tensor,
    k_eff: torch.Tensor,
    query_position: int,
    key_positions: torch.Tensor,
    key_slots: torch.Tensor | None = None,
    case: Case | None = None,
    handoff_len: int = 0,
    key_form: KeyForm = "rotated",
    dtype: str = "float32",
    self_parity_passed: bool = False,
    visible: torch.Tensor | None = None,
) -> Diagnosis:
    """The forensics of one decode row outside a check: every registered bug class
    (:data:`ropekv.bugs.registry.EXPLANATIONS`) reads the key map of ``q_raw``/``q_eff`` ``[H, D]``
    (the query before RoPE, and as the kernel used it) and ``k_raw``/``k_eff`` ``[N, KVH, D]`` (the keys
    before RoPE and as the kernel used them) at logical ``key_positions [N]``, for a query at
    ``query_position``. ``case``: the case the row comes from (its prefix, block size, window, sinks and
    operation shape the hypotheses; default a plain prompt ending at the query); ``visible [T]``: the
    reference's mask by position (default: exactly the keys given). Raises UsageError on bad shapes."""
    t = int(query_position)
    pos = key_positions.long()
    if k_raw.shape != k_eff.shape or k_raw.dim() != 3 or pos.shape != (k_raw.shape[0],):
        raise UsageError(
            f"diagnose_row: k_raw/k_eff must both be [N, KVH, D] with N positions, got {tuple(k_raw.shape)}"
        )
    if case is None:
        case = Case(length=max(1, t))
    base = int(pos.min())  # the raw rows by index from the lowest position (a sequence shifted far past 0)
    if base < 0:
        raise UsageError(f"diagnose_row: key positions must be >= 0, got {base}")
    table = torch.zeros(int(pos.max()) - base + 1, *k_raw.shape[1:], dtype=torch.float64)
    table[pos - base] = k_raw.double()
    if visible is None:  # exactly the keys given (a mask by position; beyond 2**24 positions, none)
        visible = torch.zeros(int(pos.max()) + 1 if int(pos.max()) < 1 << 24 else 0, dtype=torch.bool)
        if visible.numel():
            visible[pos] = True
    cfg_ropes = (rope,)
    facts = ModelFacts(layer_ropes=cfg_ropes, layer_attentions=(LayerAttention("full"),))
    km = fit_keymap(
        FitInput(
            layer=0,
            rope=rope,
            others=(),
            seq_len=t + 1,
            query_position=t,
            q_raw=q_raw,
            q_eff=q_eff,
            ref_keys=table,
            k_eff=k_eff,
            key_positions=pos,
            key_slots=key_slots if key_slots is not None else torch.full_like(pos, -1),
            visible=visible,
            noise=NOISE[dtype],
            shift=base,
            streams=case.position_streams(),
            geometry=Geometry(
                prefix=case.prefix,
                block_size=case.block_size,
                window=case.window,
                sinks=case.sink_tokens,
                offsets=operation_offsets(case),
            ),
        )
    )
    fd = Divergence("reference", 0, t, 0, 0, int(pos[-1]), -1, 0.0, 0.0, 1.0, 0.0, True)
    case_facts = CaseFacts(
        case=case,
        model=facts,
        divergence=fd,
        layer=0,
        query_position=t,
        step=0,
        role="decode",
        window=case.window,
        chunk_size=None,
        handoff_len=handoff_len,
        key_form=key_form,
        engine_dtype=dtype,
        kv_dtype=None,
        self_passed=self_parity_passed,
        input_matched=True,
        logit_errors=(1.0,),
        self_logit_errors=(1.0 if not self_parity_passed else 0.0,),
        attn_error=1.0,
        tolerance_attn=2e-3,
        tolerance_logits=5e-3,
    )
    return diagnose_cases([CaseEvidence(case_facts, keymap=km)], EXPLANATIONS)
