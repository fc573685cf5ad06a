"""The streamed handoff against one bare send/recv, on a random cache of the default model's shape.

Builds a ``PagedKVCache`` of SmolLM2-135M's contract (30 layers, 3 KV heads of 64, float32) holding
``--tokens`` tokens of random keys and values (no model run: the handoff moves caches), writes it as a
payload and runs the bench's two ranks on it (``ropekv.bench.handoff.measure_handoff``) ``--runs``
times, printing each run's best-of-``--repeats`` ratio and the phases of the best handoff.

For an A/B against other code, run it with ``PYTHONPATH`` pointing at another checkout: the ranks
are child processes and import ropekv from there::

    python scripts/handoff_ab.py --runs 2
    PYTHONPATH=/tmp/old python scripts/handoff_ab.py --runs 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from ropekv.bench.handoff import measure_handoff
from ropekv.cache.paged import PagedKVCache
from ropekv.contract import CacheContract
from ropekv.models.default import default_checkpoint
from ropekv.transfer.importer import export_handoff
from ropekv.transfer.payload import write_payload


def payload_of(tokens: int, seed: int = 0) -> bytes:
    ckpt = default_checkpoint()
    contract = CacheContract.for_model(
        ckpt.config, key_form="rotated", block_size=16, dtype="float32", weights_fingerprint=ckpt.weights_fingerprint
    )
    cache = PagedKVCache(contract, -(-tokens // contract.block_size))
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, contract.num_kv_heads, contract.head_dim)
    cache.create("handoff")
    keys = [torch.randn(shape, generator=g) for _ in range(contract.num_layers)]
    values = [torch.randn(shape, generator=g) for _ in range(contract.num_layers)]
    cache.append("handoff", torch.arange(tokens), keys, values, key_form=contract.key_form)
    return write_payload(export_handoff(cache, "handoff", torch.arange(tokens) + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write every run's figures here")
    args = ap.parse_args()
    payload = payload_of(args.tokens)
    runs = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            h = measure_handoff(payload, Path(tmp), repeats=args.repeats)
        ratio = h["handoff"]["bytes_per_s"] / h["bare"]["bytes_per_s"]
        best = min(range(args.repeats), key=lambda i: h["handoff"]["seconds"][i])
        sender = {k: round(v[best] * 1e3, 1) for k, v in h["sender_phases_seconds"].items()}
        receiver = {k: round(v[best] * 1e3, 1) for k, v in h["receiver_phases_seconds"].items()}
        print(
            f"run {run + 1}: handoff {h['handoff']['best_seconds'] * 1e3:.1f} ms, bare {h['bare']['best_seconds'] * 1e3:.1f}"
            f" ms, ratio {ratio:.3f}; sender ms {sender}; receiver ms {receiver}",
            flush=True,
        )
        runs.append({"ratio": ratio, **h})
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
