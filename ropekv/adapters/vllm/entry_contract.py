"""The :class:`~.sidecar.EngineContract` of the vLLM instance this process runs, built in its worker.

Every RoPE value comes from what vLLM runs, checked against ropekv's reading of the configuration vLLM
runs (``model_config.hf_config``, ``hf_overrides`` applied): the rotary modules vLLM built are read
(:func:`~.contract.rotary_contract`: base, scaling, layout, rotary_dim, the cos/sin table itself) and
must agree with the :class:`~ropekv.rope.RopeSpec` ropekv derives from that configuration, else the
contract would describe something vLLM does not run and the worker refuses to start
(:class:`~ropekv.errors.ConfigError`). The weights fingerprint hashes the weights alone as ropekv's own
loader reads them from the model folder (:func:`~ropekv.models.weights.weights_fingerprint_of`, rounded
to the dtype vLLM runs); the configuration has a fingerprint of its own.

vLLM's CPU build repacks its linear weights and the connector is handed no model object, so the
rotary modules are read from vLLM's process-wide rotary cache (``get_rope`` builds each distinct module
once and keeps it there). A process that built more than one (two models, or per-layer RoPE) is
refused rather than guessed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...contract import CacheContract
from ...errors import ConfigError
from ...models.hf_config import read_model_config
from .contract import rotary_contract
from .engine import CPU_DTYPES, cos_sin_tolerance
from .sidecar import EngineContract
from .weights import checkpoint_for


def engine_contract(vllm_config: Any, kv_caches: dict[str, torch.Tensor], layers: dict[str, Any]) -> EngineContract:
    """The contract of the running instance: ``vllm_config`` (vLLM's ``VllmConfig``), its registered
    ``kv_caches`` (layer name -> ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` on CPU, in
    model order) and its ``layers`` (layer name -> vLLM ``Attention`` module)."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    dtype_name = str(model_config.dtype).removeprefix("torch.")
    if dtype_name not in CPU_DTYPES:
        raise ConfigError(f"the contract connector runs on float32 or bfloat16 models, got {dtype_name}")
    config = read_model_config(model_config.hf_config.to_dict(), source=f"vLLM's configuration of {model_config.model}")
    if config.layer_ropes is not None or getattr(config, "mla", None) is not None:
        raise ConfigError("the contract connector reads one rotary module: per-layer RoPE and MLA are not supported")
    ropes = list({id(m): m for m in _ROPE_DICT.values()}.values())
    if len(ropes) != 1:
        raise ConfigError(
            f"this process built {len(ropes)} distinct rotary modules: the contract connector cannot tell "
            "which one the model runs (run one model per process)"
        )
    names = tuple(kv_caches)
    first = kv_caches[names[0]]
    if first.dim() != 4 or any(kv_caches[n].shape != first.shape for n in names):
        raise ConfigError(
            f"the contract connector needs one 4-D paged cache shape for every layer, got {tuple(first.shape)}"
        )
    attention = layers[names[0]]
    running = rotary_contract(
        ropes[0],
        config.rope,
        same_module_all_layers=True,
        block_size=int(cache_config.block_size),
        dtype=CPU_DTYPES[dtype_name],
        kv_cache_dtype=str(cache_config.cache_dtype),
        attention=attention,
    )
    differ = running.diff(config.rope, tolerance=cos_sin_tolerance(CPU_DTYPES[dtype_name]))
    if differ:
        raise ConfigError(
            "vLLM runs another RoPE than its configuration says; a contract would describe neither: "
            + "; ".join(f"{d.field}: vLLM runs {d.ours!r}, configuration {d.theirs!r}" for d in differ)
        )
    checkpoint = checkpoint_for(Path(model_config.model), CPU_DTYPES[dtype_name], default=False)
    contract = CacheContract.for_model(
        config,
        key_form="rotated",  # vLLM rotates q and k before Attention writes the cache
        block_size=int(cache_config.block_size),
        dtype=dtype_name,
        weights_fingerprint=checkpoint.weights_fingerprint,
    )
    return EngineContract(
        contract=contract,
        kv_cache_dtype=str(cache_config.cache_dtype),
        kernel_isa=running.kernel_isa,
        attention_backend=running.attention_backend,
        kv_row_shape=(int(first.shape[1]), int(first.shape[3])),
        layer_names=names,
    )
