"""Finding: vLLM's RoPE table is computed in float32 and stored in the model dtype.

``RotaryEmbedding._compute_cos_sin_cache`` multiplies positions by ``inv_freq`` in float32 and casts
``cos | sin`` to the model dtype. Read from the loaded model (``layers[0].self_attn.rotary_emb``) and
compared with ropekv's float64 cos/sin, the error grows with position (float32 angles) and is set by
bfloat16 rounding in a bfloat16 engine. Prints the largest error per position range.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 \
        .venv-vllm/bin/python scripts/findings/vllm_cos_sin.py
"""

from __future__ import annotations

if __name__ == "__main__":
    import torch

    from ropekv.adapters.vllm import VLLMEngine

    for dtype in ("float32", "bfloat16"):
        engine = VLLMEngine(None, dtype=dtype, block_size=32, num_gpu_blocks_override=32, max_model_len=512)
        assert engine.contract.cos_sin_table is not None  # vLLM's rotary module keeps its cos_sin_cache
        table = engine.contract.cos_sin_table.double()  # [positions, rotary_dim]
        cos, sin = engine.checkpoint.config.rope.cos_sin(torch.arange(table.shape[0]))
        err = (table - torch.cat((cos, sin), dim=-1)).abs().max(dim=-1).values  # [positions]
        ranges = [(0, 128), (128, 1024), (1024, 4096), (4096, table.shape[0])]
        cells = ", ".join(f"[{a}, {b}): {float(err[a:b].max()):.1e}" for a, b in ranges)
        print(
            f"vLLM {engine.vllm_version} {dtype}: table {engine.contract.cos_sin_dtype} {tuple(table.shape)}; "
            f"max |cos/sin - float64| by position {cells}"
        )
