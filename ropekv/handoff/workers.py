"""Prefill and decode workers over torch.distributed, and a local launcher for them.

Rank 0 is the prefill worker, ranks 1..N decode workers. Each rank builds its own cache contract from
its own flags (``--key-form-prefill`` on rank 0, ``--key-form-decode``/``--decode-rope-theta`` on the
others); the ranks shake hands (``ropekv.transfer.handshake``) before any KV moves. Then, for each
length in ``--lengths``, rank 0 prefills a sequence of the seeded token stream, writes its payload and
sends it to decode rank ``1 + i % N``, which validates it, imports it (all or nothing) and acks; a
payload damaged in transit is refused by its checksum and sent once more. After rank 0's ``done``,
each decode rank runs the parity harness on the sequences it holds (:class:`ServedHandoffAdapter`)
and writes its report.

Entry points: ``python -m ropekv.handoff.workers`` under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT from the environment; one process per machine works), and :func:`launch`, which starts
all ranks on 127.0.0.1 for ``ropekv handoff``. Both take :class:`TransferHooks` as an argument (tests
damage a stream or kill a rank through them); no command-line flag reaches them. Every wait on a peer is bounded by ``--timeout``: a dead
peer raises TransportError (exit 4) at once, a silent one after the timeout. See docs/handoff.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..adapters.native import NativeAdapter
from ..argtypes import (
    MAX_TIMEOUT_S,
    RaisingParser,
    add_model_argument,
    block_size,
    block_size_list,
    positive_int,
    positive_int_list,
    rope_theta,
    seed,
    thread_count,
    timeout_seconds,
)
from ..bugs.registry import HANDOFF_FAULTS, get_handoff_fault
from ..cache.import_policy import ImportPolicy
from ..contract import DTYPES, CacheContract
from ..engine import Engine
from ..errors import PayloadError, RopeKVError, TransportError, UsageError
from ..models import Checkpoint, load_checkpoint
from ..models.embedded import fold_model_name
from ..parity.cases import Case, token_stream
from ..transfer.handshake import Channel, answer, offer
from ..transfer.importer import CONVERT_MODES, ModelLimits, export_handoff
from ..transfer.payload import write_payload
from ..transfer.stream import StreamHeader, rebuild_error, receive_sequence, send_sequence
from .adapter import ServedHandoffAdapter

RESULT_FORMAT = "ropekv.handoff-worker"
Wire = Callable[[int, torch.Tensor], torch.Tensor]  # (chunk index, chunk) -> the chunk that goes out


class TransferHooks:
    """Where a transfer can be observed or broken: nothing happens here. A test hands a subclass to
    :func:`launch` or :func:`main` (it must pickle: ranks are started as processes) to damage a stream
    on the wire or kill a decode rank mid-transfer; the shipped command lines take no hooks."""

    def wire(self, index: int, attempt: int) -> Wire | None:
        """On the prefill rank: a filter over the chunks of sequence ``index``'s stream, attempt
        ``attempt`` (1, or 2 after a refusal); None: the chunks go out as they are."""
        return None

    def header_received(self, index: int) -> None:
        """On a decode rank: called once the header of sequence ``index``'s stream is read."""


# ---------------------------------------------------------------------- arguments


