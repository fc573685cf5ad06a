"""Parity across a prefill->decode handoff: the adapter the harness drives.

:class:`HandoffAdapter` runs a case's prefill on a prefill engine, serializes the sequence to payload
bytes, reads them back, imports them into a decode engine (whose contract may differ by the key form
when ``convert="explicit"``) and decodes there with probes. ``full_forward`` is the decode engine's own,
so the harness compares "prefill on A + decode on B" with a full forward on B and with the float64
reference. The workers use :class:`ServedHandoffAdapter`, whose sequences arrived over the transport.
Handoff faults are import policies handed in (``ropekv.faults.handoff``).

``CaseRun.handoff_len`` is the number of imported tokens: forensics names ``rotate_on_transfer`` when
the keys below it sit at ``2j`` and later keys at ``j``.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..adapters.native import NativeAdapter
from ..adapters.native_steps import decode_steps, prefill_case
from ..cache.import_policy import ImportPolicy
from ..contract import CacheContract, KeyForm
from ..engine import Engine
from ..errors import UsageError
from ..models.config import Checkpoint
from ..parity.cases import Case
from ..parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, Tier
from ..transfer.importer import export_handoff, import_handoff, plan_import
from ..transfer.payload import read_payload, write_payload


@dataclass(frozen=True)
class TransferFacts:
    """One in-process handoff: payload size against the raw key/value bytes, and the time it took."""

    seq_id: Hashable
    tokens: int
    payload_bytes: int
    tensor_bytes: int
    write_seconds: float
    read_import_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self), seq_id=str(self.seq_id))


class HandoffAdapter:
    """Prefill on one :class:`Engine`, hand off through payload bytes, decode on another."""

    tier = Tier.FORENSICS

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        prefill_key_form: KeyForm = "rotated",
        decode_key_form: KeyForm | None = None,
        convert: str = "never",
        dtype: str = "float32",
        decode_checkpoint: Checkpoint | None = None,
        policy: ImportPolicy | None = None,
        name: str | None = None,
    ):
        prefill = NativeAdapter(checkpoint, key_form=prefill_key_form, dtype=dtype, name="prefill")
        decode = NativeAdapter(
            decode_checkpoint or checkpoint, key_form=decode_key_form or prefill_key_form, dtype=dtype, name="decode"
        )
        self._init_sides(prefill, decode, prefill.contract(Case(length=1)), convert, policy, name)

    def _init_sides(
        self,
        prefill: NativeAdapter | None,
        decode: NativeAdapter,
        prefill_contract: CacheContract,
        convert: str,
        policy: ImportPolicy | None,
        name: str | None,
    ) -> None:
        self.prefill_side, self.decode_side = prefill, decode
        self.prefill_contract = prefill_contract
        self.checkpoint = decode.checkpoint
        self.dtype, self.dtype_name, self.key_form = decode.dtype, decode.dtype_name, decode.key_form
        self.convert = convert
        self.policy = policy or ImportPolicy()
        fault = "" if self.policy.name == "correct" else f", fault {self.policy.name}"
        self.name = name or f"handoff {prefill_contract.key_form} -> {self.key_form} (convert={convert}{fault})"
        self.transfers: list[TransferFacts] = []
        # Refuse now, not mid-sweep: the contracts must be equal or differ only by a convertible key form.
        # (at the prefill side's block size: the block size is a per-case storage choice both sides share)
        self.conversion = plan_import(
            decode.contract(Case(length=1, block_size=prefill_contract.block_size)), prefill_contract, convert
        )

    def describe(self) -> EngineDescription:
        return EngineDescription(
            name=self.name,
            key_form=self.key_form,
            extra={
                "dtype": self.dtype_name,
                "convert": self.convert,
                "conversion": self.conversion,
                "import_policy": self.policy.name,
                "prefill_contract": self.prefill_contract.to_dict(),
                "decode": self.decode_side.describe().to_dict(),
            },
        )

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        return (Ignored("op", "op: a handed-off case runs no cache operation"),) if case.op is not None else ()

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        engine, seq_id, n = self.handed_off(case, tokens)
        return CaseRun(decode_steps(engine, seq_id, case, tokens), handoff_len=n)

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        return self.decode_side.full_forward(tokens, rows, case)

    def handed_off(self, case: Case, tokens: torch.Tensor) -> tuple[Engine, Hashable, int]:
        """Prefill the case (prefix hit included), hand it off; returns (decode engine, sequence, tokens)."""
        if self.prefill_side is None:
            raise UsageError(f"no prefill side to run case {case.label()} on")
        prefill = self.prefill_side.make_engine(case)
        seq, n = "prompt", case.prefix + case.length
        prefill_case(prefill, case, tokens, seq)
        t0 = time.perf_counter()
        handoff = export_handoff(prefill.cache, seq, tokens[:n])
        data = write_payload(handoff)
        t1 = time.perf_counter()
        decode = self.decode_side.make_engine(case)
        import_handoff(decode.cache, read_payload(data), convert=self.convert, policy=self.policy)
        self.transfers.append(
            TransferFacts(seq, n, len(data), handoff.tensor_bytes(), t1 - t0, time.perf_counter() - t1)
        )
        return decode, seq, n


class ServedHandoffAdapter(HandoffAdapter):
    """The decode rank's view: sequences the transport already imported into ``engine``.

    ``decode`` is the decode side's :class:`NativeAdapter` (``engine`` should share its weights);
    ``sequences`` maps each case to its imported sequence id and the number of imported tokens;
    ``prefill_contract`` is the one the handshake accepted.
    """

    def __init__(
        self,
        decode: NativeAdapter,
        engine: Engine,
        sequences: Mapping[Case, tuple[Hashable, int]],
        *,
        prefill_contract: CacheContract,
        convert: str,
        policy: ImportPolicy | None = None,
    ):
        self.engine, self.sequences = engine, sequences
        self._init_sides(None, decode, prefill_contract, convert, policy, None)

    def handed_off(self, case: Case, tokens: torch.Tensor) -> tuple[Engine, Hashable, int]:
        if case not in self.sequences:
            raise UsageError(f"no handed-off sequence for case {case.label()}")
        seq, n = self.sequences[case]
        return self.engine, seq, n
