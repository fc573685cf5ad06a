"""vLLM's disaggregated prefill through a KV connector: a producer and a consumer :class:`VLLMEngine`.

Each side is one vLLM instance (its own process, as deployed) started with a ``KVTransferConfig``
(:func:`transfer_config`): the producer prefills prompts and its connector writes their KV to a
store directory; the consumer's connector finds a prompt's entry there and injects it into the paged
cache instead of computing it. vLLM's public connector API is all that is observed:

- ``build_connector_meta`` (scheduler side) returns, per request, the slots the worker loads into
  (``slot_mapping[i]`` is token ``i``'s slot, so position ``i``) or stores from;
- ``start_load_kv`` (worker side) injects them; :class:`ConnectorConsumer` runs its ``after_inject``
  callbacks right after it (a fault patch of the running consumer goes there);
- ``RequestOutput.num_cached_tokens`` is vLLM's own count of tokens not computed by this request
  (prefix cache + connector; the prefix cache is reset before each case, so all from the connector).

This module imports vLLM only inside the engine (as :mod:`.engine` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ...errors import AdapterError, UsageError
from ...parity.cases import Case
from ...parity.protocol import CaseRun, FullRun
from .engine import ADAPTER, VLLMEngine
from .sidecar import RUN_KEY

Role = Literal["producer", "consumer"]
Connector = Literal["example", "ropekv"]
CONNECTORS: tuple[str, ...] = ("example", "ropekv")
ROPEKV_CONNECTOR_MODULE = "ropekv.adapters.vllm.connector"


def transfer_config(
    role: Role, store: Path, connector: Connector, *, load_failure_policy: str = "fail", run: str | None = None
) -> Any:
    """vLLM's ``KVTransferConfig`` for one side: ``example`` is vLLM's ``ExampleConnector`` (safetensors
    files under ``store``), ``ropekv`` the contract-carrying ``ContractConnector`` loaded through
    ``kv_connector_module_path``; ``run``: the id its refusals are marked with in the store's log."""
    from vllm.config import KVTransferConfig

    if role not in ("producer", "consumer"):
        raise UsageError(f"role must be producer or consumer, got {role!r}")
    if connector not in CONNECTORS:
        raise UsageError(f"connector must be one of {', '.join(CONNECTORS)}, got {connector!r}")
    extra = {"shared_storage_path": str(store)}
    if run is not None:
        extra[RUN_KEY] = run
    if connector == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role=f"kv_{role}", kv_connector_extra_config=extra)
    return KVTransferConfig(
        kv_connector="ContractConnector",
        kv_connector_module_path=ROPEKV_CONNECTOR_MODULE,
        kv_role=f"kv_{role}",
        kv_connector_extra_config=extra,
        kv_load_failure_policy=load_failure_policy,
    )


@dataclass(frozen=True)
class Injection:
    """One request's KV the consumer's connector injected: ``slots [n]`` hold tokens ``0..n-1``."""

    slots: torch.Tensor  # [n] int64 physical slots, token i at slots[i]

    @property
    def num_tokens(self) -> int:
        return int(self.slots.numel())


@dataclass(frozen=True)
class Produced:
    """One prompt the producer prefilled: its post-RoPE keys and its values as vLLM's Attention module
    got them (what the connector stores), and the first token's top log-probability."""

    token_ids: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]  # per layer [L, KVH, D], the model dtype
    values: tuple[torch.Tensor, ...]  # per layer [L, KVH, D], the model dtype
    first_logprob: float
    num_cached_tokens: int


def _loaded_slots(meta: Any) -> list[torch.Tensor]:
    """The slots (``[n]`` int64, token i at ``[i]``) of each load one step's connector metadata asks the
    worker for: the ``.requests`` of ``ExampleConnectorMetadata`` (and its subclasses') that are not
    stores, or the ``.loads`` of ropekv's ``ContractConnectorMetadata`` that its scheduler did not refuse
    (a load its worker refuses at inject is still counted: the refusal log says so). Another shape is
    refused rather than guessed."""
    from .connector import ContractConnectorMetadata

    if isinstance(meta, ContractConnectorMetadata):
        records = [load.meta for load in meta.loads if not load.refused]
    else:
        requests = getattr(meta, "requests", None)
        if requests is None:
            raise AdapterError(
                ADAPTER,
                "connector metadata",
                "ExampleConnector's .requests or ContractConnector's .loads",
                type(meta).__name__,
            )
        records = [r for r in requests if not r.is_store]
    return [torch.as_tensor(r.slot_mapping).reshape(-1).to(torch.int64).clone() for r in records]


