"""``ropekv handoff --engine vllm``: vLLM's disaggregated prefill, a producer and a consumer in two
processes, checked by ropekv.

1. The producer (:mod:`.vllm_role`, the engine venv's python) prefills each prompt; its connector
   writes the KV to a store directory (a temporary one unless ``store`` is given).
2. A store fault (a forged entry) is applied between the two, if asked.
3. The consumer, with the same connector, reads the store and decodes; the parity harness checks that
   decode layer by layer against the float64 reference and the consumer's own full prefill.
4. ropekv compares the two sides: their :class:`~ropekv.contract.CacheContract` (as ropekv reads each
   side's model directory: RoPE, dtype, block size, weights and config fingerprints), field by field with the
   handshake's consequence wording, and what vLLM runs on each (:class:`VLLMContract`); and reports
   what came through the connector (tokens injected vs recomputed, vLLM's ``num_cached_tokens``).

The store itself is checked too (:mod:`.vllm_entries`): each entry the consumer reads, decoded, must
hold exactly the producer's hooked post-RoPE keys of its prompt.

The verdict: the handoff holds when parity holds, the two sides' contracts agree and every entry
holds its own prompt's keys. Exit codes:
0 it holds; 1 it does not (parity fails, or the contracts differ); 2 bad input (flags, a store
directory that is missing, not a directory, not readable and writable, or without room for the
entries; checked before any vLLM starts); 3 the ``ropekv`` connector refused the stored KV (its
refusals, naming the fields); 4 a side failed, was killed or did not finish within ``timeout``
seconds (it is killed with its process group), or the store failed during the transfer (the
producer could not write it, an entry is missing). Ctrl-C kills the running side the same way.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bugs.registry import get_transfer_fault
from ..contract import CacheContract, FieldDiff, consequence
from ..errors import EngineUnavailable, RopeKVError, TransportError, UsageError
from ..faults.vllm_transfer import TransferFault, forge_entry
from ..models import resolve_model_dir
from . import vllm_role
from .refusals import read_refusals, refusal_error
from .vllm_entries import describe, entry_findings, store_diagnosis

REPORT_FORMAT = "ropekv.vllm-handoff-report"
REPORT_VERSION = 1
CONNECTORS = ("example", "ropekv")
BLOCK_SIZE = 32
FORGE_SEED_OFFSET = 1  # the forged entry's donor prompt: the token stream of seed + 1
# What vLLM runs on each side, compared field by field. ``max_position_embeddings`` is not among them:
# it sets vLLM's ``max_model_len`` and changes no key or query except under dynamic NTK, where the cache
# contract names it (``rope.max_position_embeddings``, the length its base grows past).
_COMPARED_VLLM = (
    "rope_class",
    "theta",
    "scaling_factor",
    "rotary_dim",
    "layout",
    "dtype",
    "kv_cache_dtype",
    "kernel_isa",
    "block_size",
)


@dataclass(frozen=True)
class Options:
    """One vLLM handoff run. ``model``: a transformers directory (None: the embedded SmolLM2);
    ``lengths``: one prompt each; ``timeout``: seconds each side may take; ``store``: a directory to
    keep the store in (None: a temporary one); ``python``: the interpreter the sides run under."""

    model: str | None = None
    connector: str = "example"
    lengths: tuple[int, ...] = (70,)
    decode_steps: int = 2
    seed: int = 0
    dtype: str = "float32"
    timeout: float = 600.0
    fault: str | None = None
    store: str | None = None
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise UsageError(f"--connector must be one of {', '.join(CONNECTORS)}, got {self.connector!r}")
        if not self.lengths or not all(isinstance(n, int) and 1 <= n <= 8192 for n in self.lengths):
            raise UsageError(f"lengths must be integers in [1, 8192], got {list(self.lengths)}")
        if len(set(self.lengths)) != len(self.lengths):
            raise UsageError(f"lengths must be distinct (one store entry each), got {list(self.lengths)}")
        if any(n <= BLOCK_SIZE for n in self.lengths):
            raise UsageError(
                f"lengths must exceed one block ({BLOCK_SIZE} tokens): vLLM's connectors store whole blocks "
                f"of the prompt but its last token, so a shorter prompt transfers nothing; got {list(self.lengths)}"
            )
        if not isinstance(self.decode_steps, int) or not 1 <= self.decode_steps <= 64:
            raise UsageError(f"decode steps must be an integer in [1, 64], got {self.decode_steps!r}")
        if not (isinstance(self.timeout, int | float) and 1 <= self.timeout <= 86_400):
            raise UsageError(f"timeout must be in [1, 86400] seconds, got {self.timeout!r}")
        if self.fault is not None:
            get_transfer_fault(self.fault)


# ---------------------------------------------------------------------- the children


@dataclass(frozen=True)
class RoleOutcome:
    role: str
    returncode: int
    result: dict[str, Any] | None
    log_tail: str
    seconds: float


def run_role(
    role: str, argv: list[str], *, timeout: float, result: Path, log: Path, env: dict[str, str] | None = None
) -> RoleOutcome:
    """Run ``argv`` (one side) in its own process group, output to ``log``; wait at most ``timeout``
    seconds. A side that is still running then, or when Ctrl-C arrives, is killed with its whole
    group (vLLM starts helper processes) and reaped: TransportError (timeout) or KeyboardInterrupt."""
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise TransportError(
                f"vLLM {role} did not finish within {timeout:g} s and was killed{_tail_note(log)}"
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
    doc = None
    if result.exists():
        try:
            doc = json.loads(result.read_text())
        except (OSError, ValueError):
            doc = None
    return RoleOutcome(role, proc.returncode, doc, _tail(log), time.monotonic() - started)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _tail_note(log: Path) -> str:
    tail = _tail(log)
    return f" (last output: {tail})" if tail else ""


def _outcome_error(o: RoleOutcome) -> RopeKVError | None:
    """The error a finished side reports, as the class it raised; a side without a result failed."""
    from .workers import rebuild_error

    r = o.result
    if r is not None and r.get("status") == "ok":
        return None
    if r is None:
        how = f"was killed by signal {-o.returncode}" if o.returncode < 0 else f"exited {o.returncode} without a result"
        return TransportError(f"vLLM {o.role} {how}" + (f" ({o.log_tail})" if o.log_tail else ""))
    if r.get("status") == "crash":
        message = str(r.get("error"))
        if "No space left on device" in message or "Errno 28" in message:
            return TransportError(f"vLLM {o.role}: the store is full: {message}")
        return TransportError(f"vLLM {o.role} failed: {message}")
    return rebuild_error(r.get("error_class"), f"vLLM {o.role}: {r.get('error')}", r.get("fields"))


# ---------------------------------------------------------------------- the store


def entry_bytes(model_dir: Path, length: int) -> int:
    """Bytes one prompt's entry takes in the store (float32 upper bound): every layer's keys and values
    of the whole blocks of the prompt."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        layers, kv_heads = int(config["num_hidden_layers"]), int(config["num_key_value_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 0  # the sides refuse the model themselves, with their own message
    return layers * length * kv_heads * 2 * head_dim * 4


