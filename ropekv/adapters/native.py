"""The adapter for ropekv's own engine (the first implementation of the protocol)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention_kind import MODEL_WINDOWS
from ..cache.policy import CacheOpPolicy
from ..contract import DTYPES, FP8_DTYPE, KV_DTYPES, KV_SCALES, CacheContract, KeyForm, KvDtype, KvScale
from ..engine import Engine
from ..engine.attention import BackendName
from ..engine.rotation import RotationPolicy
from ..engine.transformer import DecoderWeights
from ..errors import UsageError
from ..models.config import Checkpoint
from ..parity.cases import OP_KINDS, Case, OpKind
from ..parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, Tier
from .native_ops import run_op_case
from .native_steps import decode_steps, prefill_case


class NativeAdapter:
    """Runs :class:`~ropekv.engine.Engine` under a contract built per case (block size, window)."""

    tier = Tier.FORENSICS

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        key_form: KeyForm = "rotated",
        backend: BackendName | None = None,
        dtype: str = "float32",
        rotation: RotationPolicy | None = None,
        device: str = "cpu",
        name: str | None = None,
        cache_ops: CacheOpPolicy | None = None,
        contract_change: Callable[[CacheContract], CacheContract] | None = None,
        kv_dtype: KvDtype | None = None,
        kv_scale: KvScale = "per_tensor",
    ):
        if kv_dtype not in (None, *KV_DTYPES):
            raise UsageError(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or None: the compute dtype), got {kv_dtype!r}"
            )
        if kv_scale not in KV_SCALES:
            raise UsageError(f"kv_scale must be one of {', '.join(KV_SCALES)}, got {kv_scale!r}")
        if kv_dtype is not None and dtype != "float32":
            raise UsageError(f"an {kv_dtype} KV cache dequantizes to float32: it needs dtype='float32', got {dtype!r}")
        # an 8-bit cache (vLLM's kv_cache_dtype=fp8): e4m3fn codes with per-layer scales, float32 compute
        self.kv_dtype = kv_dtype
        self.kv_scale: KvScale = kv_scale
        self.checkpoint = checkpoint
        self.key_form = key_form
        self.backend = backend
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.rotation = rotation
        self.cache_ops = cache_ops
        # The contract the engine runs under, from the model's: a fault hands in one that forgets a
        # feature (chunked layers read as full); a correct adapter has none.
        self.contract_change = contract_change
        self.device = device
        kv = "" if kv_dtype is None else f", {kv_dtype} KV cache ({kv_scale} scales)"
        self.name = name or f"ropekv engine ({key_form} keys, {backend or 'default'} backend{kv})"
        self._weights: DecoderWeights | None = None
        self._last_case: Case | None = None  # for describe(): the contract as the cases ran it
        self._block_sizes: set[int] = set()
        # Fail now, not in the middle of a sweep, if the contract and backend cannot work together.
        self.make_engine(Case(length=1), num_blocks=1)

    def contract(self, case: Case) -> CacheContract:
        c = CacheContract.for_model(
            self.checkpoint.config,
            key_form=self.key_form,
            block_size=case.block_size,
            dtype=self.dtype_name if self.kv_dtype is None else FP8_DTYPE,
            window=MODEL_WINDOWS if case.window is None else case.window,
            sink_tokens=case.sink_tokens,
            weights_fingerprint=self.checkpoint.weights_fingerprint,
            kv_scale=None if self.kv_dtype is None else self.kv_scale,
        )
        return c if self.contract_change is None else self.contract_change(c)

    def make_engine(self, case: Case, num_blocks: int | None = None) -> Engine:
        if num_blocks is None:
            # Room for the parent and the child sequence (every row of a batch), plus copy-on-write copies.
            rows = len(case.batch_lengths) if case.op is not None else 1
            rows += 1 if case.op is not None and case.op.kind == OpKind.SPEC else 0  # the drafter's sequence
            draft = case.op.amount if case.op is not None and case.op.kind in (OpKind.ROLLBACK, OpKind.SPEC) else 0
            # Spare blocks for copy-on-write copies: about 64 slots' worth, 2 to 8 blocks (8 blocks of
            # a large block size are gigabytes for a case of a few tokens).
            spare = min(8, max(2, -(-64 // case.block_size)))
            num_blocks = (rows + 1) * (-(-(case.total + draft) // case.block_size)) + spare
        if self._weights is None:
            self._weights = DecoderWeights.from_checkpoint(self.checkpoint, self.dtype, self.device)
        return Engine(
            self.checkpoint,
            self.contract(case),
            num_blocks,
            backend=self.backend,
            rotation=self.rotation,
            device=self.device,
            weights=self._weights,
            cache_ops=self.cache_ops,
        )

    def describe(self) -> EngineDescription:
        """Facts for the report; ``contract`` is the one of the last case run (its block size and window
        are the case's), ``block_sizes`` every block size the cases used."""
        engine = self.make_engine(self._last_case or Case(length=1), num_blocks=1)
        return EngineDescription(
            name=self.name,
            key_form=self.key_form,
            backend=engine.backend.name,
            ops=OP_KINDS,
            extra={
                "dtype": self.dtype_name,
                **({} if self.kv_dtype is None else {"kv_dtype": self.kv_dtype, "kv_scale": self.kv_scale}),
                "rotation_policy": engine.rotation.name,
                "contract": engine.contract.to_dict(),
                "block_sizes": sorted(self._block_sizes),
            },
        )

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        return ()

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        engine = self.make_engine(case)
        self._last_case = case
        self._block_sizes.add(case.block_size)
        if case.op is not None:
            return run_op_case(self.make_engine, engine, case, tokens)
        prefill_case(engine, case, tokens, "prompt")
        return CaseRun(decode_steps(engine, "prompt", case, tokens))

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        engine = self.make_engine(case, num_blocks=1)
        out = engine.forward_full(tokens, probe_rows=rows, logits_rows=rows, streams=case.position_streams())
        return FullRun(rows=torch.as_tensor(rows), logits=out.logits, layers=out.layers)