class _ConnectorTap:
    """Wraps the scheduler-side ``build_connector_meta`` (to see what each step loads) and the
    worker-side ``start_load_kv`` (to run callbacks after the injection), as instance attributes."""

    def __init__(self, engine: VLLMEngine):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.scheduler_connector = engine.llm.llm_engine.engine_core.engine_core.scheduler.connector
        self.worker_connector = get_kv_transfer_group()
        if self.scheduler_connector is None:
            raise AdapterError(ADAPTER, "kv connector", "a consumer started with kv_transfer_config", "none")
        self.pending: list[Injection] = []
        self.injections: list[Injection] = []
        self.after_inject: list[Callable[[list[Injection]], None]] = []
        self.matching = True
        sched, worker = self.scheduler_connector, self.worker_connector
        build, load, match = sched.build_connector_meta, worker.start_load_kv, sched.get_num_new_matched_tokens

        def build_connector_meta(scheduler_output, _build=build):
            meta = _build(scheduler_output)
            self.pending.extend(Injection(slots) for slots in _loaded_slots(meta))
            return meta

        def start_load_kv(forward_context, _load=load, **kwargs):
            _load(forward_context, **kwargs)
            done, self.pending = self.pending, []
            if done:
                self.injections.extend(done)
                for callback in self.after_inject:
                    callback(done)

        def get_num_new_matched_tokens(request, num_computed_tokens, _match=match):
            return _match(request, num_computed_tokens) if self.matching else (0, False)

        sched.build_connector_meta = build_connector_meta
        worker.start_load_kv = start_load_kv
        sched.get_num_new_matched_tokens = get_num_new_matched_tokens

    @contextlib.contextmanager
    def store_off(self) -> Iterator[None]:
        """Requests scheduled inside the block find nothing in the store (computed in full)."""
        self.matching = False
        try:
            yield
        finally:
            self.matching = True


class ConnectorConsumer(VLLMEngine):
    """A :class:`VLLMEngine` started as a connector's consumer. ``run_case`` is the disaggregated decode:
    the prompt's KV comes from the store (vLLM decides how much), the rest is computed, then the decode
    steps run; the probes label each injected slot with its token's position. ``full_forward`` (the
    self-parity side) runs with the store turned off, so it is the consumer's own full prefill.
    ``after_inject`` callbacks run inside vLLM's worker right after each injection."""

    def __init__(self, model_dir, *, store: Path, connector: Connector, run: str | None = None, **kwargs: Any):
        config = transfer_config("consumer", store, connector, run=run)
        super().__init__(model_dir, kv_transfer_config=config, **kwargs)
        self.connector = connector
        self.tap = _ConnectorTap(self)
        self.case_logprobs: list[list[float]] = []  # per run_case: top-1 log-probability per output token
        self.case_counters: list[dict[str, int]] = []
        self._last_counts = {"num_cached_tokens": 0}
        self.name = f"{self.name}, consumer of the {connector} connector"

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        if case.prefix:
            raise UsageError("a disaggregated case has no prefix hit: the whole prompt is the prefilled one")
        before = len(self.tap.injections)
        run = super().run_case(case, tokens)
        injected = sum(i.num_tokens for i in self.tap.injections[before:])
        counters = {"prompt_tokens": case.length, "injected_tokens": injected, **self._last_counts}
        counters["recomputed_tokens"] = case.length - counters["num_cached_tokens"]
        self.case_counters.append(counters)
        note = (
            f"connector ({self.connector}): {injected} of {case.length} prompt tokens injected from the store, "
            f"{counters['recomputed_tokens']} recomputed (vLLM's num_cached_tokens {counters['num_cached_tokens']})"
        )
        # The parent's note counts every cached token as a prefix-cache hit; here they came from the store.
        notes = tuple(n for n in run.notes if not n.startswith("vLLM took"))
        return CaseRun(steps=run.steps, notes=(note, *notes))

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        with self.tap.store_off():
            return super().full_forward(tokens, rows, case)

    def _generate(self, prompt, *, max_tokens, logprobs=None, prompt_logprobs=None, forced_ids=None):
        def note_injection(done: list[Injection]) -> None:
            for inj in done:
                for position, slot in enumerate(inj.slots.tolist()):
                    for layer in range(len(self.probes.layers)):  # one KV cache group: every layer's slots
                        self.probes.slot_position.setdefault(layer, {})[slot] = position  # token i: position i

        self.tap.after_inject.insert(0, note_injection)
        try:
            out = super()._generate(
                prompt,
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                forced_ids=forced_ids,
            )
        finally:
            self.tap.after_inject.remove(note_injection)
        if logprobs and prompt_logprobs is None:
            self.case_logprobs.append(
                [max(lp.values(), key=lambda x: x.logprob).logprob for lp in out.outputs[0].logprobs]
            )
        self._last_counts = {"num_cached_tokens": int(out.num_cached_tokens or 0)}
        return out


