"""``VLLMEngine``: the real vLLM engine (its CPU build), in this process, as a ropekv engine adapter.

What each tier reads:

- logits: vLLM's public API only. The cached path is one request (prompt = prefix + prompt, then
  ``decode_steps`` decodes, each output token forced to the case's token stream by the
  :mod:`.forced` logits processor) with ``logprobs=k``; the engine's own full forward is one request
  over the whole sequence with ``prompt_logprobs=k``, which vLLM computes without reading its prefix
  cache. vLLM returns top-k log-probabilities, not logits: records carry ``[k]`` values and ids.
- attention / forensics: :mod:`.probes` (hooks on the loaded model and on the call into the CPU
  attention kernel, removed after each call): q as the kernel got it, the keys it read from the paged
  cache through its block table, their slots and logical positions from vLLM's slot mapping.

A prefix hit is vLLM's own prefix cache: a parent request over the prefix plus another continuation
runs first; vLLM reuses only whole blocks, and how many tokens it took is read from its own counter
(``RequestOutput.num_cached_tokens``) into ``CaseRun.notes``. The prefix cache is reset before every
case. Chunked prefill is vLLM's scheduler splitting prompts at ``max_num_batched_tokens``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ...contract import DTYPES
from ...errors import AdapterError, CheckpointError, ConfigError, EngineUnavailable, RopeKVError, UsageError
from ...models.config import ModelConfig
from ...models.hf_config import read_model_config
from ...parity.cases import Case
from ...parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, StepRecord, Tier
from . import forced
from .contract import VLLMContract, read_contract, rotary_contract
from .probes import Probes
from .weights import checkpoint_for

ADAPTER = "vllm"
CPU_DTYPES = {name: DTYPES[name] for name in ("float32", "bfloat16")}  # vLLM's CPU build, from one table
BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend: MultipleOf(32) kernel block sizes
_PARENT_EXTRA = 3  # tokens of another continuation the parent request adds after the prefix
# Environment vLLM reads when it starts; set here unless the caller already chose.
ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: hooks and patches reach the model
    "OMP_NUM_THREADS": "2",  # unset, in-process decode runs about 15x slower on these machines
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",  # vLLM logs every prefix-cache reset at INFO
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout is the report's
}


def cos_sin_tolerance(dtype: torch.dtype, positions: int = 8192) -> float:
    """How far vLLM's cos/sin table of ``positions`` rows may be from ropekv's float64 one and still count
    as the same: its float32 computation (the angle position x inv_freq, rounded in float32 together
    with inv_freq itself: up to 2 x positions x 2**-24 rad, 1e-3 at 8k rows, 3.9e-3 at Gemma 3's 32,768,
    where vLLM's table measured 2.3e-3 on both bases), then rounding to the model dtype (bfloat16 keeps
    8 bits: 2**-8 relative)."""
    angle = max(1e-3, 2.0 * positions * 2.0**-24)
    return max(4e-3, angle) if dtype == torch.bfloat16 else angle


class VLLMEngine:
    """vLLM's ``LLM`` over a transformers model directory, checked by ropekv.

    ``model_dir=None`` is ropekv's embedded default (SmolLM2-135M, converted once to a transformers
    folder that vLLM loads as it is). ``block_size`` must be a multiple of 32; ``max_num_batched_tokens``
    small splits prompts into chunks. ``top_k`` is how many log-probabilities vLLM returns per row.
    ``llm_kwargs`` go to ``vllm.LLM`` unchanged (``num_gpu_blocks_override``, ``max_model_len``, ...).
    """

    tier = Tier.FORENSICS
    key_form = "rotated"

    def __init__(
        self,
        model_dir: str | os.PathLike | None,
        *,
        dtype: str | torch.dtype,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int | None = None,
        top_k: int = 20,
        **llm_kwargs: Any,
    ):
        self.dtype_name = _dtype_name(dtype)
        self.dtype = CPU_DTYPES[self.dtype_name]
        if not isinstance(block_size, int) or block_size < BLOCK_MULTIPLE or block_size % BLOCK_MULTIPLE:
            raise UsageError(
                f"vLLM's CPU attention backend needs a block size that is a multiple of "
                f"{BLOCK_MULTIPLE}, got {block_size!r}"
            )
        if max_num_batched_tokens is not None and (
            not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1
        ):
            raise UsageError(f"max_num_batched_tokens must be a positive integer, got {max_num_batched_tokens!r}")
        if not isinstance(top_k, int) or not 1 <= top_k <= 1000:
            raise UsageError(f"top_k must be an integer in [1, 1000], got {top_k!r}")
        if llm_kwargs.get("trust_remote_code"):
            raise ConfigError("trust_remote_code=True is refused: ropekv never runs code shipped with a checkpoint")
        for key in ("enforce_eager", "skip_tokenizer_init"):
            if key in llm_kwargs and not llm_kwargs[key]:
                raise UsageError(f"{key}=False is not supported: the hooks need vLLM's eager model and token ids")
        self.block_size, self.top_k = block_size, top_k
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.model_dir = _model_dir(model_dir)
        file_config = _read_config(self.model_dir)
        # ropekv's own reading of the same directory: the independent side of every comparison.
        self.checkpoint = checkpoint_for(self.model_dir, self.dtype, default=model_dir is None)
        for key, value in ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise UsageError("VLLM_ENABLE_V1_MULTIPROCESSING must be 0: ropekv hooks vLLM's model in this process")
        try:
            import vllm
        except ImportError as exc:
            raise EngineUnavailable(
                f"vLLM is not importable here (run from .venv-vllm: make setup-vllm): {exc}"
            ) from None
        self.vllm_version = vllm.__version__
        started = time.perf_counter()
        kwargs = dict(
            model=str(self.model_dir),
            dtype=self.dtype_name,
            block_size=block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            enforce_eager=True,
            load_format="safetensors",
            trust_remote_code=False,
            skip_tokenizer_init=True,
            max_num_seqs=1,
            seed=0,
            max_logprobs=top_k,
            logits_processors=[forced.processor_class()],
            max_model_len=min(int(file_config["max_position_embeddings"]), 8192),
        )
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        self.config_overrides = config_overrides(file_config)
        if self.config_overrides:
            kwargs["hf_overrides"] = dict(self.config_overrides)
        if "hf_overrides" in llm_kwargs and self.config_overrides:
            llm_kwargs = dict(llm_kwargs, hf_overrides={**self.config_overrides, **llm_kwargs["hf_overrides"]})
        kwargs.update(llm_kwargs)
        try:
            self.llm = vllm.LLM(**kwargs)
        except RopeKVError:
            raise
        except Exception as exc:  # vLLM raises ValueError, RuntimeError, pydantic errors...: one line for the user
            raise CheckpointError(f"{self.model_dir}: vLLM could not load it: {_one_line(exc)}") from None
        self.startup_seconds = time.perf_counter() - started
        engine = self.llm.llm_engine
        self.model = engine.model_executor.driver_worker.worker.model_runner.model
        self.vllm_config = engine.vllm_config
        self.max_num_batched_tokens = int(self.vllm_config.scheduler_config.max_num_batched_tokens)
        if int(self.vllm_config.cache_config.block_size) != block_size:
            raise AdapterError(ADAPTER, "block_size", str(block_size), str(self.vllm_config.cache_config.block_size))
        cfg: ModelConfig = self.checkpoint.config
        self.name = f"vLLM {self.vllm_version} (CPU, {self.dtype_name}, block {block_size})"
        self.contract: VLLMContract = read_contract(
            self.model,
            cfg.rope,
            block_size=block_size,
            dtype=self.dtype,
            kv_cache_dtype=str(self.vllm_config.cache_config.cache_dtype),
        )
        self.layer_contracts = layer_contracts(self.model, cfg, self.contract)
        tolerance = cos_sin_tolerance(self.dtype, max(c.cos_sin_positions for c in self.layer_contracts))
        self.contract_diff = _layer_diffs(self.layer_contracts, cfg, tolerance)
        self.probes = Probes(self.model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    # ------------------------------------------------------------------ the protocol

    def describe(self) -> EngineDescription:
        return EngineDescription(
            name=self.name,
            key_form=self.key_form,
            extra={
                "engine": "vllm",
                "vllm_version": self.vllm_version,
                "in_process": True,
                "enforce_eager": True,
                "model_dir": str(self.model_dir),
                "dtype": self.dtype_name,
                "block_size": self.block_size,
                "enable_prefix_caching": self.enable_prefix_caching,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "kv_cache_blocks": int(self.vllm_config.cache_config.num_gpu_blocks or 0),
                "top_k": self.top_k,
                "logits": f"top-{self.top_k} log-probabilities (decode logprobs vs prompt_logprobs)",
                "contract": self.contract.to_dict(),
                "contract_diff": [f"{d.field}: vLLM {d.ours}, checkpoint {d.theirs}" for d in self.contract_diff],
                "config_overrides": {k: str(v) for k, v in self.config_overrides.items()},
                "startup_seconds": round(self.startup_seconds, 2),
            },
        )

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        """Block size and chunking are engine-wide in vLLM: a case asking for others runs with vLLM's."""
        out = []
        if case.block_size != self.block_size:
            out.append(Ignored("block_size", f"block_size={case.block_size} (vLLM runs {self.block_size})"))
        if case.chunk is not None and case.chunk != self.max_num_batched_tokens:
            out.append(
                Ignored(
                    "chunk", f"chunk={case.chunk} (vLLM chunks at max_num_batched_tokens={self.max_num_batched_tokens})"
                )
            )
        if case.chunk is None and case.length > self.max_num_batched_tokens:
            out.append(
                Ignored(
                    "chunk",
                    f"chunk=None (vLLM splits the prompt at max_num_batched_tokens={self.max_num_batched_tokens})",
                )
            )
        return tuple(out)

    @torch.no_grad()
    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        self._refuse_window(case)
        ids = _token_list(tokens, case.total)
        P, L, S = case.prefix, case.length, case.decode_steps
        self.llm.reset_prefix_cache()
        self.probes.reset(case.decode_positions)
        notes = []
        with self.probes.installed():
            if P:
                vocab = self.checkpoint.config.vocab_size
                other = [(t + 1) % vocab for t in ids[P : P + _PARENT_EXTRA]]
                self._generate(ids[:P] + other, max_tokens=1)
            first = len(self.probes.forwards)
            out = self._generate(ids[: P + L], max_tokens=S + 1, logprobs=self.top_k, forced_ids=ids[P + L : P + L + S])
        generated = list(out.outputs[0].token_ids)
        if generated[:S] != ids[P + L : P + L + S]:
            raise AdapterError(
                ADAPTER, "decode tokens", f"the forced stream {ids[P + L : P + L + S]}", str(generated[:S])
            )
        cached = int(out.num_cached_tokens or 0)
        notes.append(
            f"vLLM took {cached} of {P + L} prompt tokens from its prefix cache "
            f"(case prefix {P}, block {self.block_size}: whole blocks only)"
        )
        prefill = [f for f in self.probes.forwards[first:] if int(f.positions[0]) < P + L]
        notes.append(
            f"prefill of {P + L - cached} tokens ran in {len(prefill)} forward pass(es) "
            f"(max_num_batched_tokens={self.max_num_batched_tokens})"
        )
        steps = []
        for s, t in enumerate(case.decode_positions):
            fwd = self.probes.forward_at(t)
            if fwd.positions.numel() != 1:
                raise AdapterError(
                    ADAPTER, f"decode step at {t}", "a one-token forward", f"{fwd.positions.numel()} tokens"
                )
            token_ids, values = _top_k(out.outputs[0].logprobs[s + 1], self.top_k)
            steps.append(
                StepRecord(position=t, logits=values, token_ids=token_ids, layers=self.probes.decode_probes(t))
            )
        self.probes.reset()
        return CaseRun(steps=tuple(steps), notes=tuple(notes))

    @torch.no_grad()
    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        """One request over ``tokens [T]`` with ``prompt_logprobs`` (vLLM reads no prefix cache for
        it); row ``r < T-1`` is prompt entry ``r + 1``, row ``T-1`` the first sampled token's."""
        self._refuse_window(case)
        T = int(torch.as_tensor(tokens).numel())
        ids = _token_list(tokens, T)
        rows = [int(r) for r in rows]
        if any(not 0 <= r < T for r in rows):
            raise UsageError(f"rows must be in [0, {T}), got {rows}")
        self.llm.reset_prefix_cache()
        self.probes.reset(rows, read_keys_position=T - 1)
        with self.probes.installed():
            out = self._generate(ids, max_tokens=1, logprobs=self.top_k, prompt_logprobs=self.top_k)
            layers = self.probes.full_probes(rows)
        if int(out.num_cached_tokens or 0):
            raise AdapterError(
                ADAPTER, "full forward", "no prefix-cache reads", f"{out.num_cached_tokens} cached tokens"
            )
        per_row = [out.prompt_logprobs[r + 1] if r < T - 1 else out.outputs[0].logprobs[0] for r in rows]
        pairs = [_top_k(lp, self.top_k) for lp in per_row]
        self.probes.reset()
        return FullRun(
            rows=torch.tensor(rows, dtype=torch.int64),
            logits=torch.stack([v for _, v in pairs]),
            token_ids=torch.stack([i for i, _ in pairs]),
            layers=layers,
        )

    # ------------------------------------------------------------------ running

    def _generate(
        self,
        prompt: list[int],
        *,
        max_tokens: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        forced_ids: list[int] | None = None,
    ):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            detokenize=False,
            ignore_eos=True,
            extra_args={forced.EXTRA_ARG: list(forced_ids)} if forced_ids else None,
        )
        try:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        except RopeKVError:  # the probes' own verdicts (AdapterError) pass through vLLM unchanged
            raise
        except Exception as exc:  # vLLM started but cannot run this model (e.g. no kernel for its head size)
            raise CheckpointError(f"{self.model_dir}: vLLM failed running it: {_one_line(exc)}") from None
        return outputs[0]

    def _refuse_window(self, case: Case) -> None:
        if case.window is not None or case.sink_tokens:
            raise UsageError(
                f"case {case.label()}: vLLM applies only the model's own sliding window; "
                "a case window or sinks cannot be run on it"
            )


