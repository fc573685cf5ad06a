"""The reference decoder against transformers, its probes against themselves, and the safetensors loader.

Tiny random checkpoints come from conftest (written by transformers' ``save_pretrained``); the
transformers models they are compared with run in float32 with eager attention.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ropekv.errors import CheckpointError, ConfigError, UsageError
from ropekv.models import ReferenceDecoder, load, load_checkpoint
from ropekv.models.reference import visible
from ropekv.models.safetensors_dir import load_safetensors_dir
from ropekv.parity.recorder import attention_logits

ARCHES = ["llama", "mistral", "qwen2", "qwen3"]
T = 23  # longer than mistral's window (5), several windows long
ATOL = 1e-4

# Variants that exercise every RoPE type, biases on every projection, tied embeddings, per-layer windows.
VARIANTS = {
    "llama-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 5000.0}}),
    "llama-yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "rope_theta": 500000.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-longrope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen3-bias": ("qwen3", {"attention_bias": True}),
    "qwen2-sliding-layer": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
}


def tokens_of(n: int, vocab: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens[None]).logits[0].double()  # [T, vocab]


@pytest.fixture(scope="session")
def arch_dir(request, make_tiny_checkpoint):
    return make_tiny_checkpoint(request.param)


# ---------------------------------------------------------------------- logits vs transformers


@pytest.mark.parametrize("arch_dir", ARCHES, indirect=True)
def test_logits_match_transformers(arch_dir, hf_model):
    tokens = tokens_of(T)
    want = hf_logits(hf_model(arch_dir), tokens)
    checkpoint = load_checkpoint(arch_dir)
    out64 = ReferenceDecoder(checkpoint).forward(tokens).logits
    out32 = ReferenceDecoder(checkpoint, dtype=torch.float32).forward(tokens).logits
    assert out64.dtype == torch.float64 and out32.dtype == torch.float32
    assert out64.shape == (T, checkpoint.config.vocab_size)
    assert (out64 - want).abs().max() < ATOL
    assert (out32.double() - want).abs().max() < ATOL
    assert (out64 - out32.double()).abs().max() < ATOL
    assert want.abs().max() > 0.5  # unit-scale weights: a real comparison, not of near-zero logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_logits_match_transformers(variant, make_tiny_checkpoint, hf_model):
    arch, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(arch, **overrides)
    checkpoint = load_checkpoint(path)
    # Length-dependent RoPE must switch: past max_position_embeddings (256) for dynamic NTK, past
    # original_max_position_embeddings (64) for longrope.
    n = {"llama-dynamic": 300, "llama-longrope": 100}.get(variant, T)
    tokens = tokens_of(n, seed=1)
    want = hf_logits(hf_model(path), tokens)
    got = ReferenceDecoder(checkpoint).forward(tokens).logits
    assert (got - want).abs().max() < ATOL
    assert checkpoint.config.rope.scaling.rope_type == overrides.get("rope_parameters", {}).get("rope_type", "default")


def test_mistral_window_is_what_transformers_does(tiny_mistral_dir, hf_model):
    decoder = ReferenceDecoder(load_checkpoint(tiny_mistral_dir))
    tokens = tokens_of(T)
    MISTRAL_WINDOW = decoder.config.sliding_window
    assert MISTRAL_WINDOW == 5 and decoder.config.layer_window(0) == decoder.config.layer_window(1) == 5
    model_window = decoder.forward(tokens).logits
    assert torch.equal(model_window, decoder.forward(tokens, window=MISTRAL_WINDOW).logits)
    full = decoder.forward(tokens, window=None).logits
    assert torch.equal(full[:MISTRAL_WINDOW], model_window[:MISTRAL_WINDOW])  # no key is out of the window yet
    assert (full[MISTRAL_WINDOW:] - model_window[MISTRAL_WINDOW:]).abs().max() > 1e-3
    assert decoder.next_token(tokens) == int(hf_logits(hf_model(tiny_mistral_dir), tokens)[-1].argmax())


def test_int_window_equals_a_sliding_config(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir)
    sliding = checkpoint.with_config(
        checkpoint.config.replace(sliding_window=7, layer_types=("sliding_attention",) * checkpoint.config.num_layers)
    )
    tokens = tokens_of(T)
    a = ReferenceDecoder(checkpoint).forward(tokens, window=7).logits
    b = ReferenceDecoder(sliding).forward(tokens).logits
    assert torch.equal(a, b)
    assert sliding.fingerprint != checkpoint.fingerprint


# ---------------------------------------------------------------------- probes


@pytest.mark.parametrize("arch_dir", ARCHES, indirect=True)
def test_probes_are_consistent(arch_dir, hf_model):
    checkpoint = load_checkpoint(arch_dir)
    cfg = checkpoint.config
    decoder = ReferenceDecoder(checkpoint)
    tokens = tokens_of(T)
    rows = torch.tensor([0, 3, 7, T - 1, 12])
    out = decoder.forward(tokens, probe_rows=rows)
    assert decoder.forward(tokens).layers == ()
    assert torch.equal(out.logits, decoder.forward(tokens).logits)
    assert len(out.layers) == cfg.num_layers

    model = hf_model(arch_dir)
    with torch.no_grad():
        hf = model(tokens[None], output_hidden_states=True, output_attentions=True)
    H, KVH, D, R = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, len(rows)
    positions = torch.arange(T)
    embed = checkpoint.weights["model.embed_tokens.weight"].double()
    assert torch.equal(out.layers[0].hidden_in, embed[tokens[rows]])

    for layer, probe in enumerate(out.layers):
        assert torch.equal(out.rows, rows) and torch.equal(probe.key_positions, torch.arange(T))
        assert probe.hidden_in.shape == (R, cfg.hidden_size)
        assert probe.q_raw.shape == probe.q.shape == (R, H, D)
        assert probe.k_raw.shape == probe.k.shape == probe.v.shape == (T, KVH, D)
        attn_logits = attention_logits(probe, rows, scale=D**-0.5, window=cfg.layer_window(layer))
        assert attn_logits.shape == (H, R, T)
        assert attn_logits.dtype == torch.float64

        # The layer input is transformers' hidden state; q/k/v follow from it through HF's own modules.
        assert (probe.hidden_in - hf.hidden_states[layer][0, rows].double()).abs().max() < ATOL
        hf_layer = model.model.layers[layer]
        with torch.no_grad():
            h = hf_layer.input_layernorm(probe.hidden_in.float())
            q = hf_layer.self_attn.q_proj(h).view(R, H, D)
            k = hf_layer.self_attn.k_proj(h).view(R, KVH, D)
            v = hf_layer.self_attn.v_proj(h).view(R, KVH, D)
            if cfg.qk_norm:
                q, k = hf_layer.self_attn.q_norm(q), hf_layer.self_attn.k_norm(k)
        assert (probe.q_raw - q.double()).abs().max() < ATOL
        assert (probe.k_raw[rows] - k.double()).abs().max() < ATOL
        assert (probe.v[rows] - v.double()).abs().max() < ATOL

        # Rotation at the logical positions, with seq_len = T.
        assert torch.equal(probe.q, cfg.rope.rotate(probe.q_raw, rows, seq_len=T))
        assert torch.equal(probe.k, cfg.rope.rotate(probe.k_raw, positions, seq_len=T))

        # attn_logits[h, r, j] = q_rot[r, h] . k_rot[j, h // group] / sqrt(D), -inf where masked.
        window = cfg.layer_window(layer)
        for r, i in enumerate(rows.tolist()):
            for head in range(H):
                want = probe.k[:, head // (H // KVH)] @ probe.q[r, head] / D**0.5
                for j in range(T):
                    seen = j <= i and (window is None or i - window < j)
                    got = attn_logits[head, r, j]
                    assert torch.isclose(got, want[j], rtol=1e-12, atol=1e-12) if seen else got == float("-inf")
        # Softmax of the logits is transformers' attention pattern.
        probs = torch.softmax(attn_logits, dim=-1)
        assert (probs - hf.attentions[layer][0][:, rows].double()).abs().max() < 1e-5


def test_sink_tokens_and_window_override_in_probes(tiny_llama_dir):
    decoder = ReferenceDecoder(load_checkpoint(tiny_llama_dir))
    tokens = tokens_of(T)
    rows = torch.arange(T)
    out = decoder.forward(tokens, probe_rows=rows, window=4, sink_tokens=2)
    seen = torch.isfinite(attention_logits(out.layers[1], out.rows, scale=1.0, window=4, sink_tokens=2)[0])  # [T, T]
    for i in range(T):
        for j in range(T):
            assert bool(seen[i, j]) == (j <= i and (i - 4 < j or j < 2)), (i, j)
    assert torch.equal(seen, visible(rows, T, 4, 2))
    no_sinks = decoder.forward(tokens, window=4).logits
    assert torch.equal(out.logits[:4], no_sinks[:4])  # sinks 0..1 are still inside the window
    assert (out.logits[6:] - no_sinks[6:]).abs().max() > 1e-3


def test_forward_argument_errors(tiny_llama_dir):
    decoder = ReferenceDecoder(load_checkpoint(tiny_llama_dir))
    good = tokens_of(5)
    for bad_tokens in (torch.tensor([0, 96]), torch.tensor([-1, 2]), good[None], torch.tensor([]), good.float()):
        with pytest.raises(UsageError, match="token"):
            decoder.forward(bad_tokens)
    with pytest.raises(UsageError, match="probe_rows"):
        decoder.forward(good, probe_rows=[5])
    for bad_window in ("layer", 0, -3, 2.5):
        with pytest.raises(UsageError, match="window"):
            decoder.forward(good, window=bad_window)
    with pytest.raises(UsageError, match="sink_tokens"):
        decoder.forward(good, sink_tokens=-1)
    with pytest.raises(UsageError, match="dtype"):
        ReferenceDecoder(decoder.checkpoint, dtype=torch.int64)
    assert decoder.next_token([1, 2, 3]) == int(decoder.forward(torch.tensor([1, 2, 3])).logits[-1].argmax())


def test_load_builds_a_decoder(tiny_qwen3_dir):
    decoder = load(tiny_qwen3_dir)
    assert isinstance(decoder, ReferenceDecoder) and decoder.dtype == torch.float32
    assert decoder.config is decoder.checkpoint.config and decoder.config.architecture == "qwen3"
    d64 = load(tiny_qwen3_dir, dtype=torch.float64)
    assert d64.dtype == torch.float64
    assert d64.checkpoint.weights["model.norm.weight"].dtype == torch.float32  # checkpoint stays float32


# ---------------------------------------------------------------------- the safetensors loader


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(path: Path, change) -> None:
    """Apply ``change(tensors)`` to ``path/model.safetensors`` in place."""
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_loader_basics(tiny_qwen2_dir):
    checkpoint = load_safetensors_dir(tiny_qwen2_dir)
    assert checkpoint.source == str(tiny_qwen2_dir)
    assert all(t.dtype == torch.float32 for t in checkpoint.weights.values())
    assert set(checkpoint.weights) == set(checkpoint.config.expected_shapes())
    assert checkpoint.config.attention_bias and not checkpoint.config.o_bias
    again = load_checkpoint(tiny_qwen2_dir)
    assert again.fingerprint == checkpoint.fingerprint and len(checkpoint.fingerprint) == 16


def test_fingerprint_tracks_weights_and_config(tiny_llama_dir, tmp_path):
    base = load_checkpoint(tiny_llama_dir)
    path = copy_dir(tiny_llama_dir, tmp_path / "ck")
    rewrite_weights(path, lambda t: t["model.layers.1.mlp.up_proj.weight"].view(-1)[17].add_(1e-3))
    assert load_checkpoint(path).fingerprint != base.fingerprint
    path2 = copy_dir(tiny_llama_dir, tmp_path / "ck2")
    config = json.loads((path2 / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 20000.0
    (path2 / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(path2).fingerprint != base.fingerprint


def test_sharded_checkpoint_loads_identically(tiny_qwen3_dir, tmp_path):
    path = copy_dir(tiny_qwen3_dir, tmp_path / "sharded")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, path / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in shard_names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded, single = load_checkpoint(path), load_checkpoint(tiny_qwen3_dir)
    assert sharded.fingerprint == single.fingerprint
    assert all(torch.equal(sharded.weights[n], single.weights[n]) for n in names)
    tokens = tokens_of(9)
    assert torch.equal(
        ReferenceDecoder(sharded).forward(tokens).logits, ReferenceDecoder(single).forward(tokens).logits
    )


@pytest.mark.parametrize(
    "weight_map,match",
    [
        ([], "weight_map"),
        ({"model.norm.weight": 3}, "model.norm.weight"),
        ({"model.norm.weight": "../outside.safetensors"}, "outside the checkpoint"),
        ({"model.norm.weight": "/etc/passwd"}, "outside the checkpoint"),
        ({"model.norm.weight": "sub/../../x.safetensors"}, "outside the checkpoint"),
        ({"model.norm.weight": "missing.safetensors"}, "does not exist"),
        ({"model.norm.weight": "a.safetensors", "lm_head.weight": "a.safetensors"}, "lm_head.weight"),
        ({"model.norm.weight": "b.safetensors"}, "does not map"),
    ],
)
def test_bad_index_is_refused(weight_map, match, tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "ck")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, path / "a.safetensors")
    save_file(
        {"model.norm.weight": tensors["model.norm.weight"], "extra.weight": torch.zeros(2)}, path / "b.safetensors"
    )
    (tmp_path / "outside.safetensors").write_bytes((path / "a.safetensors").read_bytes())
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


def test_missing_dir_and_files(tiny_llama_dir, tmp_path):
    with pytest.raises(CheckpointError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="nowhere"):
        load_safetensors_dir(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path)  # an empty directory
    path = copy_dir(tiny_llama_dir, tmp_path / "ck")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="directory"):
        load_checkpoint(tiny_llama_dir / "model.safetensors")
    (tmp_path / "weights.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="weights.npz"):
        load_checkpoint(tmp_path / "weights.npz")


@pytest.mark.parametrize(
    "text,error,match",
    [
        ("{not json", ConfigError, "config.json.*not valid JSON"),
        ("\xff\xfe", ConfigError, "config.json.*not valid JSON"),
        ("[1, 2]", ConfigError, "config.json.*JSON object"),
    ],
)
def test_bad_config_json(text, error, match, tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "ck")
    (path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(error, match=match):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"num_attention_heads": "four"}, "num_attention_heads"),
        ({"vocab_size": None}, "vocab_size"),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        ({"hidden_act": "quick_gelu"}, "hidden_act"),
        ({"auto_map": {"AutoModelForCausalLM": "modeling_evil.Evil"}}, "custom code"),
        ({"rope_parameters": {"rope_type": "wavy", "rope_theta": 1e4}}, "wavy"),
    ],
)
def test_bad_config_fields(change, match, tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "ck")
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match) as info:
        load_checkpoint(path)
    assert "config.json" in str(info.value)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"), "missing.*model.layers.1.self_attn.k_proj.weight"),
        (lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}), "unexpected.*model.layers.0.mystery"),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(96, 63)}),
            r"model.layers.0.mlp.up_proj.weight has shape \(96, 63\)",
        ),
        (lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}), "model.norm.weight has dtype"),
    ],
)
def test_wrong_tensors_are_named(change, match, tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "ck")
    rewrite_weights(path, change)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


def _corrupt_truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _corrupt_header_length(data: bytes) -> bytes:
    return struct.pack("<Q", len(data) * 4) + data[8:]


def _corrupt_header_json(data: bytes) -> bytes:
    return data[:8] + b"#" * 16 + data[24:]


def _corrupt_offsets(data: bytes) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 10**6
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_truncate,
        _corrupt_header_length,
        _corrupt_header_json,
        _corrupt_offsets,
        lambda data: b"",
        lambda data: data[:5],
    ],
)
def test_corrupt_safetensors_file_is_named(corrupt, tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "ck")
    file = path / "model.safetensors"
    file.write_bytes(corrupt(file.read_bytes()))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path)


def test_pickles_are_refused_and_never_loaded(tiny_llama_dir, tmp_path, monkeypatch):
    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    path = copy_dir(tiny_llama_dir, tmp_path / "ck")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*pickles are refused and never loaded"):
        load_checkpoint(path)
    for name in ("model.pt", "model.pth", "model.ckpt", "model.bin", "model.pkl"):
        (tmp_path / name).write_bytes(b"junk")
        with pytest.raises(CheckpointError, match="pickle"):
            load_checkpoint(tmp_path / name)


def test_trust_remote_code_is_refused(tiny_llama_dir):
    with pytest.raises(ConfigError, match="trust_remote_code"):
        load_checkpoint(tiny_llama_dir, trust_remote_code=True)
    with pytest.raises(ConfigError, match="trust_remote_code"):
        load(tiny_llama_dir, trust_remote_code=True)


def test_derived_tensors_are_dropped(make_tiny_checkpoint, tmp_path):
    tied = make_tiny_checkpoint("llama", tie_word_embeddings=True)
    base = load_checkpoint(tied)
    assert "lm_head.weight" not in base.weights

    path = copy_dir(tied, tmp_path / "with_copies")
    rewrite_weights(
        path,
        lambda t: t.update(
            {
                "lm_head.weight": t["model.embed_tokens.weight"].clone(),
                "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
            }
        ),
    )
    loaded = load_checkpoint(path)
    assert set(loaded.weights) == set(base.weights)
    assert loaded.fingerprint == base.fingerprint

    path = copy_dir(tied, tmp_path / "untied_head")
    rewrite_weights(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_checkpoint(path)


def test_bfloat16_checkpoint_loads_as_float32(tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "bf16")
    rewrite_weights(path, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    loaded = load_checkpoint(path)
    original = load_checkpoint(tiny_llama_dir)
    for name, tensor in loaded.weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, original.weights[name].to(torch.bfloat16).float())
    assert loaded.fingerprint != original.fingerprint
