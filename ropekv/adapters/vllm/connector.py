"""``ContractConnector``: vLLM's ExampleConnector store, with the cache contract checked before any load.

Turn it on with ``KVTransferConfig(kv_connector="ContractConnector",
kv_connector_module_path="ropekv.adapters.vllm.connector", kv_role="kv_producer" | "kv_consumer",
kv_connector_extra_config={"shared_storage_path": DIR})`` (docs/engines/vllm.md shows the
``--kv-transfer-config`` of ``vllm serve``). The store is the ExampleConnector's, file for file; what
this connector adds:

- producer (its worker): after every layer file of a prompt is written, the entry's sidecar
  (:mod:`.sidecar`: the producer's :class:`~.sidecar.EngineContract`, the tokens and positions stored,
  the sha256 of each layer file), written atomically into the entry's folder;
- consumer (its scheduler): in ``get_num_new_matched_tokens``, before vLLM allocates or loads
  anything, the sidecar is compared with the consumer's own contract (built by its worker from the
  model it runs, handed over by vLLM's connector handshake) and every layer file with its checksum. A
  refusal names each field, both values and the consequence (the handshake's wording), is logged and
  appended to ``<store>/ropekv-refusals.jsonl``, and follows ``kv_load_failure_policy``:
  ``"recompute"`` reports no matched tokens (vLLM computes the prompt itself); ``"fail"`` reports the
  tokens but the worker injects nothing and reports their blocks as failed loads, which vLLM turns
  into a failed request (finish reason ``error``);
- consumer (its worker): the bytes it injects are the bytes it checked (read once, checksummed, every
  layer before the first is injected), so a file changed after the scheduler's check is refused too,
  through vLLM's own load-failure path;
- consumer (its worker), right before each layer's attention reads the paged cache
  (``wait_for_layer_load``): the injected rows are read back and must equal the checked bytes, so KV
  changed inside the consumer after the injection (keys turned to other positions by a bug of its
  own) is refused too, with the layers named (``injected.layers``), through the same path. The
  cost: one gather and compare of the injected rows per layer, once per load.

Prompts longer than one forward's token budget (chunked prefill) are not stored: the ExampleConnector
saves a prompt in its first step only, before the blocks of its later chunks are computed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors
import safetensors.torch
import torch
from safetensors.torch import load as tensors_from_bytes  # safetensors only: no pickle
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ReqMeta,
    align_to_block_size,
)
from vllm.forward_context import get_forward_context

from ...contract import FieldDiff
from ...errors import ConfigError, ContractMismatch
from .entry_contract import engine_contract
from .sidecar import (
    RUN_KEY,
    EngineContract,
    LayerFile,
    Policy,
    Sidecar,
    append_refusal,
    compare,
    entry_location,
    file_digest,
    read_sidecar,
    refusal,
    tokens_digest,
    verify_files,
    write_sidecar,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# A child of vLLM's logger: refusals print with vLLM's own format, level and stream.
logger = logging.getLogger("vllm.ropekv.connector")


@dataclass
class ContractHandshake(KVConnectorHandshakeMetadata):
    """What a worker hands its scheduler at start-up: its :class:`EngineContract`, as JSON."""

    engine_json: str


@dataclass
class Load:
    """One load the scheduler asks of the worker: the ExampleConnector's request record, the request id,
    and whether the scheduler refused it (``fail`` policy: inject nothing, report the blocks failed)."""

    request_id: str
    meta: ReqMeta
    refused: bool


@dataclass
class _Altered:
    """What changed in one load's injected rows between the injection and attention (accumulated per
    layer in one forward): the layers, the values changed of those layers' injected values, the worst
    absolute change."""

    load: Load
    blocks: set[int]
    layers: list[int] = field(default_factory=list)
    changed: int = 0
    total: int = 0
    worst: float = 0.0

    def diff(self, num_layers: int) -> FieldDiff:
        first, last = self.layers[0], self.layers[-1]
        which = f"{first}-{last}" if self.layers == list(range(first, last + 1)) and last > first else str(self.layers)
        return FieldDiff(
            "injected.layers",
            f"layers {which} of {num_layers} changed after the injection: {self.changed} of {self.total} "
            f"injected values (max |diff| {self.worst:.3g})",
            "the injected values, unchanged",
        )


@dataclass
class ContractConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker: loads, and stores (each a :class:`ReqMeta` with ``is_store``)."""

    loads: list[Load] = field(default_factory=list)
    stores: list[ReqMeta] = field(default_factory=list)


