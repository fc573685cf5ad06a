"""A batch of requests over a paged KV cache, in FlashInfer's terms (its "page table").

Request ``b`` reads the pages ``indices[indptr[b]:indptr[b + 1]]`` in order; its last page holds
``last_len[b]`` entries (1..page_size). The entry at index ``i`` of a request's KV sequence lives in
page ``indices[indptr[b] + i // page_size]``, slot ``i % page_size``. FlashInfer's in-kernel RoPE
rotates that entry by ``i``: the index in the request's sequence, never a logical position the cache
could carry (docs/engines/flashinfer.md).

Page tensors are ``[num_pages, page_size, num_kv_heads, head_dim]`` (FlashInfer's "NHD" layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...errors import UsageError

MAX_PAGE_SIZE = 1024  # FlashInfer's decode kernel takes any page size; 1024 bounds what a bundle may ask


@dataclass(frozen=True, eq=False)
class PageTable:
    """Which pages each request of a batch reads, and how full its last page is."""

    indptr: torch.Tensor  # [B + 1] int32
    indices: torch.Tensor  # [indptr[-1]] int32 page numbers
    last_len: torch.Tensor  # [B] int32, 1..page_size
    page_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool):
            raise UsageError(f"page_size must be an integer, got {self.page_size!r}")
        if not 1 <= self.page_size <= MAX_PAGE_SIZE:
            raise UsageError(f"page_size must be in 1..{MAX_PAGE_SIZE}, got {self.page_size}")
        for name in ("indptr", "indices", "last_len"):
            t = getattr(self, name)
            if not torch.is_tensor(t) or t.dtype != torch.int32 or t.dim() != 1:
                raise UsageError(f"PageTable.{name} must be a 1-D int32 tensor, got {_shown(t)}")
        b = self.last_len.numel()
        if self.indptr.numel() != b + 1 or b == 0:
            raise UsageError(f"PageTable: indptr needs {b + 1} entries for {b} requests, got {self.indptr.numel()}")
        ptr = self.indptr.cpu()
        if int(ptr[0]) != 0 or int(ptr[-1]) != self.indices.numel() or bool((ptr[1:] <= ptr[:-1]).any()):
            raise UsageError("PageTable: indptr must start at 0, rise strictly and end at the number of indices")
        last = self.last_len.cpu()
        if bool((last < 1).any()) or bool((last > self.page_size).any()):
            raise UsageError(f"PageTable: last_len must be in 1..{self.page_size}")
        if self.indices.numel() and int(self.indices.min()) < 0:
            raise UsageError("PageTable: page numbers must be >= 0")

    @classmethod
    def of(
        cls, pages: Sequence[Sequence[int]], lengths: Sequence[int], page_size: int, device: str = "cpu"
    ) -> PageTable:
        """The table of requests reading ``pages[b]`` with ``lengths[b]`` entries each; every request must
        use exactly the pages its length needs."""
        if len(pages) != len(lengths) or not pages:
            raise UsageError(f"PageTable.of: {len(pages)} page lists for {len(lengths)} lengths")
        if not isinstance(page_size, int) or isinstance(page_size, bool) or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise UsageError(f"page_size must be an integer in 1..{MAX_PAGE_SIZE}, got {page_size!r}")
        indptr: list[int] = [0]
        indices: list[int] = []
        last: list[int] = []
        for b, (p, n) in enumerate(zip(pages, lengths)):
            if not isinstance(n, int) or n < 1:
                raise UsageError(f"PageTable.of: request {b} has length {n!r}; a request reads at least one entry")
            need = -(-n // page_size)
            if len(p) != need:
                raise UsageError(
                    f"PageTable.of: request {b} of length {n} needs {need} pages of {page_size}, got {len(p)}"
                )
            indices.extend(int(x) for x in p)
            indptr.append(len(indices))
            last.append(n - (need - 1) * page_size)

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32, device=device)

        return cls(t(indptr), t(indices), t(last), page_size)

    @property
    def batch_size(self) -> int:
        return self.last_len.numel()

    def kv_lens(self) -> torch.Tensor:
        """``[B]`` int64: entries each request reads."""
        pages = (self.indptr[1:] - self.indptr[:-1]).long()
        return (pages - 1) * self.page_size + self.last_len.long()

    def slots(self, b: int) -> torch.Tensor:
        """``[n]`` int64: the physical slot (``page * page_size + offset``) of each entry of request ``b``."""
        n = int(self.kv_lens()[b])
        i = torch.arange(n, device=self.indices.device)
        pages = self.indices[int(self.indptr[b]) :][i // self.page_size].long()
        return pages * self.page_size + i % self.page_size

    def gather(self, pages: torch.Tensor, b: int) -> torch.Tensor:
        """``[n, KVH, D]``: request ``b``'s entries of ``pages [P, page_size, KVH, D]``, in sequence order."""
        flat = pages.reshape(-1, *pages.shape[2:])
        return flat[self.slots(b)]

    def to(self, device: str | torch.device) -> PageTable:
        return PageTable(self.indptr.to(device), self.indices.to(device), self.last_len.to(device), self.page_size)


def _shown(t: object) -> str:
    if torch.is_tensor(t):
        return f"{t.dtype} tensor of shape {list(t.shape)}"
    return type(t).__name__