def check_store(store: Path, need: int) -> None:
    """A store directory the run can use: it exists, is a directory, is readable and writable, and has
    room for ``need`` bytes. UsageError (exit 2) naming what is wrong."""
    if not store.exists():
        raise UsageError(f"store {store}: no such directory")
    if not store.is_dir():
        raise UsageError(f"store {store}: not a directory")
    if not os.access(store, os.R_OK | os.W_OK | os.X_OK):
        raise UsageError(f"store {store}: not readable and writable by this user")
    free = shutil.disk_usage(store).free
    if free < need:
        raise UsageError(f"store {store}: full ({free} bytes free, the entries need {need})")


def _store_files(store: Path) -> dict[str, int]:
    return {str(p.relative_to(store)): p.stat().st_size for p in sorted(store.rglob("*.safetensors")) if p.is_file()}


# ---------------------------------------------------------------------- the comparison


@dataclass(frozen=True)
class Difference:
    """One field the two sides disagree on: ``FieldDiff(field, ours=consumer, theirs=producer)``."""

    diff: FieldDiff
    consequence: str

    def describe(self) -> str:
        d = self.diff
        return f"{d.field}: consumer={d.ours!r}, producer={d.theirs!r} ({self.consequence})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "field": self.diff.field,
            "consumer": self.diff.ours,
            "producer": self.diff.theirs,
            "consequence": self.consequence,
        }