class ConnectorProducer(VLLMEngine):
    """A :class:`VLLMEngine` whose connector writes every prompt it prefills to ``store``."""

    def __init__(self, model_dir, *, store: Path, connector: Connector, **kwargs: Any):
        super().__init__(model_dir, kv_transfer_config=transfer_config("producer", store, connector), **kwargs)
        self.name = f"{self.name}, producer of the {connector} connector"

    @torch.no_grad()
    def produce(self, ids: list[int]) -> Produced:
        """Prefill ``ids`` (one output token) with the probes on; the post-RoPE keys of every layer are
        read from the hooks (the tensors the Attention module writes to the cache, which the connector
        stores)."""
        self.llm.reset_prefix_cache()
        self.probes.reset()
        with self.probes.installed():
            result = self._generate(list(ids), max_tokens=1, logprobs=1)
        keys, values = [], []
        for i in range(len(self.probes.layers)):
            parts = [f.layers[i].k_rot for f in self.probes.forwards if i in f.layers]
            keys.append(torch.cat([p for p in parts if p is not None]))  # [L, KVH, D]
            parts = [f.layers[i].v for f in self.probes.forwards if i in f.layers]
            if not any(p is not None for p in parts):
                raise AdapterError(ADAPTER, f"layer {i} Attention value input", "the values it caches", "none seen")
            values.append(torch.cat([p for p in parts if p is not None]))  # [L, KVH, D]
        self.probes.reset()
        if keys[0].shape[0] != len(ids) or values[0].shape[0] != len(ids):
            got = f"{keys[0].shape[0]} keys, {values[0].shape[0]} values"
            raise AdapterError(ADAPTER, "producer prefill", f"{len(ids)} keys and values per layer", got)
        first = max(result.outputs[0].logprobs[0].values(), key=lambda x: x.logprob).logprob
        return Produced(tuple(ids), tuple(keys), tuple(values), float(first), int(result.num_cached_tokens or 0))


@dataclass(frozen=True)
class SideFacts:
    """What one side ran, for comparing producer and consumer (JSON-ready)."""

    role: Role
    name: str
    vllm_version: str
    contract: dict[str, Any]  # VLLMContract.to_dict()
    model_fingerprint: str
    model_dir: str
    dtype: str
    block_size: int
    startup_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, role: Role, engine: VLLMEngine, **extra: Any) -> SideFacts:
        return cls(
            role=role,
            name=engine.name,
            vllm_version=engine.vllm_version,
            contract=engine.contract.to_dict(),
            model_fingerprint=engine.checkpoint.fingerprint,
            model_dir=str(engine.model_dir),
            dtype=engine.dtype_name,
            block_size=engine.block_size,
            startup_seconds=round(engine.startup_seconds, 2),
            extra=dict(extra),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "name": self.name,
            "vllm_version": self.vllm_version,
            "contract": self.contract,
            "model_fingerprint": self.model_fingerprint,
            "model_dir": self.model_dir,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "startup_seconds": self.startup_seconds,
            **self.extra,
        }
