"""Finding: how the error of repeated shifts of rotated keys grows, against raw keys relabelled.

Rotated keys stored in a float32 or float16 cache are shifted by ``delta`` (turned by R(delta) in
float32, stored back in the cache dtype) ``times`` times; raw keys are only relabelled (their error
is the cache dtype's one rounding, however often they move). Error: max |k - R(p + times * delta) r|
over keys, divided by max |R(...) r| (scale-aware), where the exact key is computed in float64 from
the raw key. SmolLM2's RoPE (head_dim 64, theta 1e5) on unit-variance random keys.

    .venv/bin/python scripts/findings/shift_precision.py [--plot docs/img/shift-precision.png]
"""

from __future__ import annotations

import argparse
import json

import torch

from ropekv.cache.policy import turn
from ropekv.rope import RopeSpec

ROPE = RopeSpec(head_dim=64, rotary_dim=64, theta=100000.0, max_position_embeddings=8192)
DELTAS = (10, 1000, 4000)
TIMES = (1, 100)
DTYPES = ("float32", "float16")


def measure(n_keys: int = 512, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(n_keys, 3, 64, generator=g, dtype=torch.float64)  # [N, KVH, D]
    positions = torch.arange(n_keys)
    rows = []
    for dtype in DTYPES:
        dt = getattr(torch, dtype)
        for delta in DELTAS:
            for times in (1, 10, 100):
                stored = ROPE.rotate(raw, positions).to(dt)  # rotated keys in the cache dtype
                for _ in range(times):
                    stored = turn(ROPE, stored, delta)
                exact = ROPE.rotate(raw, positions + times * delta)
                scale = float(exact.abs().max())
                rotated_err = float((stored.double() - exact).abs().max()) / scale
                relabel = raw.to(dt).double()  # raw keys: rotated on read at the new position, in float32
                read = ROPE.rotate(relabel.float(), positions + times * delta).double()
                raw_err = float((read - exact).abs().max()) / scale
                rows.append(dict(dtype=dtype, delta=delta, times=times, rotated_error=rotated_err, raw_error=raw_err))
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, dtype in zip(axes, DTYPES):
        for delta in DELTAS:
            sel = [r for r in rows if r["dtype"] == dtype and r["delta"] == delta]
            ax.plot([r["times"] for r in sel], [r["rotated_error"] for r in sel], "o-", label=f"rotated, delta {delta}")
            ax.plot(
                [r["times"] for r in sel], [r["raw_error"] for r in sel], "x--", label=f"raw relabelled, delta {delta}"
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{dtype} cache")
        ax.set_xlabel("shifts applied")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("max |key - exact| / max |exact|")
    axes[1].legend(fontsize=7)
    fig.suptitle("Repeated shifts: rotated keys re-rotated each time vs raw keys relabelled")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = measure()
    print(f"{'dtype':8s} {'delta':>6s} {'times':>6s} {'rotated err':>12s} {'raw err':>10s}")
    for r in rows:
        print(f"{r['dtype']:8s} {r['delta']:6d} {r['times']:6d} {r['rotated_error']:12.3e} {r['raw_error']:10.3e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
