"""How close to its floor an eager decode step can get: a minimal layer loop against the matvec floor.

The bench's goal puts ropekv's rotated decode step within 1.15x of the matvec floor plus the KV bytes
it must read. This script asks what that goal needs. It times three things, interleaved, at one
context on the default model (SmolLM2-135M, float32):

- ``lean``: a minimal eager step for this model. It uses the engine's own fused
  weights, contiguous per-head K/V tensors, one cos/sin row and no cache bookkeeping: norm, one qkv
  matvec, rotate q and k, write k and v, two ``bmm`` per layer, then o, norm, gate/up, silu, down.
- ``floor``: the bench's matvec floor (``ropekv.bench.decode.floor_driver``).
- ``kernels``: the bench's kernels floor (``kernels_floor_driver``): the matvecs and each layer's two
  attention matmuls over its cached keys and values, nothing else.
- ``engine``: ropekv's engine (rotated keys), as the bench drives it.

``--compile`` runs the lean step's layer loop as one ``torch.compile`` graph (``dynamic=True``; the
weights go in as arguments: held as constants, inductor's CPU code for the matvecs ran several times
slower here). Compiling takes about a minute and a half, in the warm-up steps.

The lean step computes a real decode step's arithmetic over random cached keys. Its numbers are not
checked against anything, and it is not an engine; it only times the operations a step cannot avoid
when each one is its own torch call.

    .venv/bin/python scripts/decode_lean_loop.py --context 1024 --steps 30 [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ropekv.bench.decode import floor_driver, kernels_floor_driver, ropekv_driver
from ropekv.models import load_checkpoint
from ropekv.parity.cases import token_stream


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024, help="cached tokens before the timed steps (64..8000)")
    p.add_argument("--steps", type=int, default=30, help="timed steps of each (5..1000)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="the lean step's layer loop as one torch.compile graph")
    args = p.parse_args()
    if not 64 <= args.context <= 8000 or not 5 <= args.steps <= 1000 or not 1 <= args.threads <= 256:
        raise SystemExit("--context must be in 64..8000, --steps in 5..1000, --threads in 1..256")
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(None)
    cfg = ckpt.config
    ctx, room = args.context, args.steps + 10
    tokens = token_stream(cfg.vocab_size, ctx + room)
    engine = ropekv_driver(ckpt, "rotated", tokens, ctx + room)
    w = engine.keep[0].weights
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group, half, eps = heads // kv_heads, d // 2, cfg.rms_norm_eps
    keys = torch.randn(cfg.num_layers, kv_heads, ctx + room, d)  # [L, KVH, N, D]: each head contiguous
    values = torch.randn(cfg.num_layers, kv_heads, ctx + room, d)
    inv_freq = 1.0 / (cfg.rope.theta ** (torch.arange(0, half, dtype=torch.float64) / half))

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [heads, D], neox pairs
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    layer_weights = [(lw.attn_in.weight, lw.qkv, lw.o, lw.mlp_in.weight, lw.gate_up, lw.down) for lw in w.layers]
    q_end, k_end = heads * d, (heads + kv_heads) * d

    def layers(h, weights, ks, vs, cos, sin):  # h [1, hidden]; ks/vs [KVH, N, D] views, the new row last
        for (attn_in, qkv_w, o, mlp_in, gate_up, down), k, v in zip(weights, ks, vs):
            x = F.rms_norm(h, (h.shape[-1],), attn_in, eps)
            qkv = F.linear(x, qkv_w)[0]
            q = rotate(qkv[:q_end].view(heads, d), cos, sin)
            k[:, -1] = rotate(qkv[q_end:k_end].view(kv_heads, d), cos, sin)
            v[:, -1] = qkv[k_end:].view(kv_heads, d)
            scores = torch.bmm(q.view(kv_heads, group, d), k.transpose(1, 2)).mul_(d**-0.5)  # [KVH, G, N]
            out = torch.bmm(torch.softmax(scores, -1), v).view(1, heads * d)
            h = h + F.linear(out, o)
            x = F.rms_norm(h, (h.shape[-1],), mlp_in, eps)
            gate, up = F.linear(x, gate_up).chunk(2, -1)
            h = h + F.linear(F.silu(gate) * up, down)
        return h

    run_layers = torch.compile(layers, dynamic=True) if args.compile else layers

    def lean(position: int) -> torch.Tensor:
        h = w.embed[tokens[position : position + 1]]  # [1, hidden]
        angle = (position * inv_freq).float()
        cos, sin = angle.cos(), angle.sin()
        ks = [keys[layer, :, : position + 1] for layer in range(cfg.num_layers)]
        vs = [values[layer, :, : position + 1] for layer in range(cfg.num_layers)]
        h = run_layers(h, layer_weights, ks, vs, cos, sin)
        return F.linear(F.rms_norm(h, (h.shape[-1],), w.final_norm.weight, eps), w.lm_head)

    floor = floor_driver(w)
    kernels = kernels_floor_driver(w, engine.keep[0].contract, ctx + room)
    times: dict[str, list[float]] = {"lean": [], "floor": [], "kernels": [], "engine": []}
    runs = {"lean": lean, "floor": floor.decode, "kernels": kernels.decode, "engine": engine.decode}
    with torch.no_grad():
        for start in range(0, ctx, 512):
            engine.prefill(start, min(ctx, start + 512))
        for i in range(5):
            for fn in runs.values():
                fn(ctx + i)
        for i in range(args.steps):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn(ctx + 5 + i)
                times[name].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    kv_bytes = 2 * cfg.num_layers * kv_heads * ctx * d * 4  # float32 keys and values the step reads
    attention_ms = ms["kernels"] - ms["floor"]
    print(
        f"context {ctx}{', compiled' if args.compile else ''}: median step "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
    )
    print(
        f"lean / floor {ms['lean'] / ms['floor']:.3f}; engine / floor {ms['engine'] / ms['floor']:.3f}; "
        f"lean / kernels {ms['lean'] / ms['kernels']:.3f}; engine / kernels {ms['engine'] / ms['kernels']:.3f}; "
        f"the attention matmuls read {kv_bytes / 1e6:.0f} MB of KV "
        + (f"at {kv_bytes / attention_ms / 1e6:.1f} GB/s" if attention_ms > 0 else "in no measurable time")
    )


if __name__ == "__main__":
    main()
