"""``ropekv handoff``: prefill on one worker, hand the KV cache off, decode on others, check parity.

``--engine ropekv`` (the default): ropekv's own workers. Starts a prefill rank and ``--decode-workers`` decode ranks on 127.0.0.1 (torch.distributed, gloo;
``ropekv.handoff.workers``), prints each decode rank's parity table (prefill on worker A + decode on
worker B against full forwards) and the transfer facts. Exit codes as ``ropekv check``: 0 parity
holds, 1 it does not, 2 bad input, 3 a handshake refused a contract, 4 a worker failed or went silent.

``--engine vllm --connector {example,ropekv}``: vLLM's disaggregated prefill, a producer and a consumer
vLLM instance in two processes sharing a connector's store (``ropekv.handoff.vllm_driver``; run from
the engine venv). Exit codes: 0 the handoff holds (parity, and the two sides' contracts agree), 1 it
does not, 2 bad input (flags; a ``--store`` that is missing, not a directory, not readable and
writable, or without room), 3 the ``ropekv`` connector refused the stored KV (the fields named), 4 a
side failed, was killed, ran past ``--timeout`` (then killed with its process group) or the store
failed during the transfer. Defaults there: ``--lengths 70 --decode-steps 2 --timeout 600``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ContractMismatch, RopeKVError, TransportError, UsageError
from .options import worker_count, writable_path

ENGINES = ("ropekv", "vllm", "mlx", "llamacpp")
# Engines whose transfer check lives in their adapter: ``add_arguments(group)`` and ``run(args) -> int``.
ADAPTER_HANDOFFS = {
    "mlx": "mlx-lm prompt cache (--engine mlx)",
    "llamacpp": "llama.cpp sequence state (--engine llamacpp)",
}
# Defaults that depend on the engine: the flags' own default is None, filled in here.
ROPEKV_DEFAULTS = {"lengths": [1, 17, 300], "decode_steps": 3, "timeout": 60.0}
VLLM_DEFAULTS = {"lengths": [70], "decode_steps": 2, "timeout": 600.0}

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
    from ..bugs.registry import HANDOFF_FAULTS, VLLM_TRANSFER_FAULTS

    add_arguments(p, cli=True, inject_choices=(*HANDOFF_FAULTS, *VLLM_TRANSFER_FAULTS))
    p.set_defaults(lengths=None, decode_steps=None, timeout=None)
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="ropekv",
        help="ropekv: ropekv's own prefill/decode workers (default); vllm: two vLLM instances and a KV connector; "
        "mlx: an mlx-lm prompt cache saved by one model and loaded by another; "
        "llamacpp: a llama.cpp sequence state moved into a fresh context",
    )
    p.add_argument(
        "--connector",
        choices=("example", "ropekv"),
        default="example",
        help="--engine vllm: vLLM's ExampleConnector (default) or ropekv's contract-carrying ContractConnector",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="DIR",
        help="--engine vllm: keep the connector's store in this existing directory (default: a temporary one)",
    )
    p.add_argument("--list-faults", action="store_true", help="list the handoff fault catalogue and exit")
    p.add_argument(
        "--decode-workers", type=worker_count, default=1, help="decode worker processes (default 1, at most 64)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the parity report and handoff facts here")
    owned: dict[str, dict[str, tuple[str, Any]]] = {}  # engine -> its flags' dests (flag, default)
    for engine, title in ADAPTER_HANDOFFS.items():
        group = p.add_argument_group(title)
        if engine == "llamacpp":  # the engine's own flags (GGUF file, KV types, context size) first
            from ..adapters import llamacpp

            llamacpp.add_arguments(group)
        _adapter_handoff(engine).add_arguments(group)
        owned[engine] = {a.dest: (a.option_strings[0], a.default) for a in group._group_actions}
    p.set_defaults(handler=run, engine_flags=owned)


def _adapter_handoff(engine: str) -> ModuleType:
    """The adapter module with ``add_arguments(group)`` and ``run(args) -> int`` for ``engine``."""
    if engine == "mlx":
        from ..adapters.mlx import handoff as mlx_handoff

        return mlx_handoff
    if engine == "llamacpp":
        from ..adapters.llamacpp import handoff as llamacpp_handoff

        return llamacpp_handoff
    raise UsageError(f"no transfer check for --engine {engine}")


def run(args: argparse.Namespace) -> int:
    for engine, flags in getattr(args, "engine_flags", {}).items():
        stray = [
            flag for dest, (flag, default) in flags.items() if engine != args.engine and getattr(args, dest) != default
        ]
        if stray:
            raise UsageError(
                f"{', '.join(stray)}: only taken by --engine {engine} (this run is --engine {args.engine})"
            )
    if args.engine == "vllm":
        return _run_vllm(args)
    if args.engine in ADAPTER_HANDOFFS:
        return _run_adapter(args)
    _fill_defaults(args, ROPEKV_DEFAULTS)
    if args.list_faults:
        from ..bugs.registry import HANDOFF_FAULTS, listing

        for f in HANDOFF_FAULTS.values():
            print(listing(f))
        return 0
    from ..bugs.registry import HANDOFF_FAULTS

    if args.inject is not None and args.inject not in HANDOFF_FAULTS:
        raise UsageError(f"--inject {args.inject} is a vLLM transfer fault: use it with --engine vllm")
    return _run_ropekv(args)


def _fill_defaults(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


# Flags of ropekv's own workers that vLLM's handoff does not take (their parser defaults).
_ROPEKV_ONLY = {
    "block_sizes": [16],
    "key_form_prefill": "rotated",
    "key_form_decode": None,
    "convert": "never",
    "decode_rope_theta": None,
    "save_payload": None,
    "dist_backend": "auto",
    "decode_workers": 1,
}


def _run_vllm(args: argparse.Namespace) -> int:
    from ..bugs.registry import VLLM_TRANSFER_FAULTS, listing
    from ..handoff import vllm_driver

    if args.list_faults:
        for f in VLLM_TRANSFER_FAULTS.values():
            print(listing(f))
        return 0
    given = [name for name, default in _ROPEKV_ONLY.items() if getattr(args, name) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{flags}: not taken by --engine vllm (ropekv's own workers only)")
    if args.inject is not None and args.inject not in VLLM_TRANSFER_FAULTS:
        raise UsageError(
            f"--inject {args.inject} is not a vLLM transfer fault; choose one of: {', '.join(VLLM_TRANSFER_FAULTS)}"
        )
    _fill_defaults(args, VLLM_DEFAULTS)
    json_path = writable_path(args.json, "--json")
    options = vllm_driver.Options(
        model=args.model,
        connector=args.connector,
        lengths=tuple(args.lengths),
        decode_steps=args.decode_steps,
        seed=args.seed,
        dtype=args.dtype,
        timeout=args.timeout,
        fault=args.inject,
        store=args.store,
    )
    doc = vllm_driver.run(options)
    print(doc["table"])
    print(vllm_driver.summary(doc))
    if json_path is not None:
        json_path.write_text(json.dumps(doc, indent=2, allow_nan=False, default=str))
    return int(doc["exit_code"])


def _run_adapter(args: argparse.Namespace) -> int:
    """An engine whose transfer check its adapter runs in this process (mlx-lm's prompt caches)."""
    if args.list_faults:
        raise UsageError(
            f"--list-faults: --engine {args.engine} has no fault catalogue (its flags set the reader apart)"
        )
    common: dict[str, Any] = {
        "connector": "example",
        "store": None,
        "inject": None,
        "lengths": None,
        "decode_steps": None,
        "timeout": None,
        "dtype": "float32",
        "seed": 0,
    }
    if args.engine == "mlx":
        common["json"] = None  # the mlx check prints its table; it writes no report
    given = [n for n, default in {**_ROPEKV_ONLY, **common}.items() if getattr(args, n, default) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{flags}: not taken by --engine {args.engine} (see ropekv handoff --help for its own flags)")
    return int(_adapter_handoff(args.engine).run(args))


def _run_ropekv(args: argparse.Namespace) -> int:
    from ..handoff.workers import launch, worker_argv

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
