"""Finding: onnxruntime-genai 0.18.0's model builder drops a Mistral config's sliding window when the
config has no ``layer_types``.

The builder marks a layer local only where ``layer_types[i] == "sliding_attention"``; a Mistral
config.json spells its window as ``sliding_window`` alone (transformers applies it to every layer), so
every ``GroupQueryAttention`` node gets ``local_window_size=-1`` while ``genai_config.json`` still says
``sliding_window.window_size``. Decoding then reads every key: it matches transformers while the
sequence fits the window and diverges after.

The model: the embedded SmolLM2-135M's weights (hard links) under a Mistral config with
``sliding_window=16`` (Mistral is llama plus the window), and the same with ``sliding_window=null``.
The script prints the graph's windows, transformers' MistralForCausalLM against the ONNX graph
(next-token logits after a cached decode, twice), and ropekv's check of the graph, which names the bug.

Run from .venv-ort:  .venv-ort/bin/python scripts/findings/ort_mistral_window.py
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

WINDOW = 16
FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json")


def mistral_folder(root: Path, window: int | None) -> Path:
    """SmolLM2's weights under a Mistral config with ``sliding_window=window`` (no layer_types)."""
    from ropekv.models.default import default_checkpoint_dir

    src = default_checkpoint_dir(None)
    out = root / f"smollm2-as-mistral-w{window}"
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    config.pop("layer_types", None)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in FILES:
        if not (out / name).exists():
            os.link(src / name, out / name)
    return out


def graph_windows(engine) -> str:
    cfg = json.loads((engine.built / "genai_config.json").read_text())
    sliding = cfg["model"]["decoder"].get("sliding_window")
    sizes = sorted({la.local_window_size for la in engine.layers})
    return f"local_window_size on the {len(engine.layers)} nodes: {sizes}; genai_config sliding_window: {sliding}"


def transformers_vs_graph(folder: Path, engine, length: int, steps: int) -> list[float]:
    """max |dlogit| of each decode step: the graph's Generator against transformers' own cached decode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()
    ids = [int(t) for t in torch.arange(100, 100 + length + steps) % 49152]
    out = []
    with torch.no_grad():
        past = transformers.DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids[:length]]), past_key_values=past, use_cache=True)
        gen = engine._generator(length + steps)
        engine._append(gen, ids[:length])
        for t in range(length, length + steps):
            hf = model(input_ids=torch.tensor([[ids[t]]]), past_key_values=past, use_cache=True).logits[0, -1]
            engine._append(gen, [ids[t]])
            ort = torch.from_numpy(np.array(gen.get_logits()[0, -1], dtype=np.float32))
            out.append(float((hf - ort).abs().max()))
    return out


def main() -> None:
    import ropekv
    from ropekv.adapters.ort.engine import OrtEngine
    from ropekv.parity.cases import Case

    root = Path(tempfile.gettempdir()) / "ropekv-finding-ort-mistral"
    for window in (WINDOW, None):
        folder = mistral_folder(root, window)
        engine = OrtEngine(folder)
        print(f"== Mistral config, sliding_window={window}, no layer_types")
        print("graph:", graph_windows(engine))
        for attempt in (1, 2):
            diffs = transformers_vs_graph(folder, engine, length=12, steps=12)
            text = ", ".join(f"{12 + i}: {d:.2g}" for i, d in enumerate(diffs))
            print(f"transformers vs the graph, max|dlogit| by decode position (run {attempt}): {text}")
        # 27 tokens at most: genai sizes its buffers from genai_config's window (32 slots) and refuses one
        # longer append (the full forward appends the whole sequence at once).
        report = ropekv.check(engine, cases=[Case(length=12, decode_steps=3), Case(length=24, decode_steps=3)])
        print(report.table())
        print()


if __name__ == "__main__":
    main()
