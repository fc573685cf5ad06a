"""``ropekv handoff``: prefill on one worker, hand the KV cache off, decode on others, check parity.

Starts a prefill rank and ``--decode-workers`` decode ranks on 127.0.0.1 (torch.distributed, gloo;
``ropekv.handoff.workers``), prints each decode rank's parity table (prefill on worker A + decode on
worker B against full forwards) and the transfer facts. Exit codes as ``ropekv check``: 0 parity
holds, 1 it does not, 2 bad input, 3 a handshake refused a contract, 4 a worker failed or went silent.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ContractMismatch, RopeKVError, TransportError, UsageError
from .options import worker_count, writable_path

REPORT_FORMAT = "ropekv.handoff-report"


def add_parser(subparsers) -> None:
    from ..handoff.workers import add_arguments

    p = subparsers.add_parser(
        "handoff",
        help="check parity across a prefill->decode handoff between worker processes",
        description="Prefill on a prefill worker, hand each sequence's KV cache to a decode worker over "
        "torch.distributed (after a contract handshake), decode there, and compare with full "
        "forwards layer by layer. See docs/handoff.md.",
    )
    add_arguments(p, cli=True)
    p.add_argument("--list-faults", action="store_true", help="list the handoff fault catalogue and exit")
    p.add_argument(
        "--decode-workers", type=worker_count, default=1, help="decode worker processes (default 1, at most 64)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the parity report and handoff facts here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..handoff.workers import launch, worker_argv

    if args.list_faults:
        from ..faults.registry import HANDOFF_FAULTS, listing

        for f in HANDOFF_FAULTS.values():
            print(listing(f))
        return 0
    json_path = writable_path(args.json, "--json")
    save_path = writable_path(args.save_payload, "--save-payload")
    if save_path is not None:
        args.save_payload = str(save_path.resolve())
    _check(args)
    runs, code, first_error = [], 0, None
    for block_size in args.block_sizes:  # one handoff run per block size, as ropekv check's cases
        args.block_size = block_size
        if len(args.block_sizes) > 1:
            print(f"block size {block_size}:")
        with tempfile.TemporaryDirectory(prefix="ropekv-handoff-") as tmp:
            outcomes = launch(worker_argv(args), args.decode_workers + 1, timeout=args.timeout, workdir=Path(tmp))
        error = _error(outcomes)
        parity = _merge([o.result["report"] for o in outcomes[1:] if o.result and o.result.get("report")])
        passed = error is None and parity is not None and bool(parity["passed"])
        run_code = error.exit_code if error is not None else (0 if passed else 1)
        tables = [(o.rank, o.result["table"]) for o in outcomes[1:] if o.result and o.result.get("table")]
        for rank, table in tables:
            if len(tables) > 1:
                print(f"decode worker (rank {rank}):")
            print(table)
        facts = _facts(outcomes)
        if facts["transfers"]:
            print(_summary(facts))
        runs.append(
            {"block_size": block_size, "passed": passed, "exit_code": run_code, "handoff": facts, "parity": parity}
        )
        code = max(code, run_code)
        first_error = first_error or error
    if json_path is not None:
        doc = {
            "format": REPORT_FORMAT,
            "version": 2,
            "passed": all(r["passed"] for r in runs),
            "exit_code": code,
            "runs": runs,
        }
        json_path.write_text(json.dumps(doc, indent=2, allow_nan=False))
    if first_error is not None:
        raise first_error
    return code


def _check(args: argparse.Namespace) -> None:
    # Each number is bounded by its argparse type (ropekv.argtypes); what is left needs two flags.
    distinct = len(set(args.lengths))
    if args.decode_workers > distinct:
        raise UsageError(
            f"--decode-workers {args.decode_workers} but only {distinct} distinct length(s): "
            "each decode worker needs at least one sequence"
        )


def _error(outcomes) -> RopeKVError | None:
    """The error that decides the exit code: a refused handshake, then a dead or silent rank, then any other."""
    from ..handoff.workers import rebuild_error

    results = [(o, o.result or {}) for o in outcomes]
    for _, r in results:
        if r.get("status") == "refused":
            return ContractMismatch(r.get("error", "a handshake refused a contract"), tuple(r.get("fields") or ()))
    lost = [o for o, r in results if o.exitcode is None or o.exitcode < 0 or (o.exitcode not in (0, 1) and not r)]
    transport = [(o, r) for o, r in results if r.get("status") == "transport"]
    if lost or transport:
        parts = [f"{_role(o.rank)} rank {o.rank}: {r['error']}" for o, r in transport]
        for o in lost:
            how = (
                "did not exit and was killed"
                if o.exitcode is None
                else f"was killed by signal {-o.exitcode}"
                if o.exitcode < 0
                else f"exited {o.exitcode} without a result"
            )
            tail = o.log.strip().splitlines()[-1:] if o.log.strip() else []
            parts.append(f"{_role(o.rank)} rank {o.rank} {how}" + (f" ({tail[0][:200]})" if tail else ""))
        return TransportError("handoff failed: " + "; ".join(parts))
    for o, r in results:
        if r.get("status") in ("error", "crash"):
            if r.get("traceback"):
                print(r["traceback"], file=sys.stderr)
            message = f"{_role(o.rank)} rank {o.rank}: {r.get('error')}"
            return rebuild_error(r.get("error_class"), message, r.get("fields"))
    return None


def _role(rank: int) -> str:
    return "prefill" if rank == 0 else "decode"


def _merge(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One ParityReport dict from each decode rank's: cases concatenated, verdicts combined."""
    if not reports:
        return None
    if len(reports) == 1:
        return reports[0]
    merged = dict(reports[0])
    merged["cases"] = [c for r in reports for c in r["cases"]]
    merged["passed"] = all(r["passed"] for r in reports)
    merged["diagnosis"] = next((r["diagnosis"] for r in reports if r["diagnosis"] is not None), None)
    merged["seconds"] = max(r["seconds"] for r in reports)
    merged["engine"] = dict(reports[0]["engine"], decode_workers=len(reports))
    return merged


