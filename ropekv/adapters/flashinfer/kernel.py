"""The two paged-cache operations the FlashInfer check drives, and FlashInfer's implementation of them.

:class:`PagedKernel` is what :mod:`~ropekv.adapters.flashinfer.driver` calls: ``append`` (FlashInfer's
``append_paged_kv_cache``) and ``decode`` (``BatchDecodeWithPagedKVCacheWrapper`` with
``pos_encoding_mode="ROPE_LLAMA"`` when ``rotate``, ``"NONE"`` otherwise, and ``return_lse``).
:class:`FlashInferKernel` runs them on a GPU (flashinfer is imported on construction, never at module
import: CI has no GPU); :class:`~ropekv.adapters.flashinfer.cpu_kernel.CpuPagedKernel` is the CPU
stand-in the tests drive through the same interface.

FlashInfer's conventions, which the stand-in reproduces (read from flashinfer-python 0.2.14.post1,
``include/flashinfer/attention/decode.cuh`` and ``pos_enc.cuh``):

- with ROPE_LLAMA the kernel rotates the query by ``kv_len - 1`` and the key at index ``i`` of the
  request's KV sequence by ``i`` (rotate-half pairing, ``inv_freq[m] = theta ** (-2m / head_dim)``
  computed in float32 with fast-math ``__powf`` / ``__sincosf``);
- the returned log-sum-exp is base 2 (``log2(sum_j exp(s_j))``), in float32;
- the output has the query's dtype.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from ...errors import EngineUnavailable, UsageError
from .pages import PageTable


class PagedKernel(Protocol):
    """Append to and decode from a paged cache of ``[P, page_size, KVH, D]`` key and value pages."""

    name: str
    version: str

    def append(
        self,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        table: PageTable,
        batch: torch.Tensor,
        index: torch.Tensor,
    ) -> None:
        """Write ``k``, ``v [n, KVH, D]`` at entry ``index[i]`` of request ``batch[i]`` (``[n]`` each) of
        ``table`` (which describes the requests after the append), in place."""

    def decode(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        table: PageTable,
        *,
        rotate: bool,
        sm_scale: float,
        rope_theta: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One query row per request, ``q [B, H, D]``: the attention output ``[B, H, D]`` (q's dtype) and the
        base-2 log-sum-exp of the scaled scores ``[B, H]`` (float32)."""


class FlashInferKernel:
    """:class:`PagedKernel` on FlashInfer (GPU). :meth:`build` JIT-compiles the modules the check needs."""

    def __init__(self, device: str = "cuda", workspace_mib: int = 256):
        try:
            import flashinfer
            from flashinfer import decode as fi_decode
            from flashinfer import page as fi_page
        except ImportError as exc:
            raise EngineUnavailable(f"flashinfer is not installed here: {exc}") from None
        if not torch.cuda.is_available():
            raise EngineUnavailable("FlashInfer needs a CUDA GPU; torch sees none")
        self._fi: Any = flashinfer
        self._decode_mod: Any = fi_decode
        self._page_mod: Any = fi_page
        self.device = device
        self.version = str(getattr(flashinfer, "__version__", "unknown"))
        self.name = f"FlashInfer {self.version}"
        self._workspace = torch.empty(workspace_mib * 1024 * 1024, dtype=torch.uint8, device=device)

    def build(self, dtype: torch.dtype, head_dim: int, rotate: bool) -> float:
        """JIT-compile (ninja, under FlashInfer's file lock) the decode module for ``dtype``/``head_dim`` and
        the rotation mode, without loading it; returns the seconds it took. Several may run in threads
        at once; loading (:meth:`load`) registers torch ops and is done afterwards, one at a time."""
        from flashinfer.jit.attention import gen_batch_decode_module

        t0 = time.perf_counter()
        gen_batch_decode_module(*self._decode_args(dtype, head_dim, rotate)).build(verbose=False)
        return time.perf_counter() - t0

    def build_page(self) -> float:
        t0 = time.perf_counter()
        self._page_mod.gen_page_module().build(verbose=False)
        return time.perf_counter() - t0

    def load(self, dtype: torch.dtype, head_dim: int, rotate: bool) -> None:
        """Load a built decode module (and the page module) as FlashInfer's wrappers will ask for them."""
        self._decode_mod.get_batch_decode_module(*self._decode_args(dtype, head_dim, rotate))
        self._page_mod.get_page_module()

    @staticmethod
    def _decode_args(dtype: torch.dtype, head_dim: int, rotate: bool) -> tuple[object, ...]:
        # q, kv, out and index dtypes, head dims, PosEncodingMode (1 ROPE_LLAMA, 0 NONE), no window, no cap
        return (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 1 if rotate else 0, False, False)

    def append(
        self,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        table: PageTable,
        batch: torch.Tensor,
        index: torch.Tensor,
    ) -> None:
        self._page_mod.append_paged_kv_cache(
            k.contiguous(),
            v.contiguous(),
            batch.to(torch.int32),
            index.to(torch.int32),
            (k_pages, v_pages),
            table.indices,
            table.indptr,
            table.last_len,
            kv_layout="NHD",
        )

    def decode(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        table: PageTable,
        *,
        rotate: bool,
        sm_scale: float,
        rope_theta: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype != k_pages.dtype:
            raise UsageError(f"the decode query ({q.dtype}) and the cache ({k_pages.dtype}) must share a dtype")
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        wrapper.plan(
            table.indptr,
            table.indices,
            table.last_len,
            q.shape[1],
            k_pages.shape[2],
            q.shape[2],
            table.page_size,
            pos_encoding_mode="ROPE_LLAMA" if rotate else "NONE",
            q_data_type=q.dtype,
            kv_data_type=k_pages.dtype,
            sm_scale=sm_scale,
            rope_theta=rope_theta,
        )
        out, lse = wrapper.run(q.contiguous(), (k_pages, v_pages), return_lse=True)
        return out, lse