def add_arguments(
    parser: argparse.ArgumentParser, *, cli: bool = False, inject_choices: tuple[str, ...] | None = None
) -> None:
    """The flags every rank and ``ropekv handoff`` share (each rank reads the ones for its role).

    ``cli``: the ``ropekv handoff`` spelling, consistent with ``ropekv check``: ``--block-sizes`` (one
    handoff run per block size) and ``--dist-backend``; a rank takes one ``--block-size`` and ``--backend``.
    ``inject_choices``: what ``--inject`` accepts (default: the handoff faults a rank runs)."""
    add_model_argument(parser)
    parser.add_argument(
        "--lengths",
        type=positive_int_list,
        default=[1, 17, 300],
        help="prompt lengths, one handed-off sequence each (default 1,17,300)",
    )
    parser.add_argument("--decode-steps", type=positive_int, default=3, help="tokens decoded after the handoff")
    if cli:
        parser.add_argument(
            "--block-sizes",
            type=block_size_list,
            default=[16],
            help="cache block sizes on both sides, one handoff run each (default 16)",
        )
    else:
        parser.add_argument("--block-size", type=block_size, default=16, help="cache block size on both sides")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="cache dtype on both sides")
    parser.add_argument(
        "--key-form-prefill",
        choices=("rotated", "raw"),
        default="rotated",
        help="key form of the prefill worker's cache",
    )
    parser.add_argument(
        "--key-form-decode",
        choices=("rotated", "raw"),
        default=None,
        help="key form of the decode workers' caches (default: the prefill's)",
    )
    parser.add_argument(
        "--convert",
        choices=CONVERT_MODES,
        default="never",
        help="'explicit': a decode worker converts a differing key form once, at import",
    )
    parser.add_argument(
        "--decode-rope-theta",
        type=rope_theta,
        default=None,
        help="run the decode workers with another RoPE theta (a contract mismatch to refuse)",
    )
    parser.add_argument(
        "--inject",
        choices=tuple(HANDOFF_FAULTS) if inject_choices is None else inject_choices,
        default=None,
        help="a handoff fault on the decode side (--engine vllm: a transfer fault, --list-faults)",
    )
    parser.add_argument(
        "--save-payload",
        default=None,
        metavar="PATH",
        help="write the first handed-off sequence's payload bytes here (prefill side)",
    )
    parser.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=60.0,
        help=f"seconds any wait on a peer may take before it counts as failed (default 60, at most {MAX_TIMEOUT_S:g})",
    )
    parser.add_argument("--seed", type=seed, default=0, help="seed of the token stream, in [-2**63, 2**64)")
    parser.add_argument(
        "--dist-backend" if cli else "--backend",
        dest="dist_backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="torch.distributed backend; auto: NCCL when every local rank has a GPU, else gloo",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = RaisingParser(
        prog="python -m ropekv.handoff.workers",
        description="One rank of a prefill->decode handoff (rank 0 prefills, the others decode). "
        "Run under torchrun, or let `ropekv handoff` start every rank.",
    )
    add_arguments(parser)
    parser.add_argument(
        "--result",
        default=None,
        metavar="PATH",
        help="write this rank's result JSON here ('{rank}' is replaced by the rank)",
    )
    parser.add_argument("--threads", type=thread_count, default=None, help="torch intra-op threads")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return parser


