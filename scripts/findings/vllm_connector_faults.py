"""Finding: what vLLM's ExampleConnector lets through between a producer and a consumer, and how
ropekv names each fault on the bare connector.

One producer (float32, block 32) prefills a 70-token prompt and a donor prompt (the next seed's
stream) into a store; then, for the correct handoff and each fault of
``ropekv.faults.registry.VLLM_TRANSFER_FAULTS``, a fresh copy of that store is read by a consumer
(its own process) that decodes 2 steps under the parity harness. Printed per row: the first-token
log-probability change (consumer minus producer: the token computed over the injected KV), the
worst top-k log-probability error against the float64 reference, the consumer's verdict, whose
keys the store entry holds (decoded, against the producer's hooked keys), the contract fields that differ between the two sides, and the bug class the forensics name.

    .venv-vllm/bin/python scripts/findings/vllm_connector_faults.py [passes]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    from ropekv.errors import RopeKVError
    from ropekv.faults.registry import VLLM_TRANSFER_FAULTS
    from ropekv.handoff import vllm_driver as d

    passes = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    names = [None, *VLLM_TRANSFER_FAULTS]
    d.require_vllm()
    for run in range(1, passes + 1):
        with tempfile.TemporaryDirectory(prefix="ropekv-connector-faults-") as tmp:
            work = Path(tmp)
            base = d.Options(timeout=900)
            (work / "store").mkdir()
            started = time.monotonic()
            producer = d.produce(base, work / "store", work / "p", d.prompts_for(base, forge=True))
            print(
                f"pass {run}: producer {producer.seconds:.0f} s; store {len(list((work / 'store').iterdir()))} entries"
            )
            print(f"{'consumer':24s} {'dlogprob1':>9s} {'max err':>8s} {'parity':>6s} {'injected':>8s}  named")
            for k, name in enumerate(names):
                store = work / f"store{k}"
                shutil.copytree(work / "store", store)
                opts = d.Options(timeout=900, fault=name)
                try:
                    doc = d.consume(opts, store, work / f"c{k}", producer)
                except RopeKVError as exc:  # the consumer failed or refused: print what it said
                    print(f"{name or 'correct':24s} {type(exc).__name__} (exit {exc.exit_code}): {exc}")
                    continue
                case = doc["parity"]["cases"][0]
                fields = ",".join(x["field"] for x in doc["contract_differences"]) or "-"
                kind = (doc["parity"].get("diagnosis") or {}).get("kind") or "-"
                vllm = ",".join(x["field"] for x in doc["vllm_differences"])
                entry = doc["store_entries"][0]
                held = (
                    "own prompt"
                    if entry["holds"] == 0
                    else f"prompt #{entry['holds']}"
                    if entry["holds"]
                    else "no prompt"
                )
                n = doc["transfer"]["counters"][0]
                print(
                    f"{name or 'correct':24s} {doc['first_token_logprobs'][0]['change']:+9.4f} "
                    f"{case['max_abs_logit_diff']:8.3g} {'PASS' if doc['parity']['passed'] else 'FAIL':>6s} "
                    f"{n['injected_tokens']:>4d}/{n['prompt_tokens']:<3d}  entry: {held}; contract: {fields}; forensics: {kind}"
                    + (f"; vLLM runs other {vllm}" if vllm else "")
                )
            print(f"pass {run}: {time.monotonic() - started:.0f} s")
