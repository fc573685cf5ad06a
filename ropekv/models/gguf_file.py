"""Load a GGUF file (llama.cpp's format) as a float32 :class:`Checkpoint`.

The file is read with gguf-py's ``GGUFReader`` and every tensor is dequantized with
``gguf.quants.dequantize``. The GGUF metadata becomes a transformers-style config dict
(:func:`hf_config_from_gguf`) that goes through the same validation as a ``config.json``.

Q/K layout (the one thing a GGUF does not record): llama.cpp's converter permutes the
rows of each head of ``q_proj`` / ``k_proj`` (and their biases) of *llama* models so that its
interleaved ("NORM", our ``"gptj"``) RoPE pairing computes what HF's ``rotate_half`` (``"neox"``)
computes on the original weights. So a llama GGUF can be read two equivalent ways:

- ``layout="neox"`` (default): undo the permutation; the weights equal the HF checkpoint's and the
  RoPE spec says ``"neox"``.
- ``layout="gptj"``: keep the rows as stored; the RoPE spec says ``"gptj"`` (what llama.cpp runs).

Both give the same attention scores, since a channel permutation applied to both q and k of a head
leaves their dot product unchanged. qwen2/qwen3 GGUFs are *not* permuted (llama.cpp runs them with
its NEOX rope), so for them only ``layout="neox"`` describes the file; ``"gptj"`` is refused rather
than silently re-permuting weights the caller asked to keep.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

from ..errors import CheckpointError, ConfigError
from ..files import open_regular
from ..rope import LAYOUTS, layout_permutation
from .config import Checkpoint, ModelConfig, fingerprint_of
from .hf_config import read_model_config
from .weights import non_finite, weights_digest

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_HF_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_MODEL_TYPE = {"gemma3": "gemma3_text"}  # transformers' model_type where it is not the GGUF architecture
# Architectures whose Q/K rows llama.cpp's converter permuted for its interleaved RoPE.
_PERMUTED_ARCHITECTURES = ("llama",)

_T = GGMLQuantizationType
# Tensor types gguf-py dequantizes in numpy and that real llama-family files use.
SUPPORTED_TYPES = frozenset(
    {
        _T.F32,
        _T.F16,
        _T.BF16,
        _T.Q4_0,
        _T.Q4_1,
        _T.Q5_0,
        _T.Q5_1,
        _T.Q8_0,
        _T.Q2_K,
        _T.Q3_K,
        _T.Q4_K,
        _T.Q5_K,
        _T.Q6_K,
    }
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3's sandwich norms: llama.cpp names the pre-MLP norm ffn_norm (llama's post-attention norm).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES}
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (its RMSNorm multiplies by w);
# transformers' Gemma norms multiply by 1 + w, so the HF weight is the stored one minus 1.
_NORM_OFFSET_ARCHITECTURES = ("gemma3",)
# What llama.cpp assumes for gemma3 when the file does not say (llama-model.cpp, LLM_ARCH_GEMMA3):
# every sixth layer global, the sliding layers' RoPE base 10,000 (unscaled).
_GEMMA3_SWA_PERIOD, _GEMMA3_SWA_THETA = 6, 10000.0
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Rope scaling keys we translate; any other "<arch>.rope.scaling.*" key is refused, not dropped.
_SCALING_KEYS = {
    "type",
    "factor",
    "original_context_length",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "attn_factor",
    "finetuned",
}

_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor_count, kv_count
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# GGUF metadata value types (gguf.GGUFValueType): bytes of each scalar; 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_ARRAY_DEPTH = 4
# gguf-py's reader builds a Python object per array element (a 10**7-string array took it minutes and
# 16 GB): arrays are capped before it starts. 2**20 is four times the largest vocabulary (262,144 tokens)
# and above the largest merge list (about 280,000 for Llama 3); all arrays together 2**22.
MAX_ARRAY_ELEMENTS = 1 << 20
MAX_METADATA_ELEMENTS = 1 << 22
_MIN_KV_BYTES = 8 + 1 + 4  # key length, >= 1 key byte, value type
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, n_dims, one dim, type, offset


# ---------------------------------------------------------------------------------------- reading


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """A ``GGUFReader`` over ``path`` after bounding its declared sizes; :class:`CheckpointError` if the
    file is missing, not GGUF, truncated or inconsistent (the message names the file)."""
    path = Path(path)
    f, size = open_regular(path, "GGUF file", CheckpointError)  # a FIFO or another user's file: one line
    try:
        with f:
            head = f.read(_HEADER.size)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read GGUF file: {exc.strerror or exc}") from None
    if len(head) < 4 or head[:4] != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (no 'GGUF' magic)")
    if len(head) < _HEADER.size:
        raise CheckpointError(f"{path}: truncated GGUF file ({size} bytes, header incomplete)")
    _, version, n_tensors, n_kv = _HEADER.unpack(head)
    if version not in (2, 3):
        # Also catches big-endian files (version bytes swapped), which we do not read.
        raise CheckpointError(f"{path}: unsupported GGUF version {version} (2 or 3 little-endian expected)")
    # Every entry takes some bytes, so counts larger than the file allows are corrupt; refusing them
    # here keeps the reader from looping over (or allocating for) billions of phantom entries.
    if n_kv * _MIN_KV_BYTES > size or n_tensors * _MIN_TENSOR_INFO_BYTES > size:
        raise CheckpointError(
            f"{path}: truncated or corrupt GGUF file: header declares {n_kv} metadata entries and "
            f"{n_tensors} tensors, more than {size} bytes can hold"
        )
    _check_metadata_sizes(path, n_kv, size)
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({type(exc).__name__}: {exc})") from None
    for t in reader.tensors:
        end = t.data_offset + t.n_bytes
        if end > size or t.data.nbytes != t.n_bytes:
            raise CheckpointError(
                f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to {end}, file has {size}"
            )
    return reader


def _check_metadata_sizes(path: Path, n_kv: int, size: int) -> None:
    """Walk the metadata entries and check every declared length against the bytes left in the file.

    gguf-py's reader loops once per declared array element and does not stop at the end of the file
    (reads past it come back empty), so an array declaring 2**60 elements would keep it busy forever,
    growing a list: the lengths are bounded here, before the reader starts.
    """

    elements = [0]  # array elements seen so far, across every entry

    def corrupt(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: truncated or corrupt GGUF file: {what}")

    def take(fmt: struct.Struct, off: int) -> tuple[Any, int]:
        if off + fmt.size > size:
            raise corrupt(f"metadata runs past the end of the file (byte {off + fmt.size} of {size})")
        return fmt.unpack_from(data, off)[0], off + fmt.size

    def string_end(off: int, what: str) -> int:
        n, off = take(_U64, off)
        if n > size - off:
            raise corrupt(f"{what} declares a {n}-byte string, {size - off} bytes are left")
        return off + n

    def value_end(off: int, vtype: int, key: str, depth: int) -> int:
        if vtype in _SCALAR_BYTES:
            end = off + _SCALAR_BYTES[vtype]
        elif vtype == _STRING:
            return string_end(off, f"metadata {key!r}")
        elif vtype == _ARRAY and depth < _MAX_ARRAY_DEPTH:
            itype, off = take(_U32, off)
            count, off = take(_U64, off)
            least = _SCALAR_BYTES.get(itype, 8 if itype == _STRING else 12)  # 12: a nested array header
            if count * least > size - off:
                raise corrupt(f"metadata {key!r} declares {count} array elements, {size - off} bytes are left")
            if count > MAX_ARRAY_ELEMENTS or elements[0] + count > MAX_METADATA_ELEMENTS:
                raise CheckpointError(
                    f"{path}: metadata {key!r} declares {count} array elements; ropekv reads at most "
                    f"{MAX_ARRAY_ELEMENTS} per array and {MAX_METADATA_ELEMENTS} in all (the largest vocabularies "
                    "hold about 262,144 tokens)"
                )
            elements[0] += count
            if itype in _SCALAR_BYTES:
                return off + count * least
            for _ in range(count):
                off = value_end(off, itype, key, depth + 1)
            return off
        else:
            raise corrupt(f"metadata {key!r} has an unknown or too deeply nested value type {vtype}")
        if end > size:
            raise corrupt(f"metadata {key!r} runs past the end of the file")
        return end

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        off = _HEADER.size
        for i in range(n_kv):
            key_start = off
            off = string_end(off, f"metadata entry {i}")
            key = bytes(data[key_start + 8 : min(off, key_start + 8 + 200)]).decode("utf-8", "replace")
            vtype, off = take(_U32, off)
            off = value_end(off, vtype, key, 0)


def read_metadata(reader: GGUFReader, skip: tuple[str, ...] = ("tokenizer.ggml.",)) -> dict[str, Any]:
    """Scalar and array metadata as Python values (big tokenizer arrays skipped by default)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key.startswith(skip):
            continue
        try:
            out[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{reader.data.filename}: unreadable metadata {key!r}: {exc}") from None
    return out


def hf_config_from_gguf(reader: GGUFReader, source: str) -> dict[str, Any]:
    """A transformers-style ``config.json`` dict describing the model in ``reader``.

    Raises :class:`ConfigError` (naming ``source``) for architectures or features ropekv does not
    model: other architectures, MoE, sliding windows, llama3's ``rope_freqs`` tensor, unknown RoPE
    scaling metadata.
    """
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}

    def num(key: str, kind: type = int, default: Any = None) -> Any:
        """``<arch>.<key>`` as one positive int (or a float); ``default`` when absent, else required."""
        value = meta.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ConfigError(f"{source}: missing GGUF metadata {arch}.{key}")
            return default
        ok = isinstance(value, int) and value > 0 if kind is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok:
            raise ConfigError(
                f"{source}: GGUF metadata {arch}.{key} must be a single positive {kind.__name__}, got {value!r}"
            )
        return kind(value)

    for key, what in (("expert_count", "mixture-of-experts"), ("attention.sliding_window", "sliding-window attention")):
        if meta.get(f"{arch}.{key}") and not (arch == "gemma3" and key == "attention.sliding_window"):
            raise ConfigError(f"{source}: {what} ({arch}.{key}) is not supported")
    if "rope_freqs.weight" in names:
        raise ConfigError(f"{source}: per-dimension RoPE factors (rope_freqs.weight, llama3 scaling) are not supported")

    hidden, num_heads = num("embedding_length"), num("attention.head_count")
    num_kv_heads = num("attention.head_count_kv", default=num_heads)
    head_dim = num("attention.key_length", default=hidden // num_heads or 1)
    rotary_dim = num("rope.dimension_count", default=head_dim)
    if rotary_dim != head_dim:
        # llama.cpp permutes whole heads; partial rotary would make the two layouts inequivalent.
        raise ConfigError(
            f"{source}: partial rotary (rope.dimension_count {rotary_dim} != head_dim {head_dim}) is not supported"
        )
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ConfigError(f"{source}: no {arch}.vocab_size metadata and no token_embd.weight tensor")
        vocab = int(embd.shape[-1])
    else:
        vocab = num("vocab_size")
    config: dict[str, Any] = {
        "architectures": [_HF_CLASS[arch]],
        "model_type": _MODEL_TYPE.get(arch, arch),
        "name": str(meta.get("general.name") or arch),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": num("feed_forward_length"),
        "num_hidden_layers": num("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon", float),
        "rope_theta": num("rope.freq_base", float, default=10000.0),  # llama.cpp's default
        "max_position_embeddings": num("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id"):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        value = None if field is None else field.contents()
        if isinstance(value, int) and not isinstance(value, bool):
            config[key] = value
    try:
        scaling = _rope_scaling(meta, arch, source)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: malformed RoPE scaling metadata: {exc}") from None
    if arch == "gemma3":
        _gemma3_fields(config, meta, scaling, source)
    elif scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _gemma3_fields(
    config: dict[str, Any], meta: Mapping[str, Any], scaling: dict[str, Any] | None, source: str
) -> None:
    """Gemma 3's own fields, as transformers' ``Gemma3TextConfig`` spells them (in place).

    The file records the window and the global layers' base; the layer pattern and the sliding
    layers' base are llama.cpp's fixed gemma3 values unless the file says otherwise. RoPE scaling,
    where the file has it, applies to the global layers only (llama.cpp keeps the sliding layers
    unscaled, as transformers does).
    """
    window = meta.get("gemma3.attention.sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"{source}: gemma3 needs a positive gemma3.attention.sliding_window, got {window!r}")
    period = meta.get("gemma3.attention.sliding_window_pattern", _GEMMA3_SWA_PERIOD)
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ConfigError(f"{source}: gemma3.attention.sliding_window_pattern must be a positive int, got {period!r}")
    swa_theta = meta.get("gemma3.rope.freq_base_swa", _GEMMA3_SWA_THETA)
    if not isinstance(swa_theta, (int, float)) or isinstance(swa_theta, bool) or not swa_theta > 0:
        raise ConfigError(f"{source}: gemma3.rope.freq_base_swa must be a positive number, got {swa_theta!r}")
    layers = config["num_hidden_layers"]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    if scaling is not None:
        full = {**scaling, "rope_theta": full["rope_theta"]}
    del config["hidden_act"]
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=window,
        layer_types=["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": float(swa_theta)},
            "full_attention": full,
        },
        # llama.cpp's attention scale for gemma3: 1/sqrt(head_dim), except the 27B (62 layers): 1/sqrt(hidden/heads).
        query_pre_attn_scalar=(
            config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
        ),
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )


def _rope_scaling(meta: Mapping[str, Any], arch: str, source: str) -> dict[str, Any] | None:
    """transformers' ``rope_scaling`` from ``<arch>.rope.scaling.*`` (linear and yarn only)."""
    prefix = f"{arch}.rope.scaling."
    found = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}
    unknown = set(found) - _SCALING_KEYS
    if unknown:
        raise ConfigError(
            f"{source}: unsupported RoPE scaling metadata {', '.join(prefix + k for k in sorted(unknown))}"
        )
    kind = found.get("type") or "none"
    legacy = meta.get(f"{arch}.rope.scale_linear")
    if kind == "none" and legacy not in (None, 1.0):
        kind, found["factor"] = "linear", legacy
    if kind == "none":
        return None
    if found.get("attn_factor") not in (None, 1.0):
        # llama.cpp multiplies this into its own YaRN mscale; it is not transformers' attention_factor.
        raise ConfigError(f"{source}: {prefix}attn_factor = {found['attn_factor']} is not supported")
    factor = found.get("factor")
    if factor is None:
        raise ConfigError(f"{source}: RoPE scaling {kind!r} without {prefix}factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if found.get("original_context_length"):
            out["original_max_position_embeddings"] = int(found["original_context_length"])
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if found.get(gguf_key) is not None:
                out[hf_key] = float(found[gguf_key])
        return out
    raise ConfigError(f"{source}: unsupported RoPE scaling type {kind!r} (linear and yarn are supported)")


# ---------------------------------------------------------------------------------------- Q/K rows


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (``LlamaModel.permute``): HF rows -> GGUF rows.

    ``w``: ``[num_heads * head_dim, ...]`` (a weight ``[out, in]`` or a bias ``[out]``). Within each
    head, row ``j * head_dim/2 + i`` moves to ``2 * i + j``: the neox pair ``(i, i + head_dim/2)``
    becomes the interleaved pair ``(2i, 2i + 1)``.
    """
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of :func:`permute_qk`: GGUF rows -> HF rows, ``w``: ``[num_heads * head_dim, ...]``.

    Equal to gathering each head's rows with ``layout_permutation(head_dim, head_dim, "gptj", "neox")``.
    """
    head_dim = w.shape[0] // num_heads
    perm = layout_permutation(head_dim, head_dim, "gptj", "neox").numpy()
    return w.reshape(num_heads, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


# ---------------------------------------------------------------------------------------- loading


def load_gguf(path: str | os.PathLike, *, layout: str = "neox") -> Checkpoint:
    """Read, validate and dequantize the GGUF file at ``path`` into a float32 :class:`Checkpoint`.

    ``layout`` chooses how the Q/K rows of a llama file are presented (module docstring). The
    fingerprint is ``fingerprint_of(config, weights_digest(dequantized float32 tensors))``, the one a
    safetensors copy of the same weights gets; the config includes the layout. A NaN or infinity
    is refused naming the GGUF tensor and the file.
    """
    return checkpoint_from_reader(open_gguf(path), path, layout=layout)[0]


def checkpoint_from_reader(
    reader: GGUFReader, path: str | os.PathLike, *, layout: str = "neox"
) -> tuple[Checkpoint, dict[str, Any]]:
    """:func:`load_gguf` on an open reader; also returns the transformers config dict it built.

    Opening a reader parses the whole vocabulary (seconds), so the default-model conversion opens
    one and shares it with the tokenizer.
    """
    path = Path(path)
    source = str(path)
    config, hf = config_from_reader(reader, path, layout=layout)
    arch = next(a for a, c in _HF_CLASS.items() if c == hf["architectures"][0])
    permuted = arch in _PERMUTED_ARCHITECTURES
    norm_offset = arch in _NORM_OFFSET_ARCHITECTURES
    plan = _plan(reader, config, source, arch)
    shapes = config.expected_shapes()

    weights: dict[str, torch.Tensor] = {}
    bar = tqdm(
        plan,
        desc=f"dequantize {path.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )
    for hf_name, tensor in bar:
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, NotImplementedError) as exc:
            raise CheckpointError(f"{source}: cannot dequantize tensor {tensor.name!r}: {exc}") from None
        values = np.asarray(values, dtype=np.float32).reshape(shapes[hf_name])  # GGUF [in, out] -> HF [out, in]
        if permuted and layout == "neox" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads
            values = unpermute_qk(values, heads)
        if norm_offset and hf_name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        # Copy out of the memory map: the checkpoint must not keep the file open or be read-only.
        weights[hf_name] = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
        problem = non_finite(weights[hf_name])
        if problem is not None:
            raise CheckpointError(
                f"{source}: tensor {tensor.name!r} ({hf_name}) holds {problem}: a checkpoint's weights must be finite"
            )
    checkpoint = Checkpoint(config, weights, source, fingerprint_of(config, weights_digest(weights)))
    return checkpoint, hf


def read_gguf_config(path: str | os.PathLike, *, layout: str = "neox") -> ModelConfig:
    """The validated :class:`ModelConfig` of the GGUF file at ``path`` from its metadata; no tensor is
    dequantized (opening the file still parses its vocabulary: seconds for a real model)."""
    return config_from_reader(open_gguf(path), path, layout=layout)[0]


def config_from_reader(
    reader: GGUFReader, path: str | os.PathLike, *, layout: str = "neox"
) -> tuple[ModelConfig, dict[str, Any]]:
    """The validated config of an open reader, and the transformers config dict it was built from."""
    source = str(Path(path))
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; supported: {', '.join(LAYOUTS)}")
    hf = hf_config_from_gguf(reader, source)
    arch = next(a for a, c in _HF_CLASS.items() if c == hf["architectures"][0])
    if layout == "gptj" and arch not in _PERMUTED_ARCHITECTURES:
        raise ConfigError(
            f"{source}: a {arch} GGUF stores Q/K for the neox pairing (llama.cpp runs it with NEOX rope); "
            "only layout='neox' describes it"
        )
    return read_model_config(hf, source=source, layout=layout), hf


def _plan(reader: GGUFReader, config: ModelConfig, source: str, arch: str) -> list[tuple[str, Any]]:
    """``(hf_name, reader_tensor)`` pairs after checking names, types and declared shapes.

    Shapes are checked against the config before anything is dequantized, so a file cannot make us
    allocate more than its config says the model holds.
    """
    expected = config.expected_shapes()
    plan, problems = [], []
    for t in reader.tensors:
        hf_name = hf_tensor_name(t.name, arch)
        if hf_name is None or hf_name not in expected:
            problems.append(f"unexpected tensor {t.name!r}")
            continue
        if t.tensor_type not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{source}: tensor {t.name!r} has unsupported type {t.tensor_type.name}; "
                f"supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))}"
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if shape != expected[hf_name]:
            problems.append(f"tensor {t.name!r} has shape {shape}, config needs {expected[hf_name]}")
        plan.append((hf_name, t))
    missing = sorted(set(expected) - {name for name, _ in plan})
    if missing:
        problems.append(
            f"missing tensor(s) for {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems[:8]))
    return plan


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The transformers name of a GGUF tensor of architecture ``arch``
    (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{int(m.group(1))}.{names[m.group(2)]}.{m.group(3)}"


def file_sha256(path: str | os.PathLike, chunk_size: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()
