"""One vLLM instance with a KV connector, in its own process, driven over stdin/stdout (one JSON per line).

vLLM keeps its KV connector in a process-wide global, so a producer and a consumer (or two consumers)
cannot share a process; each test instance runs this script. argv[1] is a JSON object:
``{"connector", "role", "store", "policy", "hf_overrides", "max_num_batched_tokens"}``. Each stdin line is a request
``{"prompt": [token ids], "max_tokens": n}``; each stdout line the answer ``{"token_ids", "logprobs",
"num_cached_tokens", "finish_reason"}`` (or ``{"error"}``). ``{"ready": ...}`` is printed once vLLM is up.
"""

from __future__ import annotations

import json
import os
import sys
import time

for key, value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "2",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout carries the answers only
}.items():
    os.environ.setdefault(key, value)
# The tests read the connector's INFO lines ("inject 64 checked tokens") from this log; an in-process
# VLLMEngine of the same pytest session sets WARNING in os.environ, which this process inherits.
os.environ["VLLM_LOGGING_LEVEL"] = "INFO"


def main() -> None:
    spec = json.loads(sys.argv[1])
    import vllm
    from vllm.config import KVTransferConfig

    from ropekv.models.default import default_checkpoint_dir

    connector = spec["connector"]
    transfer = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path="ropekv.adapters.vllm.connector" if connector == "ContractConnector" else None,
        kv_role=spec["role"],
        kv_load_failure_policy=spec.get("policy", "fail"),
        kv_connector_extra_config={"shared_storage_path": spec["store"]},
    )
    started = time.perf_counter()
    llm = vllm.LLM(
        model=str(default_checkpoint_dir()),
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        load_format="safetensors",
        skip_tokenizer_init=True,
        enable_prefix_caching=False,  # every request asks the connector, never vLLM's own prefix cache
        max_num_seqs=1,
        max_model_len=256,
        num_gpu_blocks_override=16,
        seed=0,
        max_logprobs=1,
        kv_transfer_config=transfer,
        hf_overrides=spec.get("hf_overrides") or None,
        max_num_batched_tokens=spec.get("max_num_batched_tokens") or 256,  # smaller: prompts are chunked
    )
    print(json.dumps({"ready": round(time.perf_counter() - started, 1)}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = vllm.SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, logprobs=0)
        try:
            (out,) = llm.generate([vllm.TokensPrompt(prompt_token_ids=request["prompt"])], params, use_tqdm=False)
            completion = out.outputs[0]
            answer = {
                "token_ids": list(completion.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(completion.logprobs or [], completion.token_ids)],
                "num_cached_tokens": out.num_cached_tokens,
                "finish_reason": completion.finish_reason,
            }
        except Exception as exc:  # what vLLM raises for a failed request is part of what is measured
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
        print("answer:", json.dumps(answer), file=sys.stderr, flush=True)  # beside vLLM's log lines


if __name__ == "__main__":
    main()