def compare_sides(producer: dict[str, Any], consumer: dict[str, Any]) -> tuple[list[Difference], list[FieldDiff]]:
    """The cache-contract differences (each with its consequence: the consumer reads what the producer
    wrote), and the differences of what vLLM runs on each side (its VLLMContract)."""
    theirs = CacheContract.from_json(json.dumps(producer["cache_contract"]))
    ours = CacheContract.from_json(json.dumps(consumer["cache_contract"]))
    contract = [Difference(d, consequence(d)) for d in ours.diff(theirs)]
    runs = [
        FieldDiff(name, consumer["contract"].get(name), producer["contract"].get(name))
        for name in _COMPARED_VLLM
        if consumer["contract"].get(name) != producer["contract"].get(name)
    ]
    return contract, runs


# ---------------------------------------------------------------------- the run


def run(options: Options) -> dict[str, Any]:
    """Run one handoff and return its report (a JSON-ready dict; ``"exit_code"`` is the verdict's).
    Errors that stop the run are raised (module docstring for their exit codes)."""
    require_vllm()
    fault = get_transfer_fault(options.fault) if options.fault else None
    prompts = prompts_for(options, forge=fault is not None and fault.forge)
    source = model_dir(options.model)
    need = sum(entry_bytes(source, n) for n, _ in prompts) + 2**20
    with tempfile.TemporaryDirectory(prefix="ropekv-vllm-handoff-") as tmp:
        work = Path(tmp)
        store = Path(options.store) if options.store else work / "store"
        if options.store is None:
            store.mkdir()
        check_store(store, need)
        started = time.monotonic()
        producer = produce(options, store, work, prompts)
        return consume(options, store, work, producer, started=started)


def require_vllm() -> None:
    """EngineUnavailable unless vLLM is importable by this interpreter (which the sides run under)."""
    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable(
            "vLLM is not importable here: run ropekv handoff --engine vllm from the engine venv "
            "(.venv-vllm/bin/ropekv, make setup-vllm)"
        )


def prompts_for(options: Options, *, forge: bool) -> list[tuple[int, int]]:
    """``(length, seed)`` of every prompt the producer prefills: one per length, then (``forge``) the
    donor of a forged entry, the first length of the next seed's token stream."""
    prompts = [(n, options.seed) for n in options.lengths]
    return prompts + [(options.lengths[0], options.seed + FORGE_SEED_OFFSET)] if forge else prompts


def _side(role: str, options: Options, work: Path, argv_spec: dict[str, Any]) -> RoleOutcome:
    out_dir = work / role
    out_dir.mkdir(parents=True)
    (out_dir / "spec.json").write_text(json.dumps(argv_spec))
    argv = [options.python, "-m", "ropekv.handoff.vllm_role", str(out_dir / "spec.json"), str(out_dir / "result.json")]
    return run_role(role, argv, timeout=options.timeout, result=out_dir / "result.json", log=out_dir / "log.txt")


