"""The FlashInfer check's engine: a paged cache driven through a :class:`PagedKernel`'s append and decode.

One cached run (:func:`run_cached`, a case with no prefix hit): the prompt's rows attend to their own
fresh keys through the decode kernel (one request per row, over pages packed from the fresh keys: an
uncached computation), then the prompt's keys and values are appended to the sequence's pages; each
decode step computes the new token's q, k, v, appends k and v at the token's index and decodes its
query against the cache. The uncached forward (:func:`run_full`) is the first part alone, over the
whole sequence: the engine's own path with no cache, for self-parity.

What is recorded, per decode step and layer, is what ropekv needs to judge the run on CPU later
(:mod:`~ropekv.adapters.flashinfer.replay`): the query as handed to the kernel, the kernel's output
and log-sum-exp, the layer's input, and the kernel's log-sum-exps of the isolated-key probe
(:mod:`~ropekv.adapters.flashinfer.probe`); per layer, the keys and values read back from the pages
after the last step, with their slots (step ``s`` read the first ``length + s + 1`` of them).

:class:`Setup` says how keys are written and whether the kernel rotates: ``raw-keys`` is the contract
FlashInfer's ROPE_LLAMA mode needs (raw keys, rotation in the kernel on read); ``rotated-before-append``
writes keys the engine already rotated into that same cache (the double rotation the check must name);
``rotated-keys`` writes rotated keys and decodes with ``pos_encoding_mode="NONE"`` (a consistent
rotated-key cache, the control).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ...errors import UsageError
from .kernel import PagedKernel
from .model import LlamaLayers
from .pages import PageTable
from .probe import key_probe, probe_alpha

KeyWrite = Literal["raw", "rotated"]
MAX_PROBED_KEYS = 512  # the probe holds one page per key: bounded so a bundle cannot ask for gigabytes


@dataclass(frozen=True)
class Setup:
    """How the engine writes keys and whether the kernel rotates them when it reads."""

    name: str
    key_write: KeyWrite
    kernel_rotates: bool

    def describe(self) -> str:
        kernel = (
            "the kernel rotates on read (ROPE_LLAMA)" if self.kernel_rotates else "the kernel does not rotate (NONE)"
        )
        return f"{self.key_write} keys appended, {kernel}"


SETUPS: dict[str, Setup] = {
    s.name: s
    for s in (
        Setup("raw-keys", "raw", True),
        Setup("rotated-before-append", "rotated", True),
        Setup("rotated-keys", "rotated", False),
    )
}


def _sequence_pages(total: int, page_size: int) -> tuple[list[int], int]:
    """The sequence's page numbers, in reverse order of the pool with a spare page first, so that a slot
    is never its position (``slot = page * page_size + offset``); and the pool's size."""
    need = -(-total // page_size)
    pool = need + 2
    return [pool - 1 - i for i in range(need)], pool


def _attend_fresh(
    kernel: PagedKernel,
    model: LlamaLayers,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page_size: int,
    rotates: bool,
) -> torch.Tensor:
    """Causal attention of rows ``q [T, H, D]`` over the fresh ``k``, ``v [T, KVH, D]`` through the decode
    kernel (output ``[T, H, D]``): request ``r`` reads entries ``0..r`` of pages packed from them."""
    T, kvh, d = k.shape
    pages = -(-T // page_size)
    k_pages = torch.zeros(pages, page_size, kvh, d, dtype=k.dtype, device=k.device)
    v_pages = torch.zeros_like(k_pages)
    k_pages.view(-1, kvh, d)[:T] = k
    v_pages.view(-1, kvh, d)[:T] = v
    table = PageTable.of(
        [list(range(-(-(r + 1) // page_size))) for r in range(T)], list(range(1, T + 1)), page_size, str(k.device)
    )
    out, _ = kernel.decode(
        q,
        k_pages,
        v_pages,
        table,
        rotate=rotates,
        sm_scale=model.shapes.head_dim**-0.5,
        rope_theta=model.shapes.rope_theta,
    )
    return out


def _probe(
    kernel: PagedKernel, model: LlamaLayers, stored: torch.Tensor, page_size: int, rotates: bool
) -> dict[str, torch.Tensor]:
    """The isolated-key probe of ``stored [n, KVH, D]`` at query index ``n - 1``."""
    if stored.shape[0] > MAX_PROBED_KEYS:
        raise UsageError(f"the probe reads at most {MAX_PROBED_KEYS} keys, got {stored.shape[0]}")
    alpha = probe_alpha(stored)
    probe = key_probe(stored, page_size, model.shapes.num_heads, alpha)
    _, lse = kernel.decode(
        probe.q,
        probe.k_pages,
        probe.v_pages,
        probe.table,
        rotate=rotates,
        sm_scale=1.0,
        rope_theta=model.shapes.rope_theta,
    )
    return {"probe_lse": lse.float().cpu(), "probe_alpha": torch.tensor(alpha, dtype=torch.float64)}


def _kernel_inputs(
    model: LlamaLayers, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotates: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as handed to the kernel: raw where it rotates, rotated by the engine where it does not."""
    if rotates:
        return q, k
    return model.rotate(q, positions), model.rotate(k, positions)


def run_full(
    kernel: PagedKernel,
    model: LlamaLayers,
    embeddings: torch.Tensor,
    rows: list[int],
    page_size: int,
    setup: Setup,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The uncached forward over ``embeddings [T, hidden]`` (float32): the queries and layer inputs at
    ``rows``, every key and value as handed to the kernel, and the probe of the keys at row ``T - 1``."""
    T = embeddings.shape[0]
    if not rows or min(rows) < 0 or max(rows) >= T:
        raise UsageError(f"run_full: rows {rows} outside the {T} tokens")
    at = torch.as_tensor(rows, device=embeddings.device)
    positions = torch.arange(T, device=embeddings.device)
    h = embeddings
    rec: dict[str, torch.Tensor] = {"full.rows": at.cpu()}
    for layer in range(model.shapes.num_layers):
        rec[f"full.l{layer}.hidden_in"] = h[at].cpu()
        q, k, v = model.qkv(layer, h)
        q_in, k_in = _kernel_inputs(model, q, k, positions, setup.kernel_rotates)
        q_in, k_in, v_in = q_in.to(dtype), k_in.to(dtype), v.to(dtype)
        out = _attend_fresh(kernel, model, q_in, k_in, v_in, page_size, setup.kernel_rotates)
        rec[f"full.l{layer}.q_in"] = q_in[at].cpu()
        rec[f"full.l{layer}.k_in"] = k_in.cpu()
        rec[f"full.l{layer}.v_in"] = v_in.cpu()
        for name, t in _probe(kernel, model, k_in, page_size, setup.kernel_rotates).items():
            rec[f"full.l{layer}.{name}"] = t
        h = model.finish(layer, h, out)
    rec["full.final_hidden"] = h[at].cpu()
    return rec


def run_cached(
    kernel: PagedKernel,
    model: LlamaLayers,
    embeddings: torch.Tensor,
    length: int,
    page_size: int,
    decode_steps: int,
    setup: Setup,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Prefill ``length`` rows of ``embeddings [>= length + decode_steps, hidden]`` (float32) into a paged
    cache, then decode ``decode_steps`` tokens with probes."""
    total = length + decode_steps
    if length < 1 or decode_steps < 1 or embeddings.shape[0] < total:
        raise UsageError(f"run_cached: length {length} + {decode_steps} steps needs {total} embeddings")
    s = model.shapes
    dev = embeddings.device
    seq_pages, pool = _sequence_pages(total, page_size)
    k_cache = [
        torch.zeros(pool, page_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=dev) for _ in range(s.num_layers)
    ]
    v_cache = [torch.zeros_like(k) for k in k_cache]

    def table(n: int) -> PageTable:
        return PageTable.of([seq_pages[: -(-n // page_size)]], [n], page_size, str(dev))

    def write(layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        n = k.shape[0]
        positions = torch.arange(start, start + n, device=dev)
        keys = k if setup.key_write == "raw" else model.rotate(k, positions)
        index = positions.to(torch.int32)
        batch = torch.zeros(n, dtype=torch.int32, device=dev)
        kernel.append(k_cache[layer], v_cache[layer], keys.to(dtype), v.to(dtype), table(start + n), batch, index)

    rec: dict[str, torch.Tensor] = {}
    # prefill: the prompt attends to its fresh keys, then its keys are appended
    h = embeddings[:length]
    prompt = torch.arange(length, device=dev)
    for layer in range(s.num_layers):
        q, k, v = model.qkv(layer, h)
        q_in, k_in = _kernel_inputs(model, q, k, prompt, setup.kernel_rotates)
        out = _attend_fresh(kernel, model, q_in.to(dtype), k_in.to(dtype), v.to(dtype), page_size, setup.kernel_rotates)
        write(layer, k, v, 0)
        h = model.finish(layer, h, out)
    finals = []
    for step in range(decode_steps):
        t = length + step
        h = embeddings[t : t + 1]
        here = torch.tensor([t], device=dev)
        for layer in range(s.num_layers):
            key = f"cached.s{step}.l{layer}"
            rec[f"{key}.hidden_in"] = h.cpu()
            q, k, v = model.qkv(layer, h)
            write(layer, k, v, t)
            q_in, _ = _kernel_inputs(model, q, k, here, setup.kernel_rotates)
            q_in = q_in.to(dtype)
            tab = table(t + 1)
            out, lse = kernel.decode(
                q_in,
                k_cache[layer],
                v_cache[layer],
                tab,
                rotate=setup.kernel_rotates,
                sm_scale=s.head_dim**-0.5,
                rope_theta=s.rope_theta,
            )
            stored = tab.gather(k_cache[layer], 0)
            rec[f"{key}.q_in"] = q_in.cpu()
            rec[f"{key}.out"] = out.cpu()
            rec[f"{key}.lse"] = lse.float().cpu()
            for name, tensor in _probe(kernel, model, stored, page_size, setup.kernel_rotates).items():
                rec[f"{key}.{name}"] = tensor
            h = model.finish(layer, h, out)
        finals.append(h)
    # the cache as the last step left it (append-only: step s read its first length + s + 1 entries)
    last = table(total)
    for layer in range(s.num_layers):
        rec[f"cached.l{layer}.k_stored"] = last.gather(k_cache[layer], 0).cpu()
        rec[f"cached.l{layer}.v_stored"] = last.gather(v_cache[layer], 0).cpu()
    rec["cached.slots"] = last.slots(0).cpu()
    rec["cached.final_hidden"] = torch.cat(finals).cpu()
    rec["cached.positions"] = torch.arange(length, total)
    return rec
