"""GGUF loading (ropekv/models/gguf_file.py): Q/K layout, name mapping, metadata, refusals.

Tiny GGUFs are written here with gguf-py's ``GGUFWriter`` from the tiny transformers checkpoints of
conftest, the way llama.cpp's converter writes them (llama Q/K rows permuted, qwen2/qwen3 not). Loading
them back must give transformers' weights exactly and transformers' logits. The real default GGUF
checks that both layouts give the same model.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType

from ropekv.errors import CheckpointError, ConfigError
from ropekv.models.computed import computation_fingerprint
from ropekv.models.gguf_file import hf_tensor_name, load_gguf, permute_qk, unpermute_qk
from ropekv.models.reference import ReferenceDecoder
from ropekv.rope import RopeSpec, layout_permutation

_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``, verbatim: the reference for our inverse."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module...>.weight|bias
    return f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gguf(
    path: Path,
    arch: str,
    config: Any,
    state: dict[str, torch.Tensor],
    *,
    extra: Callable[[GGUFWriter], None] | None = None,
    skip: tuple[str, ...] = (),
    override: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]] | None = None,
) -> Path:
    """Write ``state`` (HF names) as llama.cpp would: metadata from ``config``, F32 tensors, llama Q/K permuted."""
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(config.head_dim)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_vocab_size(config.vocab_size)
    if extra is not None:
        extra(w)
    for hf_name, tensor in state.items():
        name = gguf_name(hf_name)
        if name in skip:
            continue
        if override and name in override:
            data, raw_dtype = override[name]
            w.add_tensor(name, data, raw_dtype=raw_dtype)
            continue
        a = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            a = llama_cpp_permute(
                a, config.num_attention_heads, config.num_key_value_heads if ".k_proj." in hf_name else None
            )
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(make_tiny_checkpoint, hf_model, tmp_path_factory) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """``tiny_gguf(arch, **write_kwargs) -> (gguf path, transformers model)`` for a conftest tiny checkpoint."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    count = iter(range(10**6))

    def make(arch: str, **kwargs: Any) -> tuple[Path, torch.nn.Module]:
        model = hf_model(make_tiny_checkpoint(arch))
        path = write_gguf(root / f"{arch}-{next(count)}.gguf", arch, model.config, model.state_dict(), **kwargs)
        return path, model

    return make


# ---------------------------------------------------------------------------------- Q/K permutation


@pytest.mark.parametrize("num_heads,head_dim,cols", [(1, 2, 1), (3, 8, 5), (9, 64, 7), (2, 128, 1)])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int, head_dim: int, cols: int) -> None:
    rng = np.random.default_rng(num_heads * 1000 + head_dim)
    w = rng.standard_normal((num_heads * head_dim, cols))
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, num_heads), num_heads), w)
    assert np.array_equal(permute_qk(w, num_heads), llama_cpp_permute(w, num_heads))
    bias = w[:, 0].copy()  # 1-D rows (q/k biases) take the same permutation
    assert np.array_equal(unpermute_qk(llama_cpp_permute(bias, num_heads), num_heads), bias)


def test_permutation_turns_neox_rope_into_gptj_rope() -> None:
    """Why llama.cpp permutes: gptj RoPE on permuted rows == permuted (neox RoPE on original rows)."""
    heads, head_dim, hidden, T = 3, 16, 24, 11
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(heads * head_dim, hidden, generator=gen, dtype=torch.float64)
    x = torch.randn(T, hidden, generator=gen, dtype=torch.float64)
    positions = torch.arange(5, 5 + T)
    neox = RopeSpec(head_dim=head_dim, rotary_dim=head_dim, theta=10000.0, layout="neox")
    gptj = neox.replace(layout="gptj")
    w_gguf = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
    q_neox = neox.rotate((x @ w.T).view(T, heads, head_dim), positions)  # [T, H, D]
    q_gptj = gptj.rotate((x @ w_gguf.T).view(T, heads, head_dim), positions)
    perm = layout_permutation(head_dim, head_dim, "neox", "gptj")
    torch.testing.assert_close(q_gptj, q_neox[..., perm], atol=1e-12, rtol=0)


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None
    assert hf_tensor_name("rope_freqs.weight") is None