# ---------------------------------------------------------------------- helpers


def layer_contracts(model: Any, cfg: ModelConfig, first: VLLMContract) -> tuple[VLLMContract, ...]:
    """One contract per layer, each read from the rotary module that layer calls (Gemma 3: vLLM builds
    one for the sliding layers, base 10,000, and one for the global layers, base 1,000,000) against
    that layer's own RoPE in the checkpoint. A model with one RoPE: ``first`` for every layer."""
    if cfg.uniform_rope and first.same_module_all_layers:
        return (first,) * cfg.num_layers
    out = []
    for i, block in enumerate(model.model.layers):
        spec = cfg.layer_rope(i)
        if spec is None:
            raise ConfigError(f"layer {i} has no RoPE (NoPE): the vLLM adapter checks rotated layers only")
        out.append(
            rotary_contract(
                block.self_attn.rotary_emb,
                spec,
                same_module_all_layers=True,
                block_size=first.block_size,
                dtype=CPU_DTYPES[first.dtype],
                kv_cache_dtype=first.kv_cache_dtype,
                attention=block.self_attn.attn,
            )
        )
    return tuple(out)


def _layer_diffs(contracts: tuple[VLLMContract, ...], cfg: ModelConfig, tolerance: float) -> tuple:
    """Every layer's contract against its own RoPE; a diff on layer ``i`` is named ``layer i: field``.
    One RoPE for every layer: the plain field names (layer 0's diff)."""
    if cfg.uniform_rope:
        return contracts[0].diff(cfg.rope, tolerance=tolerance)
    out = []
    for i, contract in enumerate(contracts):
        spec = cfg.layer_rope(i)
        assert spec is not None  # layer_contracts refused NoPE layers
        for d in contract.diff(spec, tolerance=tolerance):
            if d.field != "rotary module":
                out.append(type(d)(f"layer {i}: {d.field}", d.ours, d.theirs))
    return tuple(out)


