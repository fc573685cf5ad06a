"""The eval callback of one llama.cpp context: what the attention kernels saw, and where every cached
key sits, read from llama.cpp's own graph.

llama.cpp calls ``cb_eval(tensor, ask, user_data)`` for every node of every graph it computes: first
with ``ask=True`` (return True to observe the node), then, once the node is computed, with
``ask=False``. The named nodes used here (llama arch, flash attention off; src/models/llama.cpp,
src/llama-graph.cpp, src/llama-kv-cache.cpp):

- ``Qcur-N`` / ``Kcur-N`` with op ROPE: query / new keys after RoPE ``ne [D, H, T]``; their ``src[0]`` is
  the same before RoPE, their ``src[1]`` the positions of the batch (``inp_pos``, int32 ``[T]``);
- SET_ROWS into ``cache_k_l0`` (the node is a view of the cache): ``src[1]`` holds the cache cells
  (int64 ``[T]``) the new keys of the batch go to, ``src[0]`` a view of ``Kcur-0``. Cells and ``inp_pos`` give the cell -> position map:
  positions come from llama.cpp's batch, never from a cell index;
- ``kq-N`` (MUL_MAT): ``q . k`` before scaling and masking, ``[H, T, n_kv]``; its ``src[0]`` is the view
  of the K cache the kernel multiplied (``[KVH, n_kv, D]`` after the permute), so the keys are the
  cache's bytes as the kernel read them (f16 in an f16 cache);
- ``kq_soft_max-N``: ``src[1]`` is the mask ``[T_pad, n_kv]`` (0 visible, -inf not);
- ``embd`` (GET_ROWS) and ``l_out-N``: the residual stream entering layer 0 and layer N + 1;
- the ``op_params`` of ``Kcur-0``'s ROPE: the RoPE arguments the context runs (:class:`RopeRun`);
- the K-shift graph (``llama_memory_seq_add`` then the next decode): one in-place ROPE per layer over a
  view of ``cache_k_lN`` with ``src[1]`` = the per-cell shift (int32 ``[kv_size]``); the map moves by it.

A :class:`ShiftFault` can be handed in to corrupt the K-shift in the running process (tests only).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from . import ggml
from .ggml import GgmlTensor
from .rope_params import RopeRun

_KEY_ROPE = re.compile(r"^Kcur-(\d+)$")
_LAYER_NAME = re.compile(r"^(Qcur_normed|Qcur|Kcur|Vcur|kq|kq_soft_max|l_out)-(\d+)$")
_CACHE_K = re.compile(r"^cache_k_l(\d+)$")  # one per layer, in whichever cache holds the layer

ShiftFaultKind = Literal["not_rerotated", "rerotated_twice"]


@dataclass(frozen=True)
class ShiftFault:
    """A corrupted K-shift: ``not_rerotated`` restores the cache bytes the shift's RoPE rewrote (positions
    move, keys keep their old rotation); ``rerotated_twice`` applies the shift's rotation a second time
    (positions move once, keys turn twice). Interleaved ("NORM") pairs, as llama.cpp rotates llama."""

    kind: ShiftFaultKind
    freq_base: float
    rotary_dim: int

    def apply(self, before: np.ndarray, after: np.ndarray, shift: np.ndarray) -> np.ndarray:
        """``before``/``after``: the cache view ``[cells, KVH, rotary_dim]`` around the real shift;
        ``shift``: ``[cells]``. Returns what the cache should hold instead of ``after``."""
        if self.kind == "not_rerotated":
            return before
        half = self.rotary_dim // 2
        theta = shift.astype(np.float64)[:, None] * self.freq_base ** (-2.0 * np.arange(half) / self.rotary_dim)
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        x = after.astype(np.float64)
        a, b = x[..., 0 : self.rotary_dim : 2], x[..., 1 : self.rotary_dim : 2]
        out = x.copy()
        out[..., 0 : self.rotary_dim : 2] = a * cos - b * sin
        out[..., 1 : self.rotary_dim : 2] = a * sin + b * cos
        return out


@dataclass
class Capture:
    """What one recorded graph computation saw, per layer (numpy, ggml dims reversed)."""

    q: dict[int, np.ndarray] = field(default_factory=dict)  # [T, H, D] after RoPE
    q_raw: dict[int, np.ndarray] = field(default_factory=dict)  # [T, H, D] before RoPE
    k_new: dict[int, np.ndarray] = field(default_factory=dict)  # [T, KVH, D] the batch's keys after RoPE
    k_new_raw: dict[int, np.ndarray] = field(default_factory=dict)  # [T, KVH, D] before RoPE
    v_new: dict[int, np.ndarray] = field(default_factory=dict)  # [T, KVH, D]
    k_cache: dict[int, np.ndarray] = field(default_factory=dict)  # [n_kv, KVH, D] the keys the kernel read
    kq: dict[int, np.ndarray] = field(default_factory=dict)  # [H, T, n_kv] the kernel's q.k (unscaled)
    mask: np.ndarray | None = None  # [T_pad, n_kv] layer 0's mask: 0 visible, -inf not
    masks: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> its mask (one array per mask tensor)
    positions: np.ndarray | None = None  # [T] the batch's inp_pos
    hidden: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [T, hidden] its input


class GraphTap:
    """Observes a llama.cpp context's graphs. ``cells`` (cell -> position) is always kept up to date;
    tensors are captured only while :attr:`recording` is set. Keep this object alive as long as the
    context: it owns the C callback llama.cpp calls."""

    def __init__(self, lib: ggml.Ggml, num_layers: int):
        self.lib = lib
        self.num_layers = num_layers
        # layer -> (cell -> position) of that layer's K cache. One map per layer, not one per model: a
        # model with sliding layers (gemma3) has two caches (llama_kv_cache_iswa), whose cells differ.
        self.layer_cells: dict[int, dict[int, int]] = {i: {} for i in range(num_layers)}
        self.recording = False
        self.capture = Capture()
        self.fault: ShiftFault | None = None
        self.shifts_seen = 0  # K-shift graphs observed (one per applied llama_memory_seq_add batch)
        self.rope_run: RopeRun | None = None  # the arguments of the latest graph's layer-0 key RoPE
        # layer -> the arguments of its key RoPE in the latest graph: gemma3's sliding and global layers
        # turn with different bases (a context's rope_freq_base reaches the global layers only).
        self.rope_runs: dict[int, RopeRun] = {}
        self.error: Exception | None = None
        self.rows: list[int] | None = None
        self.keep_scores = False
        self._before: dict[int, np.ndarray] = {}
        self._masks_read: dict[int, np.ndarray] = {}  # mask tensor data address -> its array, this capture
        import llama_cpp  # local: this module is imported only where the engine is installed

        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._eval)

    @property
    def cells(self) -> dict[int, int]:
        """Layer 0's cell -> position map."""
        return self.layer_cells[0]

    def reset(self) -> None:
        """After ``llama_memory_clear``: no cell holds a key."""
        for cells in self.layer_cells.values():
            cells.clear()

    def forget_from(self, position: int) -> None:
        """After ``llama_memory_seq_rm(seq 0, position, -1)``: cells at ``position`` and later are empty."""
        for cells in self.layer_cells.values():
            for cell, pos in list(cells.items()):
                if pos >= position:
                    del cells[cell]

    def start(self, rows: list[int] | None = None, *, keep_scores: bool = False) -> None:
        """Record the next graph computations; ``rows``: keep only these batch rows of q and the layer
        inputs (a full forward); ``keep_scores``: keep the kernel's ``kq`` (decode steps only: it is
        ``[H, T, n_kv]`` per layer)."""
        self.capture = Capture()
        self._masks_read = {}
        self.rows = rows
        self.keep_scores = keep_scores
        self.recording = True

    def stop(self) -> Capture:
        self.recording = False
        return self.capture

    # ------------------------------------------------------------------ the callback

    def _eval(self, address: int, ask: bool, _user: int) -> bool:
        try:
            return self._handle(ggml.tensor_at(address), ask)
        except Exception as exc:  # must not cross into C: stop the graph; the adapter raises it afterwards
            self.error = exc
            return False

    def _handle(self, t: GgmlTensor, ask: bool) -> bool:
        op = self.lib.op_name(t.op)
        name = ggml.name_of(t)
        if op == "SET_ROWS":
            dest = ggml.view_source(t)
            written = _CACHE_K.match(ggml.name_of(dest)) if dest is not None else None
            if written is None:
                return False
            if not ask:
                self._track_writes(t, int(written.group(1)))
            return True
        if op == "ROPE":
            key_layer = _KEY_ROPE.match(name) if ask else None
            if key_layer is not None:  # what this context turns each layer's keys with, as its graph says
                run = RopeRun.from_op_params(list(t.op_params))
                self.rope_runs[int(key_layer.group(1))] = run
                if name == "Kcur-0":
                    self.rope_run = run
            base = ggml.src(t, 0)
            cache = ggml.view_source(base) if base is not None else None
            if base is not None and cache is not None and ggml.name_of(cache).startswith("cache_k_l"):
                return self._shift(t, base, ggml.name_of(cache), ask)
        if not self.recording:
            return False
        if name in ("embd", "inp_scaled"):  # inp_scaled: gemma's embeddings times sqrt(hidden), layer 0's input
            if not ask:
                self.capture.hidden[0] = self._rows(ggml.read(t, 2))
            return True
        m = _LAYER_NAME.match(name)
        if m is None:
            return False
        kind, layer = m.group(1), int(m.group(2))
        if kind in ("Qcur", "Kcur") and op != "ROPE":
            return False
        if kind == "l_out" and layer + 1 >= self.num_layers:
            return False
        if ask:
            return True
        cap = self.capture
        if kind == "Qcur_normed":  # gemma3: read before the ROPE node, which may overwrite it in place
            cap.q_raw[layer] = self._rows(ggml.read(t, 3))
        elif kind == "Qcur":
            cap.q[layer] = self._rows(ggml.read(t, 3))
            if layer not in cap.q_raw:
                cap.q_raw[layer] = self._rows(ggml.read(ggml.operand(t, 0), 3))
            cap.positions = ggml.read(ggml.operand(t, 1), 1).astype(np.int64)
        elif kind == "Kcur":
            cap.k_new[layer], cap.k_new_raw[layer] = ggml.read(t, 3), ggml.read(ggml.operand(t, 0), 3)
        elif kind == "Vcur":
            cap.v_new[layer] = ggml.read(t, 3)
        elif kind == "kq":
            if self.keep_scores:
                cap.kq[layer] = ggml.read(t, 3)
            cap.k_cache[layer] = ggml.read(ggml.operand(t, 0), 3).transpose(1, 0, 2)  # [KVH, n_kv, D] -> [n_kv, KVH, D]
        elif kind == "kq_soft_max":
            mask = ggml.operand(t, 1)  # full and sliding layers read different mask tensors; read each once
            seen = self._masks_read.get(int(mask.data or 0))
            cap.masks[layer] = seen if seen is not None else ggml.read(mask, 2)
            self._masks_read[int(mask.data or 0)] = cap.masks[layer]
            if layer == 0:
                cap.mask = cap.masks[0]
        elif kind == "l_out":
            cap.hidden[layer + 1] = self._rows(ggml.read(t, 2))
        return True

    def _rows(self, x: np.ndarray) -> np.ndarray:
        return x if self.rows is None else x[self.rows]

    def _track_writes(self, t: GgmlTensor, layer: int) -> None:
        """The batch's keys (``src[0]``, a view of ``Kcur-N``) went to layer N's cells ``src[1]``; their
        positions are ``Kcur-N``'s ``inp_pos``."""
        idxs = ggml.read(ggml.operand(t, 1), 1).astype(np.int64)
        k_view = ggml.src(t, 0)
        rope = ggml.view_source(k_view) if k_view is not None else None
        if rope is None or self.lib.op_name(rope.op) != "ROPE":
            raise RuntimeError("llama.cpp graph: the K-cache write does not come from a RoPE node")
        positions = ggml.read(ggml.operand(rope, 1), 1).astype(np.int64)
        if positions.shape != idxs.shape:
            raise RuntimeError(f"llama.cpp graph: {idxs.shape[0]} cache cells for {positions.shape[0]} positions")
        cells = self.layer_cells[layer]
        for cell, pos in zip(idxs.tolist(), positions.tolist()):
            cells[cell] = pos

    def _shift(self, t: GgmlTensor, view: GgmlTensor, cache_name: str, ask: bool) -> bool:
        """One layer of the K-shift graph: move the map (once, at layer 0) and apply a fault if set."""
        layer = int(cache_name.rsplit("l", 1)[1])
        if ask:
            if self.fault is not None:
                self._before[layer] = ggml.read(view, 3)
            return True
        shift = ggml.read(ggml.operand(t, 1), 1).astype(np.int64)
        if layer == 0:
            self.shifts_seen += 1
        cells = self.layer_cells[layer]
        for cell in list(cells):
            if cell < shift.shape[0]:
                cells[cell] += int(shift[cell])
        if self.fault is not None:
            after = ggml.read(view, 3)
            ggml.write(view, self.fault.apply(self._before.pop(layer), after, shift[: after.shape[0]]))
        return True


def visible_cells(mask_row: np.ndarray) -> np.ndarray:
    """Cells a query row attends to: mask entries that are finite (0), int64 ``[N]``."""
    return np.flatnonzero(np.isfinite(mask_row) & (mask_row > -math.inf))