def produce(options: Options, store: Path, work: Path, prompts: list[tuple[int, int]]) -> RoleOutcome:
    """The producer side: prefill ``prompts`` into ``store``; raises what it failed with, and
    TransportError if a prompt did not get exactly one store entry."""
    spec = vllm_role.spec(
        "producer",
        model_dir=options.model,
        dtype=options.dtype,
        block_size=BLOCK_SIZE,
        store=str(store),
        connector=options.connector,
        prompts=prompts,
        decode_steps=options.decode_steps,
        fault=None,
    )
    outcome = _side("producer", options, work, spec)
    error = _outcome_error(outcome)
    if error is not None:
        raise error
    for p in (outcome.result or {}).get("prompts") or []:
        if len(p["entries"]) != 1 or not (store / p["entries"][0]).is_dir():
            raise TransportError(
                f"the producer's connector wrote {len(p['entries'])} store entries for the {p['length']}-token "
                f"prompt (expected 1) in {store}"
            )
    return outcome


def consume(
    options: Options, store: Path, work: Path, producer: RoleOutcome, *, started: float | None = None
) -> dict[str, Any]:
    """The consumer side over ``store`` as ``producer`` left it (the fault of ``options`` applied:
    a changed model directory in ``work``, a forged entry in ``store``), and the report."""
    started = time.monotonic() if started is None else started
    run = uuid.uuid4().hex  # marks this consumer's refusals in the store's log
    fault = get_transfer_fault(options.fault) if options.fault else None
    prompts = (producer.result or {})["prompts"]
    if fault is not None and fault.forge:
        if len(prompts) <= len(options.lengths):
            raise UsageError("a forged entry needs the producer to have prefilled the donor prompt (prompts_for)")
        forge_entry(store, store / prompts[0]["entries"][0], store / prompts[len(options.lengths)]["entries"][0])
    stored = _store_files(store)
    entries = entry_findings(store, producer.result or {}, len(options.lengths))
    consumer_dir = options.model
    if fault is not None and fault.own_model_dir:
        consumer_dir = str(fault.consumer_model_dir(model_dir(options.model), work / "consumer-model"))
    spec = vllm_role.spec(
        "consumer",
        model_dir=consumer_dir,
        dtype=(fault.consumer_dtype if fault else None) or options.dtype,
        block_size=BLOCK_SIZE,
        store=str(store),
        connector=options.connector,
        prompts=[(p["length"], p["seed"]) for p in prompts[: len(options.lengths)]],
        decode_steps=options.decode_steps,
        fault=None if fault is None else fault.name,
        run=run,
    )
    outcome = _side("consumer", options, work, spec)
    refused = refusal_error(read_refusals(store, run))  # this run's: the store's log outlives runs
    if refused is not None:
        raise refused
    error = _outcome_error(outcome)
    if error is not None:
        raise _named(error, producer, outcome)
    sides = {"producer": producer, "consumer": outcome}
    doc = _report(options, fault, sides, stored, _store_files(store), time.monotonic() - started)
    doc["store_entries"] = entries
    wrong = [e for e in entries if e["holds"] != e["prompt"]]
    doc["passed"] = doc["passed"] and not wrong
    doc["exit_code"] = 0 if doc["passed"] else 1
    return doc


def _named(error: RopeKVError, producer: RoleOutcome, consumer: RoleOutcome) -> RopeKVError:
    """A consumer that failed after it started: where the two sides' contracts differ, the failure is
    the transfer's (vLLM failed on the foreign KV): TransportError naming the fields."""
    side = (consumer.result or {}).get("side")
    if side is None:
        return error
    contract, _ = compare_sides((producer.result or {})["side"], side)
    if not contract:
        return error
    named = "; ".join(d.describe() for d in contract)
    return TransportError(f"{error} -- the sides' cache contracts differ in {len(contract)} field(s): {named}")


