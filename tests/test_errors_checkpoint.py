"""Bad checkpoints: every refusal is a RopeKVError subclass whose message names the file and
the field or tensor at fault.

Each test corrupts a copy of the conftest tiny llama checkpoint in a tmp dir (or writes a tiny GGUF with
gguf-py's ``GGUFWriter``) and asserts the error class and the message, never only that "something" failed.
Pickled weights carry a live payload that would create a marker file if anything unpickled them.
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file, save_file

from ropekv.errors import CheckpointError, ConfigError, RopeKVError
from ropekv.models import load, load_checkpoint, load_config

# ----------------------------------------------------------------------------------- helpers


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    file = path / "config.json"
    config = json.loads(file.read_text())
    change(config)
    file.write_text(json.dumps(config))
    return file


def edit_weights(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def refused(error: type[RopeKVError], path: str | Path, *names: str, load_fn=load_checkpoint) -> str:
    """Assert ``load_fn(path)`` raises exactly ``error`` naming every string in ``names``; the message."""
    with pytest.raises(RopeKVError) as info:
        load_fn(path)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for name in names:
        assert str(name) in message, f"{name!r} not named in: {message}"
    if names and Path(str(names[0])).is_absolute():
        assert message.count(str(names[0]) + ":") == 1, f"path named more than once: {message}"
    return message


@pytest.fixture
def ck(tiny_llama_dir, tmp_path) -> Path:
    """A private copy of the tiny llama checkpoint to corrupt."""
    return copy_checkpoint(tiny_llama_dir, tmp_path / "ck")


def test_the_uncorrupted_copy_loads(ck):
    assert load_checkpoint(ck).config.num_layers == 2
    assert load_config(ck) == load_checkpoint(ck).config


# ----------------------------------------------------------------------------------- missing things


def test_missing_directory(tmp_path):
    missing = tmp_path / "no" / "such" / "checkpoint"
    refused(CheckpointError, missing, str(missing), "no such file or directory")
    refused(CheckpointError, missing, str(missing), load_fn=load_config)


def test_missing_config_json(ck):
    (ck / "config.json").unlink()
    refused(CheckpointError, ck, str(ck / "config.json"), "missing")


def test_missing_weights_file(ck):
    (ck / "model.safetensors").unlink()
    refused(CheckpointError, ck, str(ck), "model.safetensors", "model.safetensors.index.json")


def test_missing_shard(ck):
    tensors = load_file(ck / "model.safetensors")
    (ck / "model.safetensors").unlink()
    save_file(tensors, ck / "model-00001-of-00001.safetensors")
    weight_map = {name: "model-00001-of-00001.safetensors" for name in tensors}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(
        CheckpointError,
        ck,
        str(ck / "model.safetensors.index.json"),
        "model-00002-of-00002.safetensors",
        "model.norm.weight",
    )


def test_missing_gguf_file(tmp_path):
    refused(CheckpointError, tmp_path / "model.gguf", str(tmp_path / "model.gguf"))


# ----------------------------------------------------------------------------------- config.json


@pytest.mark.parametrize("text", ["{not json", "", "\xff\xfe{}", '{"a": ' * 100_000, "1" * 5000])
def test_config_json_that_is_not_json(ck, text):
    (ck / "config.json").write_bytes(text.encode("latin-1"))
    refused(ConfigError, ck, str(ck / "config.json"), "not valid JSON")


@pytest.mark.parametrize("text", ["[1, 2]", "null", '"llama"'])
def test_config_json_that_is_not_an_object(ck, text):
    (ck / "config.json").write_text(text)
    refused(ConfigError, ck, str(ck / "config.json"), "JSON object")


@pytest.mark.parametrize(
    "field",
    [
        "num_attention_heads",
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "intermediate_size",
        "rms_norm_eps",
        "max_position_embeddings",
    ],
)
def test_config_lacking_a_field(ck, field):
    file = edit_config(ck, lambda c: c.pop(field))
    refused(ConfigError, ck, str(file), field)
    refused(ConfigError, ck, str(file), field, load_fn=load_config)


def test_config_lacking_both_architecture_fields(ck):
    file = edit_config(ck, lambda c: (c.pop("architectures"), c.pop("model_type")))
    refused(ConfigError, ck, str(file), "missing field 'model_type'")


def test_config_lacking_model_type_is_refused_as_transformers_refuses_it(ck):
    """transformers' AutoConfig chooses the config class by model_type and refuses a config without
    one ("Should have a `model_type` key"), architectures or not: so does ropekv, naming both."""
    file = edit_config(ck, lambda c: c.pop("model_type"))
    refused(ConfigError, ck, str(file), "missing field 'model_type'", "LlamaForCausalLM")


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_attention_heads", "four"),
        ("hidden_size", 64.5),
        ("num_hidden_layers", True),
        ("num_hidden_layers", 10**9),
        ("num_hidden_layers", -2),
        ("vocab_size", [96]),
        ("rms_norm_eps", "tiny"),
        ("rms_norm_eps", 10**400),
        ("max_position_embeddings", 0),
        ("num_key_value_heads", 0),
        ("num_key_value_heads", 3),
        ("head_dim", "16"),
        ("rope_theta", "ten thousand"),
        ("rope_theta", 0.5),
        ("partial_rotary_factor", float("nan")),
        ("tie_word_embeddings", "no"),
        ("hidden_act", "quick_gelu"),  # not modelled (gelu, relu2, ... are)
        ("layer_types", ["full_attention", ["sliding_attention"]]),
    ],
)
def test_config_field_of_the_wrong_type_or_range(ck, field, value):
    def change(c):
        # transformers 5 writes rope_theta (and partial_rotary_factor) inside rope_parameters
        (c["rope_parameters"] if field in ("rope_theta", "partial_rotary_factor") else c)[field] = value

    file = edit_config(ck, change)
    message = refused(ConfigError, ck, str(file))
    named = {
        "num_key_value_heads": "num_key_value_heads",
        "rope_theta": "theta",
        "layer_types": "layer type",
        "partial_rotary_factor": "partial_rotary_factor",
    }.get(field, field)
    assert named in message, message


@pytest.mark.parametrize(
    "arch,model_type", [("GPT2LMHeadModel", "gpt2"), ("MambaForCausalLM", "mamba"), (None, "bloom")]
)
def test_unknown_architecture(ck, arch, model_type):
    def change(c):
        c["model_type"] = model_type
        c["architectures"] = [arch] if arch else []

    file = edit_config(ck, change)
    refused(ConfigError, ck, str(file), arch or model_type, "unsupported architecture")


@pytest.mark.parametrize(
    "field,rope",
    [
        ("rope_parameters", {"rope_type": "wavy", "rope_theta": 10000.0}),
        ("rope_scaling", {"type": "su2", "factor": 2.0}),
        ("rope_parameters", {"full_attention": {"rope_type": "ntk-by-parts", "rope_theta": 10000.0}}),
    ],
)
def test_unknown_rope_type(ck, field, rope):
    def change(c):
        c.pop("rope_parameters", None)
        c[field] = rope

    file = edit_config(ck, change)
    kind = rope.get("rope_type") or rope.get("type") or next(iter(rope.values()))["rope_type"]
    refused(ConfigError, ck, str(file), kind, "unknown RoPE type")


@pytest.mark.parametrize(
    "rope,named",
    [
        ({"rope_type": "linear", "rope_theta": 10000.0}, "factor"),
        (
            {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 0,
                "high_freq_factor": 4.0,
            },
            "low_freq_factor",
        ),
        ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": -1}, "beta_fast"),
        (
            {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": "big"},
            "original_max_position_embeddings",
        ),
        ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1e300}, "not finite and positive"),
        ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "wobble": 1}, "wobble"),
    ],
)
def test_bad_rope_parameters(ck, rope, named):
    file = edit_config(ck, lambda c: c.update({"rope_parameters": rope}))
    refused(ConfigError, ck, str(file), named)


# ----------------------------------------------------------------------------------- tensors


@pytest.mark.parametrize(
    "change,names",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
            ["missing", "model.layers.1.self_attn.k_proj.weight"],
        ),
        (lambda t: t.pop("lm_head.weight"), ["missing", "lm_head.weight"]),
        (
            lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}),
            ["unexpected", "model.layers.0.mystery.weight"],
        ),
        (
            lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(96, 64)}),
            ["unexpected", "model.layers.7"],
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(96, 63)}),
            ["model.layers.0.mlp.up_proj.weight", "(96, 63)", "(96, 64)"],
        ),
        (
            lambda t: t.update({"model.embed_tokens.weight": torch.zeros(96, 64, 1)}),
            ["model.embed_tokens.weight", "(96, 64, 1)"],
        ),
        (lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}), ["model.norm.weight", "int32"]),
    ],
)
def test_missing_extra_or_misshaped_tensors(ck, change, names):
    edit_weights(ck, change)
    refused(CheckpointError, ck, str(ck), *names)


# ----------------------------------------------------------------------------------- safetensors framing


def _header(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _with_header(header: dict, rest: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + rest


def _edit_tensor(data: bytes, name: str, **changes: Any) -> bytes:
    header, rest = _header(data)
    header[name].update(changes)
    return _with_header(header, rest)


TENSOR = "model.layers.0.self_attn.q_proj.weight"  # (64, 64) float32: 16384 bytes


def _lying_shape(data: bytes) -> bytes:
    return _edit_tensor(data, TENSOR, shape=[64, 65])


def _lying_dtype(data: bytes) -> bytes:
    return _edit_tensor(data, TENSOR, dtype="F64")


def _offsets_past_the_end(data: bytes) -> bytes:
    header, _ = _header(data)
    start, end = header[TENSOR]["data_offsets"]
    return _edit_tensor(data, TENSOR, data_offsets=[start, end + 10**9])


def _negative_offsets(data: bytes) -> bytes:
    return _edit_tensor(data, TENSOR, data_offsets=[-4, 16380])


def _shape_not_a_list(data: bytes) -> bytes:
    return _edit_tensor(data, TENSOR, shape="64x64")


def _overlapping_tensors(data: bytes) -> bytes:
    header, rest = _header(data)
    other = next(k for k in header if k not in ("__metadata__", TENSOR) and header[k]["shape"] == [64, 64])
    header[other]["data_offsets"] = header[TENSOR]["data_offsets"]
    return _with_header(header, rest)


CORRUPTIONS: dict[str, tuple[Callable[[bytes], bytes], str | None]] = {
    "truncated to half": (lambda d: d[: len(d) // 2], "needs bytes"),
    "truncated inside the header": (lambda d: d[:100], "header claims"),
    "only 5 bytes": (lambda d: d[:5], "no header length"),
    "empty": (lambda d: b"", "no header length"),
    "header length 2**40": (lambda d: struct.pack("<Q", 2**40) + d[8:], "header claims 1099511627776 bytes"),
    "header length past the end": (lambda d: struct.pack("<Q", len(d)) + d[8:], "header claims"),
    "header not JSON": (lambda d: d[:8] + b"#" * 16 + d[24:], "corrupt safetensors header"),
    "header not an object": (lambda d: _with_header([1, 2], _header(d)[1]), "not a JSON object"),  # type: ignore[arg-type]
    "header nested too deep": (
        lambda d: struct.pack("<Q", 100_000) + b"[" * 100_000 + d[8:],
        "corrupt safetensors header",
    ),
    "shape lies": (_lying_shape, TENSOR),
    "dtype lies": (_lying_dtype, TENSOR),
    "offsets past the end": (_offsets_past_the_end, TENSOR),
    "negative offsets": (_negative_offsets, TENSOR),
    "shape not a list": (_shape_not_a_list, TENSOR),
    "overlapping tensors": (_overlapping_tensors, None),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_truncated_or_lying_safetensors(ck, corruption):
    corrupt, named = CORRUPTIONS[corruption]
    file = ck / "model.safetensors"
    file.write_bytes(corrupt(file.read_bytes()))
    names = [str(file)] + ([named] if named else [])
    refused(CheckpointError, ck, *names)


# ----------------------------------------------------------------------------------- GGUF


def write_tiny_gguf(
    path: Path,
    ckpt_dir: Path,
    arch: str = "llama",
    override: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]] | None = None,
) -> Path:
    """The tiny checkpoint as an F32 GGUF (Q/K rows are not permuted: only refusals are tested here)."""
    config = json.loads((ckpt_dir / "config.json").read_text())
    tensors = load_file(ckpt_dir / "model.safetensors")
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    w = GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    w.add_key_length(config["head_dim"])
    w.add_vocab_size(config["vocab_size"])
    for hf_name, tensor in tensors.items():
        if hf_name in names:
            name = names[hf_name]
        else:
            parts = hf_name.split(".")
            name = f"blk.{parts[2]}.{layer['.'.join(parts[3:-1])]}.{parts[-1]}"
        if override and name in override:
            data, raw_dtype = override[name]
            w.add_tensor(name, data, raw_dtype=raw_dtype)
        else:
            w.add_tensor(name, tensor.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_tiny_gguf_loads(tiny_llama_dir, tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama_dir)
    assert load_checkpoint(path).config.architecture == "llama"
    assert load_config(path) == load_checkpoint(path).config


@pytest.mark.parametrize("arch", ["gpt2", "mamba", "phi3"])
def test_gguf_of_an_unsupported_architecture(tiny_llama_dir, tmp_path, arch):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", tiny_llama_dir, arch=arch)
    refused(ConfigError, path, str(path), f"unsupported GGUF architecture {arch!r}")
    refused(ConfigError, path, str(path), arch, load_fn=load_config)


@pytest.mark.parametrize(
    "qtype",
    [GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.Q8_1, GGMLQuantizationType.I32, GGMLQuantizationType.F64],
)
def test_gguf_of_an_unsupported_quantization(tiny_llama_dir, tmp_path, qtype):
    name = "blk.0.ffn_up.weight"  # [96, 64]
    if qtype in (GGMLQuantizationType.I32, GGMLQuantizationType.F64):  # typed by the numpy dtype
        raw, raw_dtype = np.zeros((96, 64), dtype=np.int32 if qtype == GGMLQuantizationType.I32 else np.float64), None
    else:
        block, type_size = GGML_QUANT_SIZES[qtype]
        raw, raw_dtype = np.zeros((96, 64 // block * type_size), dtype=np.uint8), qtype
    path = write_tiny_gguf(tmp_path / "quant.gguf", tiny_llama_dir, override={name: (raw, raw_dtype)})
    refused(CheckpointError, path, str(path), repr(name), f"unsupported type {qtype.name}")


# ----------------------------------------------------------------------------------- pickles, remote code


class _TouchOnUnpickle:
    """A pickle payload: unpickling it calls ``open(marker, "w")``, creating the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _poisoned_pickle(marker: Path) -> bytes:
    return pickle.dumps({"model.norm.weight": _TouchOnUnpickle(marker)})


