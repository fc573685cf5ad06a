"""The all-float32 GGUF holds exactly the Q4_1 file's weights, in llama.cpp's row order.

Compared tensor by tensor straight from the two files' readers (no checkpoint, no hashing): gguf-py's
dequantization of the Q4_1 file on one side, the new file's float32 bytes on the other.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import dequantize
from safetensors import safe_open

from ropekv.adapters.llamacpp.f32_gguf import default_f32_gguf
from ropekv.adapters.llamacpp.tolerance import weight_kind
from ropekv.models.default import WEIGHTS_FILE, default_checkpoint_dir, default_gguf_path
from ropekv.models.gguf_file import open_gguf, unpermute_qk


def test_f32_gguf_is_the_exact_dequantization_in_llama_cpp_row_order():
    mine, theirs = open_gguf(default_f32_gguf()), open_gguf(default_gguf_path())
    assert weight_kind(mine) == "f32" and weight_kind(theirs) == "Q4_1"
    theirs_by_name = {t.name: t for t in theirs.tensors}
    assert {t.name for t in mine.tensors} == set(theirs_by_name)
    for t in mine.tensors:
        assert t.tensor_type.name == "F32", t.name
        expected = dequantize(theirs_by_name[t.name].data, theirs_by_name[t.name].tensor_type)
        assert np.array_equal(np.asarray(t.data).reshape(expected.shape), expected), t.name
    for key in ("general.architecture", "llama.rope.freq_base", "tokenizer.ggml.model", "llama.context_length"):
        assert mine.fields[key].contents() == theirs.fields[key].contents(), key


def test_f32_gguf_unpermuted_equals_ropekvs_float32_safetensors():
    """Undoing llama.cpp's Q/K row permutation gives ropekv's own cached conversion bit for bit: the
    permutation was kept as the file had it, not applied twice or dropped."""
    mine = {t.name: t for t in open_gguf(default_f32_gguf()).tensors}
    heads, kv_heads = 9, 3  # SmolLM2-135M
    pairs = {
        "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", heads),
        "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj.weight", kv_heads),
        "blk.29.attn_k.weight": ("model.layers.29.self_attn.k_proj.weight", kv_heads),
        "token_embd.weight": ("model.embed_tokens.weight", None),
    }
    with safe_open(str(default_checkpoint_dir() / WEIGHTS_FILE), framework="np") as f:
        for gguf_name, (hf_name, n) in pairs.items():
            ours = np.asarray(mine[gguf_name].data)
            hf = f.get_tensor(hf_name)
            assert np.array_equal(unpermute_qk(ours, n) if n else ours, hf), gguf_name
            if n:
                assert not np.array_equal(ours, hf)  # the rows as llama.cpp runs them differ from HF's
