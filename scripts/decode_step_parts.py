"""Where a decode step of ropekv's engine spends its time, by the functions of its layer loop.

Wraps the engine's functions with timers (``Engine._row``, ``project_qkv``, ``Engine._attend_row``
and the ``attend_segments`` inside it, ``finish_layer``, ``PagedKVCache.append``, ``final_logits``)
and decodes ``--steps`` tokens of the default model (SmolLM2-135M, float32, rotated keys) at one
context, as the bench's driver does. Prints milliseconds per step for each, nested ones inside their
callers. Compare each with its kernels: ``finish_layer`` holds the o, gate/up and down matvecs,
``project_qkv`` the q/k/v matvec, ``attend_segments`` the attention matmuls, ``final_logits`` the LM
head; what a function takes above its kernels is the step's overhead there.

    .venv/bin/python scripts/decode_step_parts.py --context 1024 --steps 30
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import torch

import ropekv.engine.engine as engine_module
from ropekv.bench.decode import ropekv_driver
from ropekv.cache.paged import PagedKVCache
from ropekv.models import load_checkpoint
from ropekv.parity.cases import token_stream


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024, help="cached tokens before the timed steps (64..8000)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (5..1000)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not 64 <= args.context <= 8000 or not 5 <= args.steps <= 1000 or not 1 <= args.threads <= 256:
        raise SystemExit("--context must be in 64..8000, --steps in 5..1000, --threads in 1..256")
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(None)
    ctx, room = args.context, args.steps + 10
    tokens = token_stream(ckpt.config.vocab_size, ctx + room)
    driver = ropekv_driver(ckpt, "rotated", tokens, ctx + room)
    seconds: dict[str, float] = {}
    labels: list[str] = []

    def timed(owner: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(inner)
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapper)
        labels.append(label)

    with torch.no_grad():
        for start in range(0, ctx, 512):
            driver.prefill(start, min(ctx, start + 512))
        for i in range(5):
            driver.decode(ctx + i)
        timed(engine_module.Engine, "decode", "the whole step")
        timed(engine_module.Engine, "_row", "  _row (groups, masks, tables)")
        timed(engine_module, "project_qkv", "  project_qkv (norm, q/k/v matvec)")
        timed(engine_module.Engine, "_attend_row", "  _attend_row (rotation, cache views, attention)")
        timed(engine_module, "attend_segments", "    attend_segments (the attention itself)")
        timed(engine_module, "finish_layer", "  finish_layer (o, norms, MLP, residuals)")
        timed(PagedKVCache, "append", "  PagedKVCache.append (validated cache write)")
        timed(engine_module, "final_logits", "  final_logits (norm, LM head)")
        for i in range(args.steps):
            driver.decode(ctx + 5 + i)
    print(f"context {ctx}, {args.steps} steps, {args.threads} thread(s): ms per step")
    order = ["the whole step", *(label for label in labels if label != "the whole step")]
    for label in order:
        print(f"{label:52s} {1e3 * seconds.get(label, 0.0) / args.steps:7.2f}")


if __name__ == "__main__":
    main()
