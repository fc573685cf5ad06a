"""Finding: what vLLM's ExampleConnector lets through between a producer and a consumer, how ropekv
names each fault on the bare connector, and what ropekv's ContractConnector refuses.

Per connector (``--connector example``, ``ropekv`` or ``both``, the default): one producer of that
connector (float32, block 32) prefills a 70-token prompt and a donor prompt (the next seed's stream)
into a store; then, for the correct handoff and each fault of
``ropekv.bugs.registry.VLLM_TRANSFER_FAULTS``, a fresh copy of that store is read by a consumer of
the same connector (its own process) that decodes 2 steps under the parity harness. Printed per row,
as it runs: the first-token log-probability change (consumer minus producer: the token computed over
the injected KV), the worst logit error against the float64 reference, the consumer's verdict, the
tokens injected, whose keys the store entry holds (decoded, against the producer's hooked keys), the
contract fields that differ between the two sides and the bug class the forensics name; or the error
the run stopped with (exit 3: the contract connector's refusal, naming its fields). At the end, one
table: each row's exit code of ``ropekv handoff --engine vllm`` per connector and what it named.

    .venv-vllm/bin/python scripts/findings/vllm_connector_faults.py [passes] [--connector both]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def _named(doc: dict[str, Any]) -> str:
    """What a finished run named: the differing contract fields and the forensics' bug class."""
    fields = ",".join(x["field"] for x in doc["contract_differences"]) or "-"
    kind = (doc["parity"].get("diagnosis") or {}).get("kind") or "-"
    return f"contract: {fields}; forensics: {kind}"


def _detail(doc: dict[str, Any]) -> str:
    case = doc["parity"]["cases"][0]
    vllm = ",".join(x["field"] for x in doc["vllm_differences"])
    entry = doc["store_entries"][0]
    held = "own prompt" if entry["holds"] == 0 else f"prompt #{entry['holds']}" if entry["holds"] else "no prompt"
    n = doc["transfer"]["counters"][0]
    return (
        f"{doc['first_token_logprobs'][0]['change']:+9.4f} {case['max_abs_logit_diff']:8.3g} "
        f"{'PASS' if doc['parity']['passed'] else 'FAIL':>6s} {n['injected_tokens']:>4d}/{n['prompt_tokens']:<3d}  "
        f"entry: {held}; {_named(doc)}" + (f"; vLLM runs other {vllm}" if vllm else "")
    )


def column(connector: str, names: list[str | None]) -> dict[str | None, tuple[int, str]]:
    """Run the producer and every row's consumer of ``connector``; ``{row: (exit code, what it named)}``."""
    from ropekv.errors import ContractMismatch, RopeKVError
    from ropekv.handoff import vllm_driver as d

    out: dict[str | None, tuple[int, str]] = {}
    with tempfile.TemporaryDirectory(prefix="ropekv-connector-faults-") as tmp:
        work = Path(tmp)
        base = d.Options(timeout=900, connector=connector)
        (work / "store").mkdir()
        started = time.monotonic()
        producer = d.produce(base, work / "store", work / "p", d.prompts_for(base, forge=True))
        print(
            f"{connector} connector: producer {producer.seconds:.0f} s; store {len(list((work / 'store').iterdir()))} entries"
        )
        print(f"{'consumer':24s} {'dlogprob1':>9s} {'max err':>8s} {'parity':>6s} {'injected':>8s}  named", flush=True)
        for k, name in enumerate(names):
            store = work / f"store{k}"
            shutil.copytree(work / "store", store)
            opts = d.Options(timeout=900, fault=name, connector=connector)
            t0 = time.monotonic()
            try:
                doc = d.consume(opts, store, work / f"c{k}", producer)
            except ContractMismatch as exc:  # the contract connector refused: the fields it named
                out[name] = (exc.exit_code, "refused: " + ", ".join(exc.fields))
                text = str(exc) if len(str(exc)) <= 400 else str(exc)[:400] + " ..."
                print(f"{name or 'correct':24s} refused (exit {exc.exit_code}) [{time.monotonic() - t0:.0f} s]: {text}")
                continue
            except RopeKVError as exc:  # the consumer failed: print what it said
                out[name] = (exc.exit_code, f"{type(exc).__name__}: {str(exc)[:120]}")
                print(f"{name or 'correct':24s} {type(exc).__name__} (exit {exc.exit_code}): {exc}", flush=True)
                continue
            out[name] = (doc["exit_code"], _named(doc))
            print(f"{name or 'correct':24s} {_detail(doc)}  [{time.monotonic() - t0:.0f} s]", flush=True)
        print(f"{connector} connector: {time.monotonic() - started:.0f} s", flush=True)
    return out


if __name__ == "__main__":
    from ropekv.bugs.registry import VLLM_TRANSFER_FAULTS
    from ropekv.handoff import vllm_driver as d

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("passes", nargs="?", type=int, default=1)
    parser.add_argument("--connector", choices=("example", "ropekv", "both"), default="both")
    args = parser.parse_args()
    connectors = list(d.CONNECTORS) if args.connector == "both" else [args.connector]
    names = [None, *VLLM_TRANSFER_FAULTS]
    d.require_vllm()
    for run in range(1, args.passes + 1):
        print(f"pass {run}")
        columns = {c: column(c, names) for c in connectors}
        print(f"\npass {run}: exit code of ropekv handoff --engine vllm --inject FAULT, per connector")
        print(f"{'fault':24s} " + " | ".join(f"{c:>7s} exit  named" for c in connectors))
        for name in names:
            cells = [f"{columns[c][name][0]:>12d}  {columns[c][name][1]}" for c in connectors]
            print(f"{name or 'correct':24s} " + " | ".join(cells))