def _facts(outcomes) -> dict[str, Any]:
    prefill = outcomes[0].result or {}
    transfers = prefill.get("transfers") or []
    payload = sum(t["payload_bytes"] for t in transfers)
    tensors = sum(t["tensor_bytes"] for t in transfers)
    seconds = sum(t["transfer_seconds"] for t in transfers)
    handshake = prefill.get("handshake")
    if handshake is None:
        refused = next((o.result for o in outcomes if o.result and o.result.get("status") == "refused"), None)
        if refused is not None:
            handshake = {"accepted": False, "message": refused.get("error"), "fields": refused.get("fields")}
    return {
        "decode_workers": len(outcomes) - 1,
        "handshake": handshake,
        "transfers": transfers,
        "payload_bytes": payload,
        "tensor_bytes": tensors,
        "overhead_bytes": payload - tensors,
        "transfer_seconds": seconds,
        "bytes_per_second": payload / seconds if seconds > 0 else None,
        "ranks": [
            {
                "rank": o.rank,
                "role": _role(o.rank),
                "exit_code": o.exitcode,
                "status": (o.result or {}).get("status"),
                "error": (o.result or {}).get("error"),
            }
            for o in outcomes
        ],
    }


def _summary(f: dict[str, Any]) -> str:
    answers = (f["handshake"] or {}).get("answers") or []
    conversions = sorted({a["conversion"] for a in answers if a.get("conversion")})
    shake = "contracts match" if not conversions else f"key form converted at import ({', '.join(conversions)})"
    rate = f"{f['bytes_per_second'] / 1e6:.1f} MB/s" if f["bytes_per_second"] else "-"
    overhead = 100.0 * f["overhead_bytes"] / max(f["tensor_bytes"], 1)
    return (
        f"handoff: {len(f['transfers'])} sequence(s) to {f['decode_workers']} decode worker(s), "
        f"handshake: {shake}; "
        f"{f['payload_bytes']} payload bytes for {f['tensor_bytes']} bytes of keys/values "
        f"(+{overhead:.1f}%), {f['transfer_seconds']:.3f} s on the wire ({rate})"
    )
