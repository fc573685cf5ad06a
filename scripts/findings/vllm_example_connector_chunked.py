"""Finding: vLLM's ExampleConnector stores a chunked prompt at its first chunk, with the rows of that chunk only.

``ExampleConnector.build_connector_meta`` adds a prompt to the store in the step that first schedules
it, with the block ids allocated so far; ``save_kv_layer`` writes those slots under the key of all the
prompt's whole-block tokens. With chunked prefill (a prompt longer than ``max_num_batched_tokens``) the
first step holds only the first chunk. This script runs a producer with ``max_num_batched_tokens=64``
on a 130-token prompt, prints what the store holds, then runs a consumer on the same prompt and prints
what it does; and runs ropekv's ContractConnector producer the same way (it stores no chunked prompt).
Each instance is its own process (engine_tests/vllm/connector_instance.py).

    .venv-vllm/bin/python scripts/findings/vllm_example_connector_chunked.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "engine_tests" / "vllm"))

PROMPT = [1000 + 7 * i % 4000 for i in range(130)]
BUDGET = 64


def describe(store: Path) -> str:
    from safetensors import safe_open

    entries = [p for p in store.iterdir() if p.is_dir()]
    if not entries:
        return "no entry"
    out = []
    for entry in entries:
        files = sorted(entry.glob("*.safetensors"))
        with safe_open(str(files[0]), "pt") as f:
            shape = tuple(f.get_slice("kv_cache").get_shape())
        out.append(f"entry {entry.name[:12]}: {len(files)} layer files, kv_cache {shape} each")
    return "; ".join(out)


def main() -> None:
    from connector_tools import Instance

    base = Path(tempfile.mkdtemp(prefix="ropekv-chunked-"))
    stores = {name: base / name for name in ("example", "contract")}
    for store in stores.values():
        store.mkdir()
    common = {"max_num_batched_tokens": BUDGET}
    producers = {
        "example": Instance(
            "example-producer",
            {**common, "connector": "ExampleConnector", "role": "kv_producer", "store": str(stores["example"])},
            base,
        ),
        "contract": Instance(
            "contract-producer",
            {**common, "connector": "ContractConnector", "role": "kv_producer", "store": str(stores["contract"])},
            base,
        ),
    }
    consumer = Instance(
        "example-consumer",
        {**common, "connector": "ExampleConnector", "role": "kv_consumer", "store": str(stores["example"])},
        base,
    )
    try:
        for name, producer in producers.items():
            plain = producer.request(PROMPT)
            producer.close()
            print(f"{name} producer, {len(PROMPT)}-token prompt, max_num_batched_tokens={BUDGET}: plain run {plain}")
            print(f"  store: {describe(stores[name])}")
        try:
            out = consumer.request(PROMPT, timeout=300)
        except RuntimeError as exc:  # the consumer process died
            out = {"process": str(exc).splitlines()[0]}
        print(f"example consumer on the same prompt: {json.dumps(out)}")
        lines = [
            ln for ln in consumer.log_text().splitlines() if "Inject" in ln or "Hit!" in ln or "shape mismatch" in ln
        ]
        for line in lines[:6]:
            print("  log:", line[:300])
    finally:
        for instance in (*producers.values(), consumer):
            instance.close()
    print(f"(logs in {base})")


if __name__ == "__main__":
    main()
