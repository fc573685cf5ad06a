"""Across engines through vLLM's ExampleConnector store: a store entry as a ropekv handoff, and a ropekv
handoff as a store entry, each crossing the contract check.

The store carries no contract, so each direction states one from what each side runs:

- vLLM as producer: :func:`vllm_cache_contract` is the :class:`~ropekv.contract.CacheContract` of what
  the vLLM instance ran, from the values read off its loaded model (:class:`.contract.VLLMContract`:
  theta, rotary dim, pairing, scaling, block size, dtype) over the checkpoint's shapes and fingerprint;
  :func:`handoff_of_entry` makes the entry a :class:`~ropekv.transfer.payload.Handoff` under it, and
  ropekv's importer (``import_handoff``) refuses it with ``ContractMismatch`` wherever ropekv's engine
  runs something else.
- ropekv as producer: :func:`write_handoff` writes a handoff as an entry a vLLM consumer injects, after
  the consumer's contract (:func:`vllm_cache_contract` of the consumer instance) accepted the handoff's
  (``require_compatible``): nothing is written on a mismatch.

Positions: a vLLM consumer injects token ``t`` of the entry at position ``t``; the store has no other
positions, so a handoff at other positions is refused rather than written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ...contract import CacheContract
from ...errors import ContractMismatch, PayloadError
from ...models.config import Checkpoint
from ...rope import RopeScaling
from ...transfer.payload import Handoff
from .contract import VLLMContract, table_error
from .store import StoredKV, StoreEntry, write_entry

_DESCRIBED = {"rope_type", "theta", "head_dim", "rotary_dim", "layout", "scaling.factor"}


def vllm_cache_contract(checkpoint: Checkpoint, vllm: VLLMContract, *, cos_sin_tolerance: float) -> CacheContract:
    """The cache contract of a vLLM instance that loaded ``checkpoint`` and runs ``vllm`` (read off its
    model): the checkpoint's RoPE with every field vLLM runs otherwise replaced by vLLM's value, rotated
    keys, vLLM's block size and dtype, full attention (ExampleConnector stores whole prompts).

    Raises :class:`ContractMismatch` where vLLM runs a rotation ropekv cannot state as a RoPE spec: a
    cos/sin table further than ``cos_sin_tolerance`` from every spec's (e.g. computed in low precision),
    different rotary modules per layer, a scaling class ropekv does not map."""
    cfg = checkpoint.config
    spec = cfg.rope
    diffs = vllm.diff(spec, tolerance=float("inf"))  # the named fields first; the table is judged below
    unknown = [d.field for d in diffs if d.field not in _DESCRIBED]
    if vllm.rope_type is None or unknown:
        raise ContractMismatch(
            f"vLLM runs {vllm.rope_class} ({', '.join(unknown) or 'an unmapped rotary class'}), which ropekv "
            "cannot state as a RoPE spec: keys it rotated cannot be compared with a contract",
            fields=tuple(unknown) or ("rope_class",),
        )
    scaling = spec.scaling
    if vllm.rope_type != scaling.rope_type or (
        scaling.factor is not None and vllm.scaling_factor is not None and vllm.scaling_factor != scaling.factor
    ):
        if vllm.rope_type not in ("default", "linear"):
            raise ContractMismatch(
                f"vLLM runs {vllm.rope_type} scaling where the checkpoint says {scaling.rope_type}; ropekv reads "
                "only its factor off vLLM's module, not its other parameters",
                fields=("rope.scaling",),
            )
        scaling = RopeScaling() if vllm.rope_type == "default" else RopeScaling("linear", vllm.scaling_factor)
    rope = spec.replace(
        theta=vllm.theta, head_dim=vllm.head_dim, rotary_dim=vllm.rotary_dim, layout=vllm.layout, scaling=scaling
    )
    error = table_error(vllm.cos_sin_table, rope)
    if error is not None and error > cos_sin_tolerance:
        raise ContractMismatch(
            f"vLLM's cos/sin table is {error:.3g} from the float64 table of theta={vllm.theta:g} (more than "
            f"{cos_sin_tolerance:g}): its rotation is not one ropekv can state",
            fields=("cos_sin_cache",),
        )
    if cfg.layer_ropes is not None or any(a.kind != "full" for a in cfg.layer_attentions):
        raise ContractMismatch(
            "the model has per-layer RoPE or windowed layers: ropekv states a vLLM contract for one RoPE and "
            "full attention only",
            fields=("layer_ropes",),
        )
    base = CacheContract.for_model(
        cfg,
        key_form="rotated",  # vLLM's model rotates q and k before its Attention module writes the cache
        block_size=vllm.block_size,
        dtype=vllm.dtype,
        window=None,
        weights_fingerprint=checkpoint.weights_fingerprint,
    )
    return base.replace(rope=rope)


def handoff_of_entry(
    stored: StoredKV, token_ids: Sequence[int] | torch.Tensor, contract: CacheContract, *, seq_id: str | int = "vllm"
) -> Handoff:
    """The handoff of a decoded entry: tokens ``token_ids[:T]`` at positions ``0..T-1`` (where vLLM
    wrote them), keys and values as stored, under ``contract`` (the producer's, :func:`vllm_cache_contract`).
    The handoff validates shapes, dtype and values against it (:class:`PayloadError`)."""
    T = stored.num_tokens
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
    if ids.numel() < T:
        raise PayloadError(f"vLLM store entry holds {T} tokens, only {ids.numel()} token ids given")
    if stored.dtype != contract.torch_dtype:
        raise PayloadError(f"vLLM store entry is {stored.dtype}, its producer's contract says {contract.dtype}")
    return Handoff(
        contract=contract,
        seq_id=seq_id,
        tokens=ids[:T].clone(),
        positions=torch.arange(T, dtype=torch.int64),
        keys=stored.keys,
        values=stored.values,
    )


def write_handoff(
    store_dir: str | os.PathLike,
    handoff: Handoff,
    *,
    consumer: CacheContract,
    isa: str,
    num_tokens: int | None = None,
    layer_names: Sequence[str] | None = None,
    overwrite: bool = False,
) -> StoreEntry:
    """Write the first ``num_tokens`` (default: the whole blocks) of ``handoff`` as an ExampleConnector
    entry for a vLLM consumer running ``consumer`` (its :func:`vllm_cache_contract`) with kernel ``isa``.
    The contracts are compared first (``require_compatible``: :class:`ContractMismatch` naming every
    field, nothing written); positions other than ``0..n-1`` are refused (the store cannot carry them)."""
    consumer.require_compatible(handoff.contract, ours="vLLM consumer", theirs="ropekv producer")
    n, B = handoff.num_tokens, consumer.block_size
    count = n // B * B if num_tokens is None else num_tokens
    if not 1 <= count <= n or count % B:
        raise PayloadError(f"write_handoff: {count} tokens of {n} are not whole blocks of {B}")
    if not torch.equal(handoff.positions[:count], torch.arange(count, dtype=torch.int64)):
        raise PayloadError(
            "write_handoff: the handoff's tokens are not at positions 0..n-1; a vLLM consumer injects token t "
            "at position t and the store carries no positions"
        )
    return write_entry(
        store_dir,
        handoff.tokens[:count],
        [k[:count] for k in handoff.keys],
        [v[:count] for v in handoff.values],
        isa=isa,
        block_size=B,
        layer_names=layer_names,
        overwrite=overwrite,
    )


__all__ = ["handoff_of_entry", "vllm_cache_contract", "write_handoff"]