class ContractConnector(ExampleConnector):
    """The ExampleConnector's store, with a contract sidecar per entry and a check before every load."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._store = Path(self._storage_path)
        run = self._kv_transfer_config.get_from_extra_config(RUN_KEY, None)
        self._run: str | None = None if run is None else str(run)  # marks this run's refusals in the store's log
        policy = self._kv_transfer_config.kv_load_failure_policy
        if policy not in ("fail", "recompute"):
            raise ConfigError(f"kv_load_failure_policy must be 'fail' or 'recompute', got {policy!r}")
        self._policy: Policy = policy
        self._produces = bool(self._kv_transfer_config.is_kv_producer)
        self._engine: EngineContract | None = None  # the worker builds it; the scheduler gets it handed
        self._verdicts: dict[str, ContractMismatch | None] = {}  # scheduler: request id -> refusal
        self._load_errors: set[int] = set()  # worker: blocks of loads refused this step
        # worker: this step's injected rows, per layer name: (load, its blocks, slots [n], rows [n, *kv_row_shape])
        self._injected: dict[str, list[tuple[Load, set[int], torch.Tensor, torch.Tensor]]] = {}
        self._altered: dict[str, _Altered] = {}  # worker: request id -> what changed after its injection

    # ------------------------------------------------------------------ start-up (worker -> scheduler)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build this instance's contract once its caches exist (the model is loaded by then)."""
        super().register_kv_caches(kv_caches)
        layers = self._vllm_config.compilation_config.static_forward_context
        self._engine = engine_contract(self._vllm_config, kv_caches, layers)
        logger.info("ropekv contract connector: contract %s", self._engine.contract.fingerprint())

    def get_handshake_metadata(self) -> ContractHandshake | None:
        return (
            None
            if self._engine is None
            else ContractHandshake(engine_json=json.dumps(self._engine.to_dict(), sort_keys=True))
        )

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        texts = {m.engine_json for m in metadata.values() if isinstance(m, ContractHandshake)}
        if len(texts) > 1:
            raise ConfigError("the workers of this instance report different cache contracts")
        if texts:
            self._engine = EngineContract.from_dict(json.loads(texts.pop()))

    # ------------------------------------------------------------------ scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._found_match_for_request(request):
            return 0, False
        token_ids = list(request.prompt_token_ids or [])
        n = align_to_block_size(len(token_ids) - 1, self._block_size)
        if n <= num_computed_tokens:
            return 0, False
        rid = request.request_id
        if rid not in self._verdicts:  # the scheduler may ask again for a request it could not schedule
            self._verdicts[rid] = self._check(request, token_ids[:n])
        error = self._verdicts[rid]
        if error is None:
            logger.info("ropekv contract connector: contract checked, loading %d tokens of %s", n, rid)
            return n - num_computed_tokens, False
        if self._policy == "recompute":
            return 0, False
        return n - num_computed_tokens, False  # "fail": allocated, never injected, reported as failed

    def _check(self, request: Request, token_ids: list[int]) -> ContractMismatch | None:
        """None if the entry for ``token_ids`` may be loaded, else the refusal (logged and recorded)."""
        mm = [f.identifier for f in request.mm_features]
        folder = Path(self._generate_foldername_debug(torch.tensor(token_ids), mm, create_folder=False))
        error = self.entry_refusal(folder, token_ids)
        if error is not None:
            record = append_refusal(
                self._store,
                request_id=request.request_id,
                key=folder.name,
                error=error,
                policy=self._policy,
                run=self._run,
            )
            logger.error(
                "ropekv contract connector refused the stored KV %s for request %s (policy %s): %s",
                record["key"],
                record["request_id"],
                self._policy,
                record["message"],
            )
        return error

    def entry_refusal(self, folder: Path, token_ids: list[int]) -> ContractMismatch | None:
        """The refusal of loading the entry ``folder`` for ``token_ids``, or None if it is sound."""
        return self._examine(folder, token_ids)[0]

    def _examine(self, folder: Path, token_ids: list[int]) -> tuple[ContractMismatch | None, dict[str, bytes]]:
        """``(refusal or None, the checked bytes of each layer file by layer name)``."""
        if self._engine is None:
            return refusal([FieldDiff("contract", "none (the worker handed no contract over)", "a contract")]), {}
        misplaced = entry_location(self._store, folder)
        if misplaced:
            return refusal(misplaced), {}
        try:
            sidecar = read_sidecar(folder)
        except ConfigError as exc:
            return refusal([FieldDiff("sidecar", "a readable sidecar", f"unreadable: {str(exc)[:200]}")]), {}
        if sidecar is None:
            return refusal([FieldDiff("sidecar", "a contract sidecar", "none")]), {}
        diffs = compare(self._engine, sidecar, token_ids)
        if diffs:
            return refusal(diffs), {}
        diffs, data = verify_files(folder, sidecar)
        return (refusal(diffs) if diffs else None), data

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The ExampleConnector's step plan, with request ids and refusals; a prompt is stored only by
        a producer and only when its stored blocks are all computed in this step."""
        meta = ContractConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            token_ids = new_req.prompt_token_ids or []
            mm = [f.identifier for f in new_req.mm_features]
            rid = new_req.req_id
            if rid in self._requests_need_load:
                record = ReqMeta.make_meta(token_ids, new_req.block_ids[0], self._block_size, False, mm)
                meta.loads.append(Load(rid, record, refused=self._verdicts.get(rid) is not None))
            elif self._produces and not self._found_match_for_prompt(token_ids, mm):
                computed = new_req.num_computed_tokens + scheduler_output.num_scheduled_tokens[rid]
                if computed >= align_to_block_size(len(token_ids), self._block_size):
                    meta.stores.append(ReqMeta.make_meta(token_ids, new_req.block_ids[0], self._block_size, True, mm))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):  # resumed after preemption: load again, as ExampleConnector
            if rid not in cached.resumed_req_ids or rid not in self._requests_need_load:
                continue
            request = self._requests_need_load[rid]
            total = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[rid]
            block_ids = cached.new_block_ids[i]
            if block_ids is None:
                raise ConfigError(f"resumed request {rid} has no block ids")
            mm = [f.identifier for f in request.mm_features]
            record = ReqMeta.make_meta(request.all_token_ids[:total], block_ids[0], self._block_size, False, mm)
            meta.loads.append(Load(rid, record, refused=self._verdicts.get(rid) is not None))
        self._requests_need_load.clear()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._verdicts.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Inject each checked load, every layer read and checked before the first is written."""
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, ContractConnectorMetadata) or forward_context.attn_metadata is None:
            return
        layers = {
            name: layer.kv_cache
            for name, layer in forward_context.no_compile_layers.items()
            if getattr(layer, "kv_cache", None) is not None
        }
        self._injected, self._altered = {}, {}
        for load in metadata.loads:
            blocks = {int(b) for b in torch.unique(load.meta.slot_mapping // self._block_size)}
            if load.refused:
                self._load_errors |= blocks
                continue
            folder = Path(
                self._generate_foldername_debug(load.meta.token_ids, load.meta.mm_hashes, create_folder=False)
            )
            try:
                tensors = self._checked_tensors(folder, load, layers)
            except ContractMismatch as error:
                append_refusal(
                    self._store,
                    request_id=load.request_id,
                    key=folder.name,
                    error=error,
                    policy=self._policy,
                    run=self._run,
                )
                logger.error("ropekv contract connector: load of %s refused at inject: %s", load.request_id, error)
                self._load_errors |= blocks
                continue
            logger.info(
                "ropekv contract connector: inject %d checked tokens of %s",
                len(load.meta.slot_mapping),
                load.request_id,
            )
            slots = load.meta.slot_mapping
            for name, src in tensors.items():  # src: [num_tokens, *kv_row_shape]
                rows = src.to(layers[name].device)
                layers[name][slots // self._block_size, :, slots % self._block_size] = rows
                self._injected.setdefault(name, []).append((load, blocks, slots, rows))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Right before ``layer_name``'s attention reads the paged cache: the rows this step injected
        must still be the checked bytes, exactly. Rows changed in between (by anything in the consumer
        after the injection: a kernel, a patch, a position fix-up) fail their load through vLLM's
        load-failure path, and :meth:`get_block_ids_with_load_errors` records the refusal."""
        checks = self._injected.pop(layer_name, [])
        if not checks:
            return
        layer = get_forward_context().no_compile_layers[layer_name]
        cache = layer.kv_cache  # [num_blocks, num_kv_heads, block_size, C]
        assert self._engine is not None  # a load was injected, so the worker has a contract
        index = self._engine.layer_names.index(layer_name)
        for load, blocks, slots, rows in checks:
            now = cache[slots // self._block_size, :, slots % self._block_size]  # [n, *kv_row_shape]
            if torch.equal(now, rows):
                continue
            altered = self._altered.setdefault(load.request_id, _Altered(load, blocks))
            altered.layers.append(index)
            altered.changed += int((now != rows).sum())
            altered.total += rows.numel()
            altered.worst = max(altered.worst, float((now.float() - rows.float()).abs().max()))

    def _checked_tensors(self, folder: Path, load: Load, layers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each layer's stored ``kv_cache [num_tokens, *kv_row_shape]`` from the checked bytes of the
        entry ``folder``, or the refusal (:class:`ContractMismatch`) naming what is wrong."""
        token_ids = [int(t) for t in load.meta.token_ids]
        error, data = self._examine(folder, token_ids)
        if error is not None:
            raise error
        assert self._engine is not None  # _examine refuses without one
        diffs: list[FieldDiff] = []
        out: dict[str, torch.Tensor] = {}
        want = (len(load.meta.slot_mapping), *self._engine.kv_row_shape)
        for i, name in enumerate(self._engine.layer_names):
            if name not in data:
                continue
            try:
                tensor = tensors_from_bytes(data[name]).get("kv_cache")
            except safetensors.SafetensorError as exc:  # checksummed, yet not a safetensors file
                diffs.append(FieldDiff(f"checksum.layers.{i}", "a safetensors file", str(exc)[:160]))
                continue
            cache = layers.get(name)
            if tensor is None or cache is None or tuple(tensor.shape) != want or tensor.dtype != cache.dtype:
                found = None if tensor is None else (tuple(tensor.shape), str(tensor.dtype))
                wanted = (want, None if cache is None else str(cache.dtype))
                diffs.append(FieldDiff(f"checksum.layers.{i}", f"kv_cache {wanted}", f"kv_cache {found}"))
            else:
                out[name] = tensor
        if diffs:
            raise refusal(diffs)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """After the forward: the blocks of every load refused this step (at inject, or changed before
        attention read them); each changed load is recorded as a refusal here, naming its layers."""
        for rid, altered in self._altered.items():
            error = refusal([altered.diff(len(self._engine.layer_names) if self._engine else 0)])
            meta = altered.load.meta
            key = Path(self._generate_foldername_debug(meta.token_ids, meta.mm_hashes, create_folder=False)).name
            append_refusal(self._store, request_id=rid, key=key, error=error, policy=self._policy, run=self._run)
            logger.error("ropekv contract connector: injected KV of %s changed before attention: %s", rid, error)
            self._load_errors |= altered.blocks
        self._altered, self._injected = {}, {}
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_save(self) -> None:
        """After the step's layer files are written: each stored entry's sidecar, atomically, last."""
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, ContractConnectorMetadata) or self._engine is None:
            return
        for store in metadata.stores:
            folder = Path(self._generate_foldername_debug(store.token_ids, store.mm_hashes, create_folder=False))
            try:
                files = tuple(
                    LayerFile(f"{name}.safetensors", *file_digest(folder / f"{name}.safetensors"))
                    for name in self._engine.layer_names
                )
            except ConfigError as exc:
                logger.error("ropekv contract connector: entry %s left without a sidecar: %s", folder.name, exc)
                continue
            token_ids = [int(t) for t in store.token_ids]
            sidecar = Sidecar(
                engine=self._engine,
                key=folder.name,
                num_tokens=len(token_ids),
                position_start=0,  # a fresh request: token i is at position i
                tokens_sha256=tokens_digest(token_ids),
                layers=files,
            )
            write_sidecar(folder, sidecar)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """The ExampleConnector's save of ``kv_layer`` ``[num_blocks, num_kv_heads, block_size, C]``,
        for this step's stores only."""
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, ContractConnectorMetadata):
            return
        for store in metadata.stores:
            filename = self._generate_filename_debug(layer_name, store.token_ids, store.mm_hashes)
            slots = store.slot_mapping.to(kv_layer.device)
            rows = kv_layer[slots // self._block_size, :, slots % self._block_size]  # [num_tokens, H, C]
            safetensors.torch.save_file({"kv_cache": rows.detach().cpu().contiguous()}, filename)