def _dtype_name(dtype: str | torch.dtype) -> str:
    names = {v: k for k, v in CPU_DTYPES.items()}
    if isinstance(dtype, torch.dtype) and dtype in names:
        return names[dtype]
    if isinstance(dtype, str) and dtype in CPU_DTYPES:
        return dtype
    raise UsageError(f"the vLLM engine runs {', '.join(CPU_DTYPES)} on CPU, got {dtype!r}")


def _model_dir(model_dir: str | os.PathLike | None) -> Path:
    from ...models import resolve_model_dir

    folder = resolve_model_dir(model_dir)  # None or an embedded model's name: its converted folder
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: vLLM needs a transformers model directory (config.json + safetensors)")
    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{folder}: no .safetensors weights (ropekv never loads pickled weights)")
    return folder


def _read_config(folder: Path) -> dict:
    """config.json, validated by ropekv first: an architecture ropekv cannot reference is refused
    before vLLM starts (one line, exit 2)."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no config.json") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    read_model_config(config, source=str(path))  # ConfigError for what ropekv cannot reference
    return config


# transformers model_type -> the causal-LM class vLLM registers, for a config.json without ``architectures``
# (a folder written from transformers' own GGUF load carries none).
_ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM"}


def config_overrides(config: dict) -> dict[str, Any]:
    """What vLLM must be told about a config.json that transformers wrote from a GGUF load, so it runs
    the safetensors weights beside it (``hf_overrides``; stated in ``describe().extra``):

    - ``quantization_config`` with ``quant_method: gguf`` (transformers' record of the file it
      dequantized; the safetensors hold plain float weights, which ropekv's loader reads as such):
      dropped, else vLLM expects a GGUF file;
    - no ``architectures``: the causal-LM class of its ``model_type``, else vLLM guesses a pooling model.
    """
    out: dict[str, Any] = {}
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "gguf":
        out["quantization_config"] = None
    if not config.get("architectures") and config.get("model_type") in _ARCHITECTURES:
        out["architectures"] = [_ARCHITECTURES[config["model_type"]]]
    return out


def _token_list(tokens: torch.Tensor, need: int) -> list[int]:
    t = torch.as_tensor(tokens).reshape(-1).to(torch.int64)
    if t.numel() < need:
        raise UsageError(f"the case needs {need} tokens, got {t.numel()}")
    return t.tolist()


def _top_k(logprobs: dict, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_ids [k] int64, log-probabilities [k] float32)``: the ``k`` highest of vLLM's per-row
    dict (which adds the sampled / prompt token when it is not among them)."""
    if logprobs is None or len(logprobs) < k:
        raise AdapterError(
            ADAPTER, "logprobs", f"at least {k} entries per row", str(None if logprobs is None else len(logprobs))
        )
    best = sorted(logprobs.items(), key=lambda item: -item[1].logprob)[:k]
    return (
        torch.tensor([t for t, _ in best], dtype=torch.int64),
        torch.tensor([lp.logprob for _, lp in best], dtype=torch.float32),
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
