"""The all-float32 GGUF holds exactly the Q4_1 file's weights, in llama.cpp's row order."""

from __future__ import annotations

import torch

from ropekv.adapters.llamacpp.f32_gguf import default_f32_gguf
from ropekv.adapters.llamacpp.tolerance import weight_kind
from ropekv.models import load_checkpoint
from ropekv.models.default import default_gguf_path
from ropekv.models.gguf_file import load_gguf, open_gguf


def test_f32_gguf_is_the_exact_dequantization_in_llama_cpp_row_order():
    f32 = default_f32_gguf()
    assert weight_kind(open_gguf(f32)) == "f32"
    assert weight_kind(open_gguf(default_gguf_path())) == "Q4_1"
    mine = load_gguf(f32, layout="gptj").weights
    theirs = load_gguf(default_gguf_path(), layout="gptj").weights  # gguf-py's dequantization of Q4_1
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name


def test_f32_gguf_unpermuted_equals_ropekvs_float32_safetensors():
    """Read as HF weights, the new file gives ropekv's own cached conversion bit for bit: the Q/K
    permutation was kept, not applied twice or dropped."""
    mine = load_gguf(default_f32_gguf(), layout="neox").weights
    theirs = load_checkpoint(None).weights
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(mine[name], theirs[name]), name
    q = load_gguf(default_f32_gguf(), layout="gptj").weights["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, theirs["model.layers.0.self_attn.q_proj.weight"])  # rows as llama.cpp runs them
