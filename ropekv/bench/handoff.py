"""Handoff throughput between two local ranks (torch.distributed, gloo), against a bare send/recv.

The parent process writes one sequence's payload (``ropekv.transfer.write_payload``) to a file and
starts two ranks (``python -m ropekv.bench.handoff``), one thread each, each holding a
``PagedKVCache`` of the payload's contract (no model: the handoff moves caches). Rank 0 imports the
payload into its cache (setup, untimed); then, ``repeats`` times, after a barrier:

- ``handoff``: what ``ropekv handoff`` does per sequence, the streamed handoff
  (``ropekv.transfer.stream``): rank 0 sends the header, then posts the chunks as views of its pool,
  hashes them while they are on the wire, then sends the trailer of checksums; rank 1 checks the
  header, reserves blocks, receives every chunk straight into them (hashed and checked finite while
  the next chunk arrives), checks the trailer, commits, acks.
- ``bare_chunks``: the same chunks sent and received with nothing else (no header, no hashing, no
  checks, no reservation): what the chunking alone costs against one message.
- ``bare``: one ``dist.send``/``dist.recv`` of a preallocated uint8 tensor of the same byte count.

Times are taken on the receiving rank from the barrier to the end of its work, so each includes the
sender's share. The figure is the stream's bytes (keys/values plus header) over the best of ``repeats``.
The first imported copy is compared with the payload, bit for bit (untimed).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

KINDS = ("handoff", "bare_chunks", "bare")


def measure_handoff(
    payload: bytes,
    workdir: Path,
    *,
    repeats: int = 3,
    timeout: float = 300.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Start both ranks on 127.0.0.1 and collect their figures (rank 1 times, both ranks' phases)."""
    payload_path = workdir / "payload.safetensors"
    payload_path.write_bytes(payload)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        argv = [
            sys.executable,
            "-m",
            "ropekv.bench.handoff",
            "--rank",
            str(rank),
            "--port",
            str(port),
            "--payload",
            str(payload_path),
            "--result",
            str(workdir / f"rank{rank}.json"),
            "--repeats",
            str(repeats),
            "--timeout",
            str(timeout),
        ]
        log = open(workdir / f"rank{rank}.log", "w")  # noqa: SIM115 -- closed after its process ends, below
        procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []  # None: the rank did not finish in time
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
    codes += [proc.returncode for proc, _ in procs[len(codes) :]]
    results = []
    for rank in (0, 1):
        path = workdir / f"rank{rank}.json"
        if not path.exists():
            tail = (workdir / f"rank{rank}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"handoff bench rank {rank} exited {codes[rank]} without a result:\n{tail}")
        results.append(json.loads(path.read_text()))
    sender, receiver = results
    nbytes = receiver["stream_bytes"]
    out: dict[str, Any] = {
        "payload_bytes": nbytes,
        "tensor_bytes": receiver["tensor_bytes"],
        "header_bytes": nbytes - receiver["tensor_bytes"],
        "chunks": receiver["chunks"],
        "in_place_chunks": receiver["in_place_chunks"],
        "verified_exact": receiver["verified"],
        "tokens": receiver["tokens"],
        "repeats": repeats,
        "threads_per_rank": 1,
        "transport": "torch.distributed gloo over 127.0.0.1, two processes",
    }
    for kind in KINDS:
        seconds = receiver["seconds"][kind]
        out[kind] = {"seconds": seconds, "best_seconds": min(seconds), "bytes_per_s": nbytes / min(seconds)}
    out["sender_phases_seconds"] = sender["phases"]
    out["receiver_phases_seconds"] = receiver["phases"]
    out["handoff_over_bare_sendrecv"] = out["handoff"]["bytes_per_s"] / out["bare"]["bytes_per_s"]
    out["bare_chunks_over_bare_sendrecv"] = out["bare_chunks"]["bytes_per_s"] / out["bare"]["bytes_per_s"]
    return out


def _rank_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..cache.paged import PagedKVCache
    from ..transfer.handshake import Channel
    from ..transfer.importer import import_handoff
    from ..transfer.saved import read_saved
    from ..transfer.stream import receive_sequence, send_sequence

    torch.set_num_threads(1)
    rank = args.rank
    handoff = read_saved(args.payload)  # a regular file, its header checked before its tensors are read
    c = handoff.contract
    cache = PagedKVCache(c, num_blocks=2 * (-(-handoff.num_tokens // c.block_size)) + 2)
    if rank == 0:
        import_handoff(cache, handoff, seq_id="source")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=args.timeout),
    )
    channel = Channel(timeout=args.timeout)
    seconds: dict[str, list[float]] = {k: [] for k in KINDS}
    phases: dict[str, list[float]] = {}
    facts: dict[str, Any] = {}

    try:
        for rep in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                sent = send_sequence(channel, 1, cache, "source", handoff.tokens)
                chunk_sizes = [int(x) for x in _chunk_bytes(cache, sent.chunks)]
                facts.update(stream_bytes=sent.tensor_bytes + sent.header_bytes, chunk_sizes=chunk_sizes)
                record = sent.seconds
            else:
                got = receive_sequence(channel, 0, cache, seq_id=f"imported-{rep}")
                seconds["handoff"].append(time.perf_counter() - t0)
                record = got.seconds
                if rep == 0:
                    facts.update(
                        verified=_same(cache, f"imported-{rep}", handoff),
                        chunks=got.chunks,
                        in_place_chunks=got.in_place_chunks,
                    )
                cache.free(f"imported-{rep}")
            for name, value in record.items():
                phases.setdefault(name, []).append(value)
            sizes = _exchange_sizes(rank, facts)  # chunk byte counts and stream bytes, from rank 0

            # written before the clock starts, as the pools are: fresh pages would be faulted in mid-transfer
            buffers = [torch.zeros(n, dtype=torch.uint8) for n in sizes["chunk_sizes"]]
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                works = [dist.isend(b, 1) for b in buffers]
            else:
                works = [dist.irecv(b, 0) for b in buffers]
            for w in works:
                assert w is not None  # point-to-point ops return their request on a member of the group
                w.wait()
            if rank == 1:
                seconds["bare_chunks"].append(time.perf_counter() - t0)

            bare = torch.zeros(sizes["stream_bytes"], dtype=torch.uint8)
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(bare, 1)
            else:
                dist.recv(bare, 0)
                seconds["bare"].append(time.perf_counter() - t0)
            facts.setdefault("stream_bytes", sizes["stream_bytes"])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result = {
        "rank": rank,
        "seconds": seconds,
        "phases": phases,
        "tokens": handoff.num_tokens,
        "tensor_bytes": handoff.tensor_bytes(),
        **facts,
    }
    Path(args.result).write_text(json.dumps(result))
    return 0


def _chunk_bytes(cache, count: int) -> list[int]:
    from ..transfer.stream import DEFAULT_CHUNK_BYTES, chunk_plan

    c = cache.contract
    row = c.head_dim * c.torch_dtype.itemsize  # one row of one KV head (stream.chunk_plan)
    plan = chunk_plan(c, cache.num_tokens("source"), max(1, DEFAULT_CHUNK_BYTES // row))
    assert len(plan) == count
    return [(ch.stop - ch.start) * row for ch in plan]


_MAX_SIZES_BYTES = 16 << 20  # the chunk sizes of a 2**24-token payload fit many times over


def _exchange_sizes(rank: int, facts: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's chunk byte counts and stream bytes, on both ranks. Sent as data, never as objects: a
    length, then the JSON text as a uint8 tensor (``broadcast_object_list`` would unpickle what the
    other rank sent)."""
    import torch.distributed as dist

    text = b""
    if rank == 0:
        text = json.dumps({"chunk_sizes": facts["chunk_sizes"], "stream_bytes": facts["stream_bytes"]}).encode()
    length = torch.tensor([len(text)], dtype=torch.int64)
    dist.broadcast(length, src=0)
    n = int(length[0])
    if not 2 <= n <= _MAX_SIZES_BYTES:
        raise RuntimeError(f"handoff bench: rank 0 announced {n} bytes of chunk sizes")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8) if rank == 0 else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(data, src=0)
    sizes = json.loads(data.numpy().tobytes())
    chunks, total = sizes.get("chunk_sizes"), sizes.get("stream_bytes")
    if not (
        isinstance(chunks, list)
        and all(isinstance(x, int) and x >= 0 for x in chunks)
        and isinstance(total, int)
        and total >= 0
    ):
        raise RuntimeError("handoff bench: rank 0's chunk sizes are not a list of byte counts and a total")
    return sizes


def _same(cache, seq_id: str, handoff) -> bool:
    views = [cache.view(seq_id, layer) for layer in range(handoff.contract.num_layers)]
    return torch.equal(cache.positions(seq_id), handoff.positions) and all(
        torch.equal(v.keys, k) and torch.equal(v.values, x) for v, k, x in zip(views, handoff.keys, handoff.values)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ropekv.bench.handoff", description="one rank of the handoff bench")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--payload", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return _rank_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