# ---------------------------------------------------------------------------------- tiny round trips


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_gives_transformers_weights_and_logits(arch: str, tiny_gguf) -> None:
    path, model = tiny_gguf(arch)
    checkpoint = load_gguf(path)
    assert checkpoint.config.architecture == arch and checkpoint.config.rope.layout == "neox"
    state = model.state_dict()
    assert set(checkpoint.weights) == set(state)
    for name, tensor in checkpoint.weights.items():
        assert torch.equal(tensor, state[name]), name  # F32 in the file: exact, Q/K un-permuted
    tokens = torch.arange(40) * 7 % model.config.vocab_size
    ours = ReferenceDecoder(checkpoint, dtype=torch.float64).forward(tokens).logits
    with torch.no_grad():
        theirs = model(tokens[None]).logits[0].double()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_tiny_llama_gptj_keeps_rows_and_matches(tiny_gguf) -> None:
    path, model = tiny_gguf("llama")
    neox, gptj = load_gguf(path, layout="neox"), load_gguf(path, layout="gptj")
    assert gptj.config.rope.layout == "gptj" and neox.fingerprint != gptj.fingerprint
    heads = model.config.num_attention_heads
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(gptj.weights[q], torch.from_numpy(permute_qk(neox.weights[q].numpy(), heads)))
    tokens = torch.arange(33) * 5 % model.config.vocab_size
    a = ReferenceDecoder(neox, dtype=torch.float64).forward(tokens).logits
    b = ReferenceDecoder(gptj, dtype=torch.float64).forward(tokens).logits
    torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_tiny_llama_transformers_reads_our_gguf_the_same_way(tiny_gguf) -> None:
    """transformers' own GGUF loader un-permutes our tiny file to the same weights (independent check)."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny_gguf("llama")
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).state_dict()
    for name, tensor in load_gguf(path).weights.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_refuses_gptj(arch: str, tiny_gguf) -> None:
    path, _ = tiny_gguf(arch)
    with pytest.raises(ConfigError, match="only layout='neox'"):
        load_gguf(path, layout="gptj")


def test_rope_scaling_metadata(tiny_gguf) -> None:
    def linear(w: GGUFWriter) -> None:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    def yarn(w: GGUFWriter) -> None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(2.0)
        w.add_rope_scaling_orig_ctx_len(128)
        w.add_rope_scaling_yarn_beta_fast(16.0)

    scaling = load_gguf(tiny_gguf("llama", extra=linear)[0]).config.rope.scaling
    assert (scaling.rope_type, scaling.factor) == ("linear", 4.0)
    scaling = load_gguf(tiny_gguf("llama", extra=yarn)[0]).config.rope.scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings, scaling.beta_fast) == (
        "yarn",
        2.0,
        128,
        16.0,
    )


# ---------------------------------------------------------------------------------- refusals


def test_not_a_gguf(tmp_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("this is not a model\n")
    with pytest.raises(CheckpointError, match=r"model\.gguf: not a GGUF file"):
        load_gguf(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty\.gguf: not a GGUF file"):
        load_gguf(empty)
    with pytest.raises(CheckpointError, match="missing.gguf"):
        load_gguf(tmp_path / "missing.gguf")


@pytest.mark.parametrize("keep", [10, 200, 0.5, -100])
def test_truncated_gguf(keep: float, tiny_gguf, tmp_path: Path) -> None:
    """Cut inside the header, the metadata, the tensor infos / data, the last tensor."""
    path, _ = tiny_gguf("llama")
    data = path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(data) + keep)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:n])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: truncated"):
        load_gguf(cut)


def test_absurd_declared_counts_are_refused_before_reading(tmp_path: Path) -> None:
    bad = tmp_path / "huge.gguf"
    bad.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 1, 2**60) + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"huge\.gguf: truncated or corrupt.*2\d+ metadata entries"):
        load_gguf(bad)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"gpt2\.gguf: unsupported GGUF architecture 'gpt2'"):
        load_gguf(path)


def test_unsupported_tensor_type_names_file_and_tensor(tiny_gguf) -> None:
    name = "blk.0.ffn_up.weight"
    raw = np.zeros((96, 64 // 32 * 18), dtype=np.uint8)  # IQ4_NL: 32 values in 18 bytes
    path, _ = tiny_gguf("llama", override={name: (raw, GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(CheckpointError, match=rf"{path.name}: tensor '{name}' has unsupported type IQ4_NL"):
        load_gguf(path)


def test_wrong_or_missing_tensors(tiny_gguf) -> None:
    path, _ = tiny_gguf("llama", skip=("blk.1.ffn_down.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) for model\.layers\.1\.mlp\.down_proj\.weight"):
        load_gguf(path)
    path, _ = tiny_gguf("llama", override={"blk.0.attn_v.weight": (np.zeros((16, 64), np.float32), None)})
    with pytest.raises(
        CheckpointError, match=r"tensor 'blk\.0\.attn_v\.weight' has shape \(16, 64\), config needs \(32, 64\)"
    ):
        load_gguf(path)


def test_unsupported_features_are_refused(tiny_gguf) -> None:
    def rope_freqs(w: GGUFWriter) -> None:
        w.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))

    with pytest.raises(ConfigError, match="rope_freqs"):
        load_gguf(tiny_gguf("llama", extra=rope_freqs)[0])

    def unknown_scaling(w: GGUFWriter) -> None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(2.0)
        w.add_rope_scaling_yarn_log_mul(0.1)

    with pytest.raises(ConfigError, match="yarn_log_multiplier"):
        load_gguf(tiny_gguf("llama", extra=unknown_scaling)[0])
    with pytest.raises(ConfigError, match="unknown layout"):
        load_gguf(tiny_gguf("llama")[0], layout="half")


def test_malformed_metadata_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_uint32("llama.embedding_length", 64)
    w.add_string("llama.attention.head_count", "four")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ConfigError, match=r"odd\.gguf: GGUF metadata llama\.attention\.head_count must be a single positive int"
    ):
        load_gguf(path)


# ---------------------------------------------------------------------------------- the real default GGUF


@pytest.fixture(scope="module")
def smollm_layouts() -> tuple[Any, Any]:
    from ropekv.models.default import default_gguf_path

    path = default_gguf_path()
    return load_gguf(path, layout="neox"), load_gguf(path, layout="gptj")


@pytest.mark.slow
def test_default_gguf_layouts_give_the_same_logits(smollm_layouts) -> None:
    neox, gptj = smollm_layouts
    assert (neox.config.rope.layout, gptj.config.rope.layout) == ("neox", "gptj")
    assert neox.fingerprint != gptj.fingerprint
    cfg = neox.config
    for layer in (0, cfg.num_layers - 1):
        for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(gptj.weights[name], torch.from_numpy(permute_qk(neox.weights[name].numpy(), heads)))
            assert not torch.equal(gptj.weights[name], neox.weights[name])
    tokens = (torch.arange(64) * 7919 + 13) % cfg.vocab_size
    a = ReferenceDecoder(neox, dtype=torch.float64).forward(tokens).logits
    b = ReferenceDecoder(gptj, dtype=torch.float64).forward(tokens).logits
    diff = (a - b).abs().max().item()
    assert diff < 1e-9, diff  # float64: the two readings are the same model up to rounding


@pytest.mark.slow
def test_default_gguf_fingerprint_equals_converted_cache(smollm_layouts) -> None:
    from ropekv.models.default import default_checkpoint

    neox, _ = smollm_layouts
    cached = default_checkpoint()
    assert cached.fingerprint == neox.fingerprint
    assert cached.config == neox.config


def test_both_layouts_have_one_computation_fingerprint(tiny_gguf) -> None:
    """The reference cache's key: the gptj presentation's is the neox load's own fingerprint."""
    path, _ = tiny_gguf("llama")
    neox, gptj = load_gguf(path, layout="neox"), load_gguf(path, layout="gptj")
    assert neox.fingerprint != gptj.fingerprint
    assert computation_fingerprint(gptj) == computation_fingerprint(neox) == neox.fingerprint