def worker_argv(args: argparse.Namespace) -> list[str]:
    """Worker command-line flags reproducing the shared flags of ``args`` (a parsed ``ropekv handoff``)."""
    argv = [] if args.model is None else [str(args.model)]
    argv += [
        "--lengths",
        ",".join(map(str, args.lengths)),
        "--decode-steps",
        str(args.decode_steps),
        "--block-size",
        str(args.block_size),
        "--dtype",
        args.dtype,
        "--key-form-prefill",
        args.key_form_prefill,
        "--convert",
        args.convert,
        "--timeout",
        repr(args.timeout),
        "--seed",
        str(args.seed),
        "--backend",
        args.dist_backend,
    ]
    for flag, value in (
        ("--key-form-decode", args.key_form_decode),
        ("--inject", args.inject),
        ("--save-payload", args.save_payload),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if args.decode_rope_theta is not None:
        argv += ["--decode-rope-theta", repr(args.decode_rope_theta)]
    return argv


# ---------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Planned:
    """One handed-off sequence: its index, parity case, id and the decode rank it goes to."""

    index: int
    case: Case
    seq_id: str
    rank: int


def plan(args: argparse.Namespace, world_size: int, max_positions: int) -> list[Planned]:
    """Sequences in sending order; every rank computes the same plan from the same flags."""
    if world_size < 2:
        raise UsageError(f"a handoff needs a prefill rank and at least one decode rank; WORLD_SIZE={world_size}")
    lengths = list(dict.fromkeys(args.lengths))
    if not lengths or min(lengths) < 1:
        raise UsageError(f"--lengths must be positive, got {args.lengths}")
    if world_size - 1 > len(lengths):
        raise UsageError(
            f"{world_size - 1} decode workers but only {len(lengths)} distinct length(s): "
            "each decode worker needs at least one sequence"
        )
    out = []
    for i, length in enumerate(lengths):
        case = Case(length=length, block_size=args.block_size, decode_steps=args.decode_steps)
        if case.total > max_positions:
            raise UsageError(
                f"length {length} + {args.decode_steps} decode steps needs {case.total} positions; "
                f"the model has {max_positions}"
            )
        out.append(Planned(i, case, f"seq{i}-L{length}", 1 + i % (world_size - 1)))
    return out


# ---------------------------------------------------------------------- ranks


def main(argv: list[str] | None = None, hooks: TransferHooks | None = None) -> int:
    """Run one rank; returns its exit code (0 ok, 1 parity fails, 2 error, 3 contract refused, 4 transport).
    ``hooks``: see :class:`TransferHooks` (None: none)."""
    hooks = hooks or TransferHooks()
    try:
        args = build_parser().parse_args(argv)
        fold_model_name(args)
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    except RopeKVError as exc:
        print(f"ropekv handoff worker: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.threads:
        torch.set_num_threads(args.threads)
    out: dict[str, Any] = {
        "format": RESULT_FORMAT,
        "version": 1,
        "rank": rank,
        "world_size": world,
        "role": "prefill" if rank == 0 else "decode",
        "status": "ok",
        "exit_code": 0,
    }
    code, started = 0, False
    try:
        checkpoint = load_checkpoint(args.model)
        planned = plan(args, world, checkpoint.config.max_position_embeddings)
        channel = _init_process_group(args)
        started = True
        if rank == 0:
            code = _run_prefill(args, checkpoint, channel, planned, world, out, hooks)
        else:
            code = _run_decode(args, _decode_checkpoint(checkpoint, args), channel, planned, rank, out, hooks)
    except RopeKVError as exc:
        code = exc.exit_code
        status = {3: "refused", 4: "transport"}.get(code, "error")
        out.update(
            status=status, error=str(exc), error_class=type(exc).__name__, fields=list(getattr(exc, "fields", ()))
        )
        print(f"ropekv handoff rank {rank}: error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the launcher prints the one line
        code = 130
        out.update(status="interrupted", error="interrupted")
    except Exception as exc:
        code = 2
        out.update(
            status="crash",
            error=f"{type(exc).__name__}: {exc}",
            error_class="RopeKVError",
            traceback=traceback.format_exc(),
        )
        traceback.print_exc()
    out["exit_code"] = code
    _write_result(args.result, rank, out)
    if started:
        _destroy_process_group()
    return code


def _run_prefill(
    args,
    checkpoint: Checkpoint,
    channel: Channel,
    planned: list[Planned],
    world: int,
    out: dict[str, Any],
    hooks: TransferHooks,
) -> int:
    contract = CacheContract.for_model(
        checkpoint.config,
        key_form=args.key_form_prefill,
        block_size=args.block_size,
        dtype=args.dtype,
        weights_fingerprint=checkpoint.weights_fingerprint,
    )
    longest = max(p.case.length for p in planned)
    engine = Engine(checkpoint, contract, num_blocks=-(-longest // args.block_size) + 1)
    decode_ranks = list(range(1, world))
    out["contract"] = contract.to_dict()
    answers = offer(channel, contract, decode_ranks)
    out["handshake"] = {"accepted": True, "answers": [a.to_dict() for a in answers]}
    tokens = token_stream(checkpoint.config.vocab_size, longest, args.seed)
    out["transfers"] = transfers = []
    current = None
    try:
        for p in planned:
            current = p.rank
            n = p.case.length
            t0 = time.perf_counter()
            engine.prefill(p.seq_id, tokens[:n])
            prefill_s = time.perf_counter() - t0
            if p.index == 0 and args.save_payload:
                _save(args.save_payload, write_payload(export_handoff(engine.cache, p.seq_id, tokens[:n])))
            facts = _send_sequence(channel, engine, p, tokens[:n], hooks)
            facts.update(prefill_seconds=prefill_s)
            transfers.append(facts)
            engine.free(p.seq_id)
            if not args.quiet:
                print(_describe_transfer(facts), flush=True)
    except RopeKVError as exc:  # tell the other ranks; a peer that failed mid-transfer is not waited for
        lost = current if isinstance(exc, TransportError) else None
        _abort(channel, [r for r in decode_ranks if r != lost], exc)
        raise
    for r in decode_ranks:
        channel.send_json(r, {"step": "done"}, f"'done' to rank {r}")
    return 0


def _send_sequence(
    channel: Channel, engine: Engine, p: Planned, tokens: torch.Tensor, hooks: TransferHooks
) -> dict[str, Any]:
    """Stream one sequence and wait for the ack; a stream refused as damaged is sent once more."""
    what = f"transfer of sequence {p.seq_id!r} to decode rank {p.rank}"
    for attempt in (1, 2):
        wire = hooks.wire(p.index, attempt)
        channel.send_json(p.rank, {"step": "payload", "index": p.index, "seq_id": p.seq_id, "attempt": attempt}, what)
        try:
            sent = send_sequence(channel, p.rank, engine.cache, p.seq_id, tokens, wire=wire)
        except PayloadError as exc:
            if attempt == 1:
                print(f"{what}: {exc}; sending it again", file=sys.stderr, flush=True)
                continue
            raise
        total = sent.tensor_bytes + sent.header_bytes
        return {
            "seq_id": p.seq_id,
            "index": p.index,
            "decode_rank": p.rank,
            "tokens": p.case.length,
            "payload_bytes": total,
            "tensor_bytes": sent.tensor_bytes,
            "overhead_bytes": sent.header_bytes,
            "chunks": sent.chunks,
            "attempts": attempt,
            "transfer_seconds": sent.seconds["send"],
            "bytes_per_second": total / max(sent.seconds["total"], 1e-9),
            "acked_seconds": sent.seconds["total"],
            "phases_seconds": sent.seconds,
        }
    raise AssertionError("unreachable")


def _run_decode(
    args,
    checkpoint: Checkpoint,
    channel: Channel,
    planned: list[Planned],
    rank: int,
    out: dict[str, Any],
    hooks: TransferHooks,
) -> int:
    from ..bugs.registry import EXPLANATIONS
    from ..parity.harness import check

    mine = [p for p in planned if p.rank == rank]
    decode = NativeAdapter(
        checkpoint, key_form=args.key_form_decode or args.key_form_prefill, dtype=args.dtype, name=f"decode rank {rank}"
    )
    blocks = sum(-(-p.case.total // args.block_size) for p in mine) + 1
    serving = decode.make_engine(Case(length=1, block_size=args.block_size), num_blocks=blocks)
    out["contract"] = serving.contract.to_dict()
    result, prefill_contract = answer(channel, serving.contract, args.convert, rank)
    out["handshake"] = result.to_dict()
    policy = get_handoff_fault(args.inject).policy() if args.inject else None
    tokens = token_stream(checkpoint.config.vocab_size, max(p.case.length for p in mine), args.seed)
    by_index: dict[object, Planned] = {p.index: p for p in mine}  # keyed by what a message may say
    sequences: dict[Case, tuple[str, int]] = {}
    out["received"] = received = []
    while True:
        msg = channel.recv_json(0, "next message from the prefill rank")
        step = msg.get("step")
        if step == "done":
            break
        if step == "abort":
            raise rebuild_error(
                msg.get("error_class"), f"the prefill rank aborted: {msg.get('reason')}", msg.get("fields")
            )
        p = by_index.get(msg.get("index"))
        if step != "payload" or p is None or msg.get("seq_id") != p.seq_id:
            raise TransportError(f"the prefill rank sent {str(msg)[:200]}, not a payload planned for rank {rank}")
        facts, imported = _receive_one(channel, serving, p, tokens[: p.case.length], args.convert, policy, hooks)
        if imported:
            sequences[p.case] = (p.seq_id, p.case.length)
        received.append(facts)
    missing = [p.seq_id for p in mine if p.case not in sequences]
    if missing:
        raise TransportError(f"the prefill rank finished without handing off {missing}")
    adapter = ServedHandoffAdapter(
        decode, serving, sequences, prefill_contract=prefill_contract, convert=args.convert, policy=policy
    )
    report = check(adapter, cases=[p.case for p in mine], seed=args.seed, explanations=EXPLANATIONS)
    out["report"], out["table"] = report.to_dict(), report.table()
    if not args.quiet:
        print(report.table(), flush=True)
    return 0 if report.passed else 1


def _receive_one(
    channel: Channel,
    serving: Engine,
    p: Planned,
    tokens: torch.Tensor,
    convert: str,
    policy: ImportPolicy | None,
    hooks: TransferHooks,
) -> tuple[dict[str, Any], bool]:
    """Receive, validate and import one streamed sequence (``tokens [n]``: the ids the plan expects);
    returns the facts and whether it was imported. A refused stream imports nothing (the sender was
    told, and may send it again)."""

    def accept(header: StreamHeader) -> None:
        if header.seq_id != p.seq_id or not torch.equal(header.tokens, tokens):
            raise UsageError(
                f"stream of {p.seq_id!r} holds sequence {header.seq_id!r} with other tokens "
                "than the plan (ranks started with different --lengths or --seed?)"
            )

    def after_header(header: StreamHeader) -> None:
        hooks.header_received(p.index)

    facts: dict[str, Any] = {"seq_id": p.seq_id}
    try:
        got = receive_sequence(
            channel,
            0,
            serving.cache,
            convert=convert,
            policy=policy,
            accept=accept,
            after_header=after_header,
            limits=ModelLimits.of(serving.config),
        )
    except TransportError:
        raise
    except RopeKVError as exc:
        facts["refused"] = f"{type(exc).__name__}: {exc}"
        return facts, False
    facts.update(got.to_dict())
    return facts, True


def _decode_checkpoint(checkpoint: Checkpoint, args) -> Checkpoint:
    if args.decode_rope_theta is None:
        return checkpoint
    cfg = checkpoint.config
    return checkpoint.with_config(cfg.replace(rope=cfg.rope.replace(theta=args.decode_rope_theta)))


# ---------------------------------------------------------------------- plumbing


def _init_process_group(args) -> Channel:
    import torch.distributed as dist

    backend, device = args.dist_backend, "cpu"
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "gloo"
    if backend == "nccl":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise UsageError(f"{name} is not set: run under torchrun, or use `ropekv handoff`")
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    except (RuntimeError, ValueError) as exc:
        raise TransportError(
            f"could not join the process group at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} within {args.timeout:g} s: {str(exc).splitlines()[0][:300]}"
        ) from None
    return Channel(timeout=args.timeout, device=device)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _abort(channel: Channel, ranks: list[int], error: RopeKVError) -> None:
    """Best effort: tell live decode ranks to stop waiting, and why (a dead one fails fast and is skipped)."""
    message = {
        "step": "abort",
        "reason": str(error)[:2000],
        "error_class": type(error).__name__,
        "fields": list(getattr(error, "fields", ())),
    }
    for r in ranks:
        with contextlib.suppress(RopeKVError):  # a rank that is gone cannot be told; the others still are
            channel.send_json(r, message, f"abort to rank {r}")


def _save(path: str, data: bytes) -> None:
    try:
        Path(path).write_bytes(data)
    except OSError as exc:
        raise UsageError(f"--save-payload {path}: {exc.strerror}") from None


def _write_result(path: str | None, rank: int, out: dict[str, Any]) -> None:
    if path:
        Path(path.replace("{rank}", str(rank))).write_text(json.dumps(out, indent=1, default=str))


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None and default is not None:
        return default
    if value is not None:
        with contextlib.suppress(ValueError):
            return int(value)
    raise UsageError(
        f"environment variable {name}={value!r} is not an integer: run under torchrun, or use `ropekv handoff`"
    )


def _describe_transfer(f: dict[str, Any]) -> str:
    return (
        f"{f['seq_id']}: {f['tokens']} tokens, {f['payload_bytes']} payload bytes "
        f"({f['tensor_bytes']} of keys/values) to rank {f['decode_rank']} in {f['transfer_seconds']:.3f} s "
        f"({f['bytes_per_second'] / 1e6:.1f} MB/s), acked after {f['acked_seconds']:.3f} s"
    )


# ---------------------------------------------------------------------- local launcher


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    exitcode: int | None  # negative: killed by that signal; None: still running when abandoned
    result: dict[str, Any] | None  # the rank's result JSON, None if it wrote none
    log: str  # the tail of its stdout/stderr


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    worker_args: list[str],
    world_size: int,
    *,
    timeout: float,
    workdir: Path,
    grace: float | None = None,
    hooks: TransferHooks | None = None,
) -> list[RankOutcome]:
    """Run every rank on 127.0.0.1 (as torchrun would) and wait for all of them; each rank gets
    ``hooks`` (:class:`TransferHooks`; None: none).

    Ranks are forked from a forkserver that imported ropekv once. Once a rank fails (exit code other
    than 0 or 1), the others get ``grace`` seconds (default ``timeout + 15``) to notice and exit, then
    are killed: a hung peer never hangs the launcher. On Ctrl-C (or any error here) every rank is
    stopped and reaped before KeyboardInterrupt goes on (:func:`_shut_down`): none is left running.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs: list[multiprocessing.process.BaseProcess] = []
    grace = timeout + 15 if grace is None else grace
    deadline = None
    try:
        # Ctrl-C is held back while the ranks start: an interrupt between a rank's start and its
        # bookkeeping would leave that rank running unseen. It is delivered once all have started.
        with _sigint_held():
            for rank in range(world_size):
                argv = [
                    *worker_args,
                    "--result",
                    str(workdir / f"rank{rank}.json"),
                    "--quiet",
                    "--threads",
                    str(threads),
                ]
                proc = ctx.Process(
                    target=_child,
                    args=(rank, world_size, port, argv, str(workdir / f"rank{rank}.log"), hooks),
                    name=f"ropekv-handoff-rank{rank}",
                )
                proc.start()
                procs.append(proc)
        while True:
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.5)
            if deadline is None and any(p.exitcode not in (None, 0, 1) for p in procs):
                deadline = time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline:
                for p in alive:
                    p.kill()
                for p in alive:
                    p.join(5)
                break
    except BaseException:
        _shut_down(procs, ready=lambda rank: (workdir / f"rank{rank}.log").exists())
        raise
    return [
        RankOutcome(rank, p.exitcode, _read_json(workdir / f"rank{rank}.json"), _tail(workdir / f"rank{rank}.log"))
        for rank, p in enumerate(procs)
    ]


@contextlib.contextmanager
def _sigint_held():
    """Ctrl-C during the block is recorded, not raised, and raised as KeyboardInterrupt when it ends.
    (A Python-level handler, not a blocked signal mask: torch's threads would take the signal, and
    the forkserver started meanwhile would inherit the mask.) Outside the main thread: no change."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise KeyboardInterrupt


def _shut_down(
    procs: list[multiprocessing.process.BaseProcess],
    wait: float = 10.0,
    ready: Callable[[int], bool] = lambda rank: True,
) -> None:
    """Stop every rank still running: SIGINT first (a rank then writes its result, leaves the process
    group and exits normally, so multiprocessing's finalizers run), SIGKILL after ``wait`` seconds for a
    rank stuck in a native wait; each is reaped. A rank not yet ``ready(rank)`` (its output not yet sent
    to its log: still in multiprocessing's start-up, holding nothing) is killed at once: a SIGINT there
    would print a KeyboardInterrupt traceback on the launcher's terminal. A second Ctrl-C meanwhile is
    ignored: the shutdown is what it asks for."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
    try:
        alive = [p for p in procs if p.exitcode is None]
        for rank, p in enumerate(procs):
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGINT if ready(rank) else signal.SIGKILL)
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.2)
            alive = [p for p in alive if p.exitcode is None]
        for p in alive:
            p.kill()
        for p in procs:
            p.join(5)
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous)


def _child(rank: int, world_size: int, port: int, argv: list[str], log_path: str, hooks: TransferHooks | None) -> None:
    try:
        code = _child_main(rank, world_size, port, argv, log_path, hooks)
    except KeyboardInterrupt:  # before main() handles it: the launcher reports the interrupt
        code = 130
    sys.exit(code)


def _child_main(
    rank: int, world_size: int, port: int, argv: list[str], log_path: str, hooks: TransferHooks | None
) -> int:
    # tqdm's default lock is a named multiprocessing semaphore: a rank killed while holding one would
    # leave the resource tracker a "leaked semaphore" to warn about. A rank writes only its own log.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    # The log appears under its name only once this rank's output goes to it: the launcher reads its
    # existence as "the rank may be interrupted" (:func:`_shut_down`).
    fd = os.open(log_path + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.replace(log_path + ".part", log_path)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    code = main(argv, hooks)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
