"""Shared vLLM engines for the adapter's tests: started once per session (about 15 s each), in this
process, on ropekv's embedded SmolLM2-135M.

Small on purpose: 96 KV blocks of 32 tokens (3,072 slots, so every slot is a valid RoPE position for
the slot-as-position fault) and ``max_num_batched_tokens=64`` so the long case is prefilled in chunks.
scripts/test-vllm.sh sets the environment vLLM reads (in-process engine core, OMP threads, offline).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # parity_tools, replay

for key, value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "2",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}.items():
    os.environ.setdefault(key, value)

BLOCK = 32
BUDGET = 64  # max_num_batched_tokens: prompts longer than this are chunked
ENGINE_KWARGS = dict(block_size=BLOCK, max_num_batched_tokens=BUDGET, num_gpu_blocks_override=96, max_model_len=2048)


def _engine(dtype: str):
    from ropekv.adapters.vllm import VLLMEngine

    return VLLMEngine(None, dtype=dtype, **ENGINE_KWARGS)


@pytest.fixture(scope="session")
def engine_f32():
    return _engine("float32")


@pytest.fixture(scope="session")
def engine_bf16():
    return _engine("bfloat16")