def _report(
    options: Options,
    fault: TransferFault | None,
    sides: dict[str, RoleOutcome],
    stored: dict[str, int],
    after: dict[str, int],
    seconds: float,
) -> dict[str, Any]:
    producer, consumer = sides["producer"].result or {}, sides["consumer"].result or {}
    contract, runs = compare_sides(producer["side"], consumer["side"])
    parity = consumer["report"]
    kept = producer["prompts"][: len(options.lengths)]
    first_change = [
        {
            "length": p["length"],
            "producer_first_logprob": p["first_logprob"],
            "consumer_first_logprob": lp[0],
            "change": lp[0] - p["first_logprob"],
        }
        for p, lp in zip(kept, consumer["logprobs"])
    ]
    passed = bool(parity["passed"]) and not contract
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "passed": passed,
        "exit_code": 0 if passed else 1,
        "connector": options.connector,
        "fault": None if fault is None else {"name": fault.name, "kind": str(fault.kind), "fields": list(fault.fields)},
        "producer": producer["side"],
        "consumer": consumer["side"],
        "contract_differences": [d.to_dict() for d in contract],
        "vllm_differences": [{"field": d.field, "consumer": d.ours, "producer": d.theirs} for d in runs],
        "transfer": {
            "prompts": [{k: p[k] for k in ("length", "seed", "entries")} for p in producer["prompts"]],
            "store_files": len(stored),
            "store_bytes": sum(stored.values()),
            "store_changed_by_consumer": after != stored,
            "counters": consumer["counters"],
        },
        "first_token_logprobs": first_change,
        "seconds": {
            "producer": round(sides["producer"].seconds, 1),
            "consumer": round(sides["consumer"].seconds, 1),
            "total": round(seconds, 1),
        },
        "table": consumer["table"],
        "parity": parity,
    }


def summary(doc: dict[str, Any]) -> str:
    """The lines printed after the consumer's parity table."""
    t = doc["transfer"]
    p, c = doc["producer"], doc["consumer"]
    lines = [
        f"handoff: {p['name']} -> {c['name']}; store: {t['store_files']} files, {t['store_bytes']} bytes"
        + (" (the consumer changed it)" if t["store_changed_by_consumer"] else ""),
    ]
    for n in t["counters"]:
        lines.append(
            f"connector: {n['injected_tokens']} of {n['prompt_tokens']} prompt tokens injected, "
            f"{n['recomputed_tokens']} recomputed (vLLM num_cached_tokens {n['num_cached_tokens']})"
        )
    for f in doc["first_token_logprobs"]:
        lines.append(
            f"first-token logprob ({f['length']} tokens): producer {f['producer_first_logprob']:.4f}, "
            f"consumer {f['consumer_first_logprob']:.4f} (change {f['change']:+.4f})"
        )
    lines += [describe(e) for e in doc.get("store_entries", [])]
    if doc["contract_differences"]:
        lines.append(f"contract: the sides differ in {len(doc['contract_differences'])} field(s):")
        lines += [
            f"  {d['field']}: consumer={d['consumer']!r}, producer={d['producer']!r} ({d['consequence']})"
            for d in doc["contract_differences"]
        ]
    else:
        lines.append("contract: producer and consumer agree (RoPE, dtype, block size, weights and config fingerprints)")
    if doc["vllm_differences"]:
        lines.append(
            "vLLM runs: "
            + "; ".join(
                f"{d['field']} consumer={d['consumer']!r} producer={d['producer']!r}" for d in doc["vllm_differences"]
            )
        )
    # the store check's own finding first: a value mismatch read by the parity forensics alone would
    # be given the RoPE class whose errors it happens to resemble
    diagnosis = store_diagnosis(doc.get("store_entries", [])) or (doc["parity"].get("diagnosis") or {}).get("kind")
    verdict = "holds" if doc["passed"] else "FAILS"
    why = (
        []
        if doc["passed"]
        else (["parity fails"] if not doc["parity"]["passed"] else [])
        + (["contracts differ"] if doc["contract_differences"] else [])
    )
    lines.append(
        f"handoff {verdict}"
        + (f" ({', '.join(why)})" if why else "")
        + (f"; forensics: {diagnosis}" if diagnosis else "")
    )
    return "\n".join(lines)


def model_dir(model: str | None) -> Path:
    """The model directory both sides start from (None: the embedded SmolLM2's)."""
    folder = resolve_model_dir(model)  # None or an embedded model's name: its converted folder
    if not folder.is_dir():
        raise UsageError(f"{folder}: --engine vllm needs a transformers model directory")
    return folder
