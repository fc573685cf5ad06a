"""Handoff throughput between two local ranks (torch.distributed, gloo), against a bare send/recv.

The parent process writes one sequence's payload (``ropekv.transfer.write_payload``) to a file and
starts two ranks (``python -m ropekv.bench.handoff``), one thread each. Rank 0 imports the payload
into its own engine (setup, untimed); then, ``repeats`` times, after a barrier:

- ``handoff``: what ``ropekv handoff`` does per sequence. Rank 0: ``export_handoff`` ->
  ``write_payload`` -> ``Channel.send`` (framed, chunked). Rank 1: ``Channel.recv`` -> ``read_payload``
  (checksum, validation) -> ``import_handoff`` into its engine (all-or-nothing append).
- ``channel``: the same framed ``Channel.send``/``recv`` of the already written bytes (the wire part).
- ``bare``: ``dist.send``/``dist.recv`` of one preallocated uint8 tensor of the same byte count.

Times are taken on the receiving rank from the barrier to the end of its work, so each includes the
sender's share. The figure is payload bytes over the best of ``repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

KINDS = ("handoff", "channel", "bare")


def measure_handoff(payload: bytes, model: str | None, workdir: Path, *, repeats: int = 3,
                    timeout: float = 300.0) -> dict[str, Any]:
    """Start both ranks on 127.0.0.1 and collect their figures (rank 1 times, rank 0 phases)."""
    payload_path = workdir / "payload.safetensors"
    payload_path.write_bytes(payload)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        argv = [sys.executable, "-m", "ropekv.bench.handoff", "--rank", str(rank), "--port", str(port),
                "--payload", str(payload_path), "--result", str(workdir / f"rank{rank}.json"),
                "--repeats", str(repeats), "--timeout", str(timeout)]
        if model is not None:
            argv += ["--model", str(model)]
        log = open(workdir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for proc, _ in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
                break
    finally:  # a timeout or an interrupt: no rank is left running on its own
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    codes += [proc.returncode for proc, _ in procs[len(codes):]]
    results = []
    for rank in (0, 1):
        path = workdir / f"rank{rank}.json"
        if not path.exists():
            tail = (workdir / f"rank{rank}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"handoff bench rank {rank} exited {codes[rank]} without a result:\n{tail}")
        results.append(json.loads(path.read_text()))
    sender, receiver = results
    nbytes = len(payload)
    out: dict[str, Any] = {"payload_bytes": nbytes, "tensor_bytes": receiver["tensor_bytes"],
                           "tokens": receiver["tokens"], "repeats": repeats, "threads_per_rank": 1,
                           "transport": "torch.distributed gloo over 127.0.0.1, two processes"}
    for kind in KINDS:
        seconds = receiver["seconds"][kind]
        out[kind] = {"seconds": seconds, "best_seconds": min(seconds), "bytes_per_s": nbytes / min(seconds)}
    out["sender_phases_seconds"] = sender["phases"]
    out["receiver_phases_seconds"] = receiver["phases"]
    out["handoff_over_bare_sendrecv"] = out["handoff"]["bytes_per_s"] / out["bare"]["bytes_per_s"]
    out["channel_over_bare_sendrecv"] = out["channel"]["bytes_per_s"] / out["bare"]["bytes_per_s"]
    return out


def _rank_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..engine import Engine
    from ..models import load_checkpoint
    from ..transfer import read_payload, write_payload
    from ..transfer.handshake import KIND_PAYLOAD, Channel

    torch.set_num_threads(1)
    rank = args.rank
    data = Path(args.payload).read_bytes()
    handoff = read_payload(data)
    checkpoint = load_checkpoint(args.model)
    c = handoff.contract
    engine = Engine(checkpoint, c, num_blocks=2 * (-(-handoff.num_tokens // c.block_size)) + 2)
    if rank == 0:
        engine.import_handoff(handoff, seq_id="source")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=args.timeout))
    channel = Channel(timeout=args.timeout)
    bare = torch.zeros(len(data), dtype=torch.uint8)
    seconds: dict[str, list[float]] = {k: [] for k in KINDS}
    phases: dict[str, list[float]] = {}

    def phase(name: str, t0: float) -> float:
        t = time.perf_counter()
        phases.setdefault(name, []).append(t - t0)
        return t

    try:
        for rep in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                h = engine.export_handoff("source", handoff.tokens)
                t = phase("export", t0)
                blob = write_payload(h)
                t = phase("write_payload", t)
                channel.send(1, KIND_PAYLOAD, blob, "bench payload")
                phase("send", t)
            else:
                blob = channel.recv(0, KIND_PAYLOAD, 2 * len(data) + (1 << 20), "bench payload")
                t = phase("recv", t0)
                h = read_payload(blob)
                t = phase("read_payload", t)
                engine.import_handoff(h, seq_id=f"imported-{rep}")
                t = phase("import", t)
                seconds["handoff"].append(t - t0)
                engine.free(f"imported-{rep}")

            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                channel.send(1, KIND_PAYLOAD, data, "bench bytes")
            else:
                channel.recv(0, KIND_PAYLOAD, 2 * len(data) + (1 << 20), "bench bytes")
                seconds["channel"].append(time.perf_counter() - t0)

            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(bare, 1)
            else:
                dist.recv(bare, 0)
                seconds["bare"].append(time.perf_counter() - t0)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result = {"rank": rank, "seconds": seconds, "phases": phases, "tokens": handoff.num_tokens,
              "tensor_bytes": handoff.tensor_bytes()}
    Path(args.result).write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ropekv.bench.handoff", description="one rank of the handoff bench")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--payload", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return _rank_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