def test_the_pickle_payload_is_live(tmp_path):
    """Control: the payload really creates its marker when something does unpickle it."""
    marker = tmp_path / "control-marker"
    pickle.loads(_poisoned_pickle(marker)).clear()
    assert marker.exists()


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any unpickling call fails the test loudly (belt and braces with the marker file)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    for module, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(module, name, forbidden)


def test_pickled_weights_are_refused_and_never_loaded(ck, tmp_path, no_unpickling):
    marker = tmp_path / "UNPICKLED"
    (ck / "model.safetensors").unlink()
    (ck / "pytorch_model.bin").write_bytes(_poisoned_pickle(marker))
    refused(CheckpointError, ck, str(ck), "pytorch_model.bin", "pickles are refused and never loaded")
    refused(CheckpointError, ck / "pytorch_model.bin", str(ck / "pytorch_model.bin"), "pickled weights are refused")
    refused(CheckpointError, ck / "pytorch_model.bin", "pickled weights are refused", load_fn=load_config)
    for suffix in (".pt", ".pth", ".ckpt", ".pkl", ".pickle"):
        other = tmp_path / f"weights{suffix}"
        other.write_bytes(_poisoned_pickle(marker))
        refused(CheckpointError, other, str(other), "pickled weights are refused")
    assert not marker.exists()


