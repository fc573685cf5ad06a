"""An all-float32 GGUF of a (quantized) GGUF file, for llama.cpp: the default model as llama.cpp runs it.

Why: with Q4_1 weights ggml quantizes activations to 8-bit blocks before every quantized matmul, so a
one-ulp change anywhere (batched vs one-by-one evaluation, f16 vs f32 KV) flips roundings and moves
the logits by 0.4 to 1.2: a logits-only RoPE check drowns in that noise. The same weights written as
float32 (an exact dequantization: every Q4_1 block is ``d * q + m``, representable in float32) run
through ggml's float32 kernels, and a RoPE error stands out by orders of magnitude (docs/engines/llamacpp.md).

The tensors keep the file's own row order, so llama.cpp's Q/K permutation for the llama arch (rows of
each head interleaved for its "NORM" RoPE pairing, see :mod:`ropekv.models.gguf_file`) is preserved
as is: llama.cpp loads the new file exactly as it loads the original, and
``load_gguf(f32_path, layout="gptj")`` gives the weights it runs. Every metadata entry (tokenizer
included) is copied; ``general.file_type`` becomes ALL_F32.

The default model's file is converted once into the user cache, next to the float32 safetensors
folder (:func:`default_f32_gguf`); the file name carries the conversion version and the source size,
and the file is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from ...errors import CheckpointError, UsageError
from ...models.gguf_file import file_sha256, open_gguf

CONVERSION_VERSION = "1"
_FILE_TYPE_ALL_F32 = 0  # llama_ftype LLAMA_FTYPE_ALL_F32
_SKIP_KEYS = ("general.architecture", "general.file_type", "general.quantization_version")


def convert_to_f32(source: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Write ``source`` (any GGUF whose tensor types gguf-py dequantizes) to ``dest`` with every tensor
    as float32 and every metadata entry copied. Written to a temporary sibling, then renamed."""
    source, dest = Path(source), Path(dest)
    reader = open_gguf(source)  # CheckpointError for a bad file
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise CheckpointError(f"{source}: no general.architecture metadata")
    arch = str(arch_field.contents())
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = GGUFWriter(tmp, arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in _SKIP_KEYS:
                continue
            vtype = GGUFValueType(field.types[0])
            sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub)
        writer.add_uint32("general.file_type", _FILE_TYPE_ALL_F32)
        for t in reader.tensors:
            try:
                values = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
            except (ValueError, NotImplementedError) as exc:
                raise CheckpointError(f"{source}: cannot dequantize tensor {t.name!r}: {exc}") from None
            # values: numpy order (innermost GGUF dim last); the writer stores the dims reversed again.
            writer.add_tensor(t.name, np.ascontiguousarray(values, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def default_f32_gguf(model: str | os.PathLike | None = None) -> Path:
    """``model`` as an all-float32 GGUF in the user cache, converted once (seconds to a minute).

    ``model``: None, the embedded default model; a GGUF file's path; or an embedded model's name
    (:func:`source_gguf`). The default keeps its cache name; any other source is cached under its
    stem, size and the first 16 hex digits of its sha256, so two files never share a conversion."""
    from ...models.default import cache_dir  # local: the default model is optional

    source = source_gguf(model)
    size = source.stat().st_size
    if model is None:
        dest = cache_dir().parent / f"{cache_dir().name}.f32.v{CONVERSION_VERSION}.{size}.gguf"
    else:
        digest = file_sha256(source)[:16]
        dest = cache_dir().parent / f"{source.stem}.f32.v{CONVERSION_VERSION}.{size}.{digest}.gguf"
    if not dest.is_file():
        print(
            f"ropekv: writing {source.name} as an all-float32 GGUF for llama.cpp in {dest.parent} (once)",
            file=sys.stderr,
        )
        convert_to_f32(source, dest)
    return dest


def source_gguf(model: str | os.PathLike | None) -> Path:
    """The GGUF file ``model`` names: None, the embedded default's; an embedded model's name, its
    original GGUF; an existing path, itself."""
    from ...models import resolve_gguf

    path = resolve_gguf(None if model is None else str(model))
    if path.is_file():
        return path
    if path.suffix == ".gguf" or os.sep in str(model):
        raise CheckpointError(f"{path}: no such GGUF file")
    raise UsageError(f"{str(model)!r} is neither a GGUF file nor an embedded model's name (`ropekv models`)")
