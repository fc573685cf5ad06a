"""One side of a vLLM disaggregated handoff, in its own process: ``python -m ropekv.handoff.vllm_role SPEC RESULT``.

Run by :mod:`.vllm_driver` with the engine venv's python (the parent never imports vLLM). ``SPEC`` is
a JSON object (:func:`spec` writes it); the role writes one JSON object to ``RESULT`` (atomically:
a file that exists is complete) with ``"status"``: ``"ok"``, ``"error"`` (a ropekv error: its class
and message) or ``"crash"`` (anything else, with the traceback).

- producer: starts a :class:`~ropekv.adapters.vllm.disagg.ConnectorProducer`, prefills each prompt
  (the seeded token stream of each ``(length, seed)``) and records, per prompt, the store entry
  directory its connector created, its first-token log-probability and its hooked post-RoPE keys and
  values (``keys.safetensors`` beside the result, tensors ``p{prompt}.l{layer}`` and ``p{prompt}.v{layer}``
  ``[L, KVH, D]``).
- consumer: starts a :class:`~ropekv.adapters.vllm.disagg.ConnectorConsumer` (with the fault's patch,
  if any) and runs the parity harness on one case per length: its decode against the float64
  reference and against its own full prefill, layer by layer.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from ..contract import CacheContract
from ..errors import RopeKVError, UsageError

KEYS_FILE = "keys.safetensors"


def spec(
    role: str,
    *,
    model_dir: str | None,
    dtype: str,
    block_size: int,
    store: str,
    connector: str,
    prompts: list[tuple[int, int]],
    decode_steps: int,
    fault: str | None,
    run: str | None = None,
) -> dict[str, Any]:
    """The SPEC object of one role (``prompts``: ``(length, seed)`` each; the consumer runs the first
    one's seed for its cases; ``run``: the id its connector marks its refusals with)."""
    return {
        "role": role,
        "model_dir": model_dir,
        "dtype": dtype,
        "block_size": block_size,
        "store": store,
        "connector": connector,
        "prompts": [list(p) for p in prompts],
        "decode_steps": decode_steps,
        "fault": fault,
        "run": run,
    }


def _contract(engine) -> dict[str, Any]:
    """The :class:`CacheContract` of what this side's cache holds, as ropekv reads its model directory."""
    contract = CacheContract.for_model(
        engine.checkpoint.config,
        key_form="rotated",
        block_size=engine.block_size,
        dtype=engine.dtype_name,
        weights_fingerprint=engine.checkpoint.weights_fingerprint,
    )
    return contract.to_dict()


def _entries(store: Path) -> set[str]:
    return {p.name for p in store.iterdir() if p.is_dir()}


def _producer(s: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    from ..adapters.vllm.disagg import ConnectorProducer, SideFacts
    from ..parity.cases import token_stream

    store = Path(s["store"])
    engine = ConnectorProducer(
        s["model_dir"], store=store, connector=s["connector"], dtype=s["dtype"], block_size=s["block_size"]
    )
    vocab = engine.checkpoint.config.vocab_size
    prompts, tensors = [], {}
    for k, (length, seed) in enumerate(s["prompts"]):
        ids = token_stream(vocab, length, seed).tolist()
        before = _entries(store)
        produced = engine.produce(ids)
        new = sorted(_entries(store) - before)
        for i, (keys, values) in enumerate(zip(produced.keys, produced.values)):
            tensors[f"p{k}.l{i}"] = keys.contiguous()
            tensors[f"p{k}.v{i}"] = values.contiguous()
        prompts.append(
            {
                "length": length,
                "seed": seed,
                "token_ids": ids,
                "entries": new,
                "first_logprob": produced.first_logprob,
                "num_cached_tokens": produced.num_cached_tokens,
            }
        )
    save_file({k: v.to(torch.float32) for k, v in tensors.items()}, str(out_dir / KEYS_FILE))
    side = SideFacts.of("producer", engine, cache_contract=_contract(engine))
    return {"status": "ok", "side": side.to_dict(), "prompts": prompts, "keys": str(out_dir / KEYS_FILE)}


def _consumer(s: dict[str, Any]) -> dict[str, Any]:
    from ..adapters.vllm.disagg import ConnectorConsumer, SideFacts
    from ..bugs.registry import EXPLANATIONS, get_transfer_fault
    from ..parity.cases import Case
    from ..parity.harness import check

    fault = get_transfer_fault(s["fault"]) if s["fault"] else None
    engine = ConnectorConsumer(
        s["model_dir"],
        store=Path(s["store"]),
        connector=s["connector"],
        run=s.get("run"),
        dtype=s["dtype"],
        block_size=s["block_size"],
        enable_prefix_caching=True,
    )
    seed = int(s["prompts"][0][1])
    cases = [
        Case(length=int(length), block_size=s["block_size"], decode_steps=s["decode_steps"])
        for length, _ in s["prompts"]
    ]
    side = SideFacts.of("consumer", engine, cache_contract=_contract(engine))
    undo = fault.install(engine) if fault is not None else (lambda: None)
    try:
        report = check(engine, cases=cases, seed=seed, explanations=EXPLANATIONS)
    except Exception as exc:  # the side's facts go back with the error: the parent names what differs
        doc = _error_doc(exc)
        doc["side"] = side.to_dict()
        return doc
    finally:
        undo()
    return {
        "status": "ok",
        "side": side.to_dict(),
        "report": report.to_dict(),
        "table": report.table(),
        "counters": engine.case_counters,
        "logprobs": engine.case_logprobs,
    }


def _error_doc(exc: Exception) -> dict[str, Any]:
    """A ropekv error as its class and message; anything else as a crash, with the traceback."""
    if isinstance(exc, RopeKVError):
        return {
            "status": "error",
            "error_class": type(exc).__name__,
            "error": str(exc),
            "fields": list(getattr(exc, "fields", ()) or ()),
        }
    return {"status": "crash", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m ropekv.handoff.vllm_role SPEC RESULT", file=sys.stderr)
        return 2
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    try:
        s = json.loads(spec_path.read_text())
        if s.get("role") == "producer":
            doc = _producer(s, result_path.parent)
        elif s.get("role") == "consumer":
            doc = _consumer(s)
        else:
            raise UsageError(f"role must be producer or consumer, got {s.get('role')!r}")
    except Exception as exc:
        doc = _error_doc(exc)
    _write(result_path, doc)
    return 0 if doc["status"] == "ok" else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
