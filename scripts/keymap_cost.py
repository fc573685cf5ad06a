"""The cost of the key map: :func:`ropekv.diagnose_row` (the fit of every key and its query, then every
bug class) on one decode row at SmolLM2-135M's shapes (9 query heads, 3 KV heads, head dim 64, theta
100,000), for N keys, in three shapes of bug:

- ``offset``: every key turned at ``j + 1`` (a named position fits every cell);
- ``block start``: keys at their 16-token block's first position (named too);
- ``scrambled``: each key turned at a random position in ``[0, 4N)`` (no named position fits: the
  integer search runs for every cell, the worst case).

    .venv/bin/python scripts/keymap_cost.py            # N = 1,024, 4,096 and 8,192
    .venv/bin/python scripts/keymap_cost.py --keys 2048

Prints the wall time per shape and N (best of ``--repeat``) and the class named.
"""

from __future__ import annotations

import argparse
import time

import torch

from ropekv import diagnose_row
from ropekv.rope import RopeSpec

H, KVH, D, THETA = 9, 3, 64, 100_000.0


def _row(n: int, shape: str, gen: torch.Generator) -> dict[str, object]:
    rope = RopeSpec(head_dim=D, rotary_dim=D, theta=THETA, max_position_embeddings=8192)
    pos = torch.arange(n)
    k_raw = torch.randn(n, KVH, D, generator=gen, dtype=torch.float64)
    q_raw = torch.randn(1, H, D, generator=gen, dtype=torch.float64)
    if shape == "offset":
        turned_at = pos + 1
    elif shape == "block start":
        turned_at = pos - pos % 16
    else:
        turned_at = torch.randint(0, 4 * n, (n,), generator=gen)
    k_eff = rope.rotate(k_raw, turned_at).float()
    q_eff = rope.rotate(q_raw, torch.tensor([n])).float()[0]
    return dict(
        rope=rope,
        q_raw=q_raw[0].float(),
        q_eff=q_eff,
        k_raw=k_raw.float(),
        k_eff=k_eff,
        query_position=n,
        key_positions=pos,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="*", default=[1024, 4096, 8192], help="key counts (1..65,536)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per figure, the best kept (1..10)")
    args = ap.parse_args()
    if any(not 1 <= n <= 65_536 for n in args.keys) or not 1 <= args.repeat <= 10:
        ap.error("--keys must be in 1..65,536 and --repeat in 1..10")
    print(f"threads {torch.get_num_threads()}; shapes H={H} KVH={KVH} D={D} theta={THETA:g}")
    print(f"{'keys':>6s} {'shape':12s} {'seconds':>8s}  named")
    for n in args.keys:
        for shape in ("offset", "block start", "scrambled"):
            row = _row(n, shape, torch.Generator().manual_seed(n))
            best, named = float("inf"), ""
            for _ in range(args.repeat):
                start = time.perf_counter()
                d = diagnose_row(**row)  # type: ignore[arg-type]
                best = min(best, time.perf_counter() - start)
                named = d.kind.value
            print(f"{n:6d} {shape:12s} {best:8.2f}  {named}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
