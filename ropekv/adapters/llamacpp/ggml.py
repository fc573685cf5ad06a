"""Just enough of ggml's tensor struct, in ctypes, to read (and, for fault injection, write) the tensors
llama.cpp hands to its eval callback.

``struct ggml_tensor`` (ggml/include/ggml.h, GGML_MAX_DIMS 4, GGML_MAX_SRC 10, GGML_MAX_OP_PARAMS 64,
GGML_MAX_NAME 64) is declared here field by field; :func:`check_layout` compares ``sizeof`` with
``ggml_tensor_overhead``'s view of it at start-up, so a llama.cpp whose struct changed is refused
instead of read wrongly. ``ne``/``nb`` are innermost-first (``ne[0]`` is the row length), so a tensor
``ne = [D, H, T]`` reads as a numpy array ``[T, H, D]``. Tensors live in host memory on the CPU
backend, so their bytes are read in place from ``data`` with the strides ``nb`` (views included).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64
# enum ggml_type values of the types read here (ggml.h; the same in llama_cpp.GGML_TYPE_*).
TYPE_F32, TYPE_F16, TYPE_I32, TYPE_I64 = 0, 1, 26, 27
_NUMPY = {TYPE_F32: np.float32, TYPE_F16: np.float16, TYPE_I32: np.int32, TYPE_I64: np.int64}


class GgmlTensor(ctypes.Structure):
    pass


GgmlTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
    ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GgmlTensor) * GGML_MAX_SRC),
    ("view_src", ctypes.POINTER(GgmlTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * GGML_MAX_NAME),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


class Ggml:
    """ggml's own helpers from the libggml-base shared library that llama-cpp-python ships."""

    def __init__(self, lib_dir: Path):
        candidates = sorted(lib_dir.glob("libggml-base.*"))
        if not candidates:
            raise OSError(f"no libggml-base shared library in {lib_dir}")
        self.lib = ctypes.CDLL(str(candidates[0]))
        self.lib.ggml_op_name.restype = ctypes.c_char_p
        self.lib.ggml_op_name.argtypes = [ctypes.c_int]
        self.lib.ggml_tensor_overhead.restype = ctypes.c_size_t
        self.lib.ggml_nbytes.restype = ctypes.c_size_t
        self.lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
        self._op_names: dict[int, str] = {}

    def op_name(self, op: int) -> str:
        """``ggml_op_name`` ("ROPE", "MUL_MAT", "SET_ROWS", ...), memoized per op id."""
        name = self._op_names.get(op)
        if name is None:
            name = self._op_names[op] = self.lib.ggml_op_name(op).decode()
        return name

    def check_layout(self) -> None:
        """Refuse a ggml whose tensor struct is not the one declared here. ``ggml_tensor_overhead`` is
        ``GGML_OBJECT_SIZE + GGML_TENSOR_SIZE`` and ``struct ggml_object`` is 32 bytes on 64-bit."""
        overhead = int(self.lib.ggml_tensor_overhead())
        if overhead - 32 != ctypes.sizeof(GgmlTensor):
            raise OSError(
                f"ggml_tensor is {overhead - 32} bytes in this llama.cpp, {ctypes.sizeof(GgmlTensor)} "
                "in ropekv's ctypes declaration: the engine's struct changed"
            )


def tensor_at(address: int) -> GgmlTensor:
    return GgmlTensor.from_address(address)


def name_of(t: GgmlTensor) -> str:
    return t.name.decode(errors="replace")


def src(t: GgmlTensor, i: int) -> GgmlTensor | None:
    p = t.src[i]
    return p.contents if p else None


def operand(t: GgmlTensor, i: int) -> GgmlTensor:
    """``src(t, i)`` of a node whose op always has it (a ROPE's input and positions, a SET_ROWS' rows)."""
    p = src(t, i)
    if p is None:
        raise RuntimeError(f"llama.cpp graph: node {name_of(t)!r} has no source {i}")
    return p


def view_source(t: GgmlTensor) -> GgmlTensor | None:
    return t.view_src.contents if t.view_src else None


def read(t: GgmlTensor, ndim: int) -> np.ndarray:
    """A copy of ``t``'s elements as numpy with ggml's first ``ndim`` dims reversed (``ne = [D, H, T]``
    -> ``[T, H, D]``); the dims beyond ``ndim`` must be 1. float16 comes back as float32."""
    ne = [int(t.ne[i]) for i in range(GGML_MAX_DIMS)]
    if any(n != 1 for n in ne[ndim:]):
        raise ValueError(f"ggml tensor {name_of(t)!r} has ne={ne}, expected {ndim} dims")
    arr = _view(t)
    out = np.array(arr, dtype=np.float32 if t.type == TYPE_F16 else arr.dtype, copy=True)
    return out.reshape(tuple(reversed(ne[:ndim])))


def write(t: GgmlTensor, values: np.ndarray) -> None:
    """Overwrite ``t``'s elements in place (fault injection); ``values`` in :func:`read`'s order."""
    arr = _view(t)
    arr[...] = np.asarray(values).reshape(arr.shape).astype(arr.dtype)


def _view(t: GgmlTensor) -> np.ndarray:
    """A writable numpy view of ``t``'s bytes, ``[ne3, ne2, ne1, ne0]`` with ggml's strides."""
    dtype = _NUMPY.get(int(t.type))
    if dtype is None:
        raise TypeError(f"ggml tensor {name_of(t)!r} has type {t.type}; only f32, f16, i32, i64 are read")
    ne = [int(t.ne[i]) for i in range(GGML_MAX_DIMS)]
    nb = [int(t.nb[i]) for i in range(GGML_MAX_DIMS)]
    span = sum((n - 1) * s for n, s in zip(ne, nb)) + np.dtype(dtype).itemsize
    buf = (ctypes.c_char * span).from_address(int(t.data))
    return np.ndarray(shape=tuple(reversed(ne)), dtype=dtype, buffer=memoryview(buf), strides=tuple(reversed(nb)))
