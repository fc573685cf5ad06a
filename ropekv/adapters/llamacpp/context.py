"""A llama.cpp context driven through the low-level API with explicit positions, with a :class:`GraphTap`.

llama-cpp-python's ``Llama`` takes no eval callback, so the white box is a second context on the same
loaded model (``llama_cpp._internals.LlamaContext(model=llm._model, params=p)`` with ``p.cb_eval``).
Batches are built with ``llama_batch_init``: every token's position is set explicitly, as the caller
says, and llama.cpp's own graph input (``inp_pos``) is what the tap reads back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import AdapterError
from .rope_params import RopeOverrides
from .tap import GraphTap


@dataclass(frozen=True)
class ContextSpec:
    n_ctx: int
    n_batch: int  # logical = physical batch (n_ubatch): a longer prompt is split by llama.cpp
    type_k: int  # GGML_TYPE_F32 / GGML_TYPE_F16 / ...
    type_v: int
    n_threads: int
    rope: RopeOverrides = field(default_factory=RopeOverrides)  # the context's RoPE settings (None: the model's)
    # A model with sliding layers: True (llama.cpp's default) sizes their cache at n_ctx cells; False at
    # the window plus one ubatch, cells reused as the window moves (llama_kv_cache_iswa).
    swa_full: bool = True


class TappedContext:
    """One llama.cpp context on ``model`` (a ``llama_cpp._internals.LlamaModel``), observed by ``tap``."""

    def __init__(self, model, spec: ContextSpec, tap: GraphTap, adapter_name: str):
        import llama_cpp
        from llama_cpp._internals import LlamaContext

        self._llama = llama_cpp
        self.spec, self.tap, self.adapter_name = spec, tap, adapter_name
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = spec.n_ctx, spec.n_batch, spec.n_batch, 1
        p.n_threads = p.n_threads_batch = spec.n_threads
        p.type_k, p.type_v = spec.type_k, spec.type_v
        spec.rope.apply(p)
        p.swa_full = spec.swa_full
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # kq-N exists only without it
        p.cb_eval = tap.callback
        p.cb_eval_user_data = None
        p.no_perf = True
        self._params = p  # keeps the callback's owner reachable from the context's lifetime
        self._ctx = LlamaContext(model=model, params=p, verbose=False)
        self.ctx = self._ctx.ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model.model))

    def clear(self) -> None:
        """Empty the KV cache (a new request with nothing cached)."""
        self._llama.llama_memory_clear(self.memory, True)
        self.tap.reset()

    def remove_from(self, position: int) -> None:
        """Drop sequence 0's cached tokens at positions ``>= position`` (``llama_memory_seq_rm``)."""
        if not self._llama.llama_memory_seq_rm(self.memory, 0, position, -1):
            raise AdapterError(self.adapter_name, "llama_memory_seq_rm", "true", "false")
        self.tap.forget_from(position)

    def decode(self, tokens: list[int], positions: list[int], outputs: list[bool]) -> None:
        """One ``llama_decode`` of ``tokens`` at ``positions`` (sequence 0); ``outputs`` flags the rows
        whose logits are kept. At most ``n_batch`` tokens (llama.cpp's logical batch)."""
        n = len(tokens)
        if not 0 < n <= self.spec.n_batch or len(positions) != n or len(outputs) != n:
            raise ValueError(
                f"decode: {n} tokens, {len(positions)} positions, {len(outputs)} flags, n_batch {self.spec.n_batch}"
            )
        lib = self._llama
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i in range(n):
                batch.token[i] = int(tokens[i])
                batch.pos[i] = int(positions[i])
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = bool(outputs[i])
            self.tap.error = None
            rc = lib.llama_decode(self.ctx, batch)
        finally:
            lib.llama_batch_free(batch)
        if self.tap.error is not None:
            raise AdapterError(
                self.adapter_name, "eval callback", "no error", f"{type(self.tap.error).__name__}: {self.tap.error}"
            )
        if rc != 0:
            raise AdapterError(self.adapter_name, "llama_decode", "0", str(rc))

    def prefill(self, tokens: list[int], start: int) -> None:
        """``tokens`` at positions ``start, start + 1, ...`` in pieces of ``n_batch``."""
        step = self.spec.n_batch
        for i in range(0, len(tokens), step):
            piece = tokens[i : i + step]
            self.decode(piece, list(range(start + i, start + i + len(piece))), [False] * (len(piece) - 1) + [True])

    def logits(self, row: int) -> np.ndarray:
        """``[vocab]`` float32 logits of batch row ``row`` of the last decode (it must have been flagged)."""
        ptr = self._llama.llama_get_logits_ith(self.ctx, row)
        if not ptr:
            raise AdapterError(self.adapter_name, "llama_get_logits_ith", f"logits for row {row}", "NULL")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def shift(self, p0: int, p1: int, delta: int) -> None:
        """``llama_memory_seq_add(seq 0, [p0, p1), delta)``; applied (keys re-rotated) at the next decode."""
        if not self._llama.llama_memory_can_shift(self.memory):
            raise AdapterError(self.adapter_name, "llama_memory_can_shift", "true", "false")
        self._llama.llama_memory_seq_add(self.memory, 0, p0, p1, delta)

    def position_range(self) -> tuple[int, int]:
        """``(llama_memory_seq_pos_min, llama_memory_seq_pos_max)`` of sequence 0 (-1, -1 when empty)."""
        return (
            int(self._llama.llama_memory_seq_pos_min(self.memory, 0)),
            int(self._llama.llama_memory_seq_pos_max(self.memory, 0)),
        )