def test_a_pickle_next_to_safetensors_is_never_opened(ck, tmp_path, no_unpickling):
    marker = tmp_path / "UNPICKLED"
    (ck / "pytorch_model.bin").write_bytes(_poisoned_pickle(marker))
    assert load_checkpoint(ck).config.num_layers == 2
    assert not marker.exists()


def test_a_pickle_posing_as_a_shard_is_refused(ck, tmp_path, no_unpickling):
    marker = tmp_path / "UNPICKLED"
    tensors = load_file(ck / "model.safetensors")
    (ck / "model.safetensors").unlink()
    (ck / "pytorch_model-00001-of-00001.bin").write_bytes(_poisoned_pickle(marker))
    index = {"weight_map": {name: "pytorch_model-00001-of-00001.bin" for name in tensors}}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(CheckpointError, ck, str(ck / "pytorch_model-00001-of-00001.bin"))
    assert not marker.exists()


def test_trust_remote_code_is_refused(ck):
    for fn in (lambda p: load_checkpoint(p, trust_remote_code=True), lambda p: load(p, trust_remote_code=True)):
        refused(ConfigError, ck, "trust_remote_code=True is refused", load_fn=fn)


@pytest.mark.parametrize(
    "change",
    [
        {"auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}},
        {"trust_remote_code": True},
    ],
)
def test_config_asking_for_remote_code_is_refused(ck, tmp_path, change):
    (ck / "modeling_evil.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w')\n")
    file = edit_config(ck, lambda c: c.update(change))
    refused(ConfigError, ck, str(file), "auto_map / trust_remote_code", "never runs checkpoint code")
    assert not (tmp_path / "RAN").exists()


# ----------------------------------------------------------------------------------- non-finite weights


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_weight_is_refused_at_load_naming_tensor_and_file(ck, bad, dtype):
    name = "model.layers.1.self_attn.k_proj.weight"

    def change(tensors):
        for k in tensors:
            tensors[k] = tensors[k].to(dtype)
        tensors[name][3, 5] = bad

    edit_weights(ck, change)
    kind = "NaN" if bad != bad else ("+inf" if bad > 0 else "-inf")
    message = refused(CheckpointError, ck, str(ck / "model.safetensors"), repr(name), f"{kind} at [3, 5]")
    assert "1 non-finite value)" in message


def test_a_non_finite_weight_in_a_gguf_is_refused_naming_the_gguf_tensor(tiny_llama_dir, tmp_path):
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    data = tensors["model.layers.0.mlp.up_proj.weight"].numpy().astype(np.float32).copy()
    data[7, 2] = np.nan
    path = write_tiny_gguf(
        tmp_path / "nan.gguf", tiny_llama_dir, override={"blk.0.ffn_up.weight": (data, GGMLQuantizationType.F32)}
    )
    refused(
        CheckpointError, path, str(path), "'blk.0.ffn_up.weight'", "model.layers.0.mlp.up_proj.weight", "NaN at [7, 2]"
    )


def test_a_non_finite_weight_of_a_model_in_memory_is_refused(tiny_llama_dir):
    from ropekv.models.config import Checkpoint

    ckpt = load_checkpoint(tiny_llama_dir)
    weights = dict(ckpt.weights)
    weights["model.norm.weight"] = weights["model.norm.weight"].clone()
    weights["model.norm.weight"][4] = float("inf")
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' holds \+inf at \[4\]"):
        Checkpoint.from_tensors(ckpt.config, weights, source="a model in memory")
