"""transformers architectures without rotary position embeddings, and what they use instead.

ropekv checks the RoPE convention of KV caches, so a config of one of these is refused saying that it
has no RoPE (and what encodes positions there), rather than as merely "unsupported".
"""

from __future__ import annotations

# model_type -> how the architecture encodes positions
NO_ROPE: dict[str, str] = {
    "gpt2": "learned absolute position embeddings",
    "gpt_bigcode": "learned absolute position embeddings",
    "opt": "learned absolute position embeddings",
    "biogpt": "learned absolute position embeddings",
    "xglm": "sinusoidal absolute position embeddings",
    "bloom": "ALiBi attention biases",
    "mpt": "ALiBi attention biases",
    "jais": "ALiBi attention biases",
    "mamba": "a state-space recurrence, no attention",
    "mamba2": "a state-space recurrence, no attention",
    "rwkv": "a linear recurrence, no attention",
    "bert": "learned absolute position embeddings (an encoder)",
    "t5": "relative position biases (an encoder-decoder)",
}
