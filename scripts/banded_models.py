"""The two checkpoints the banded-attention figures in docs/performance.md come from: a tiny random
gemma3 of 6 layers (5 slide over 512 keys, 1 is global) with a 40,960-token context, and its all-global
twin (same sizes, every layer global). Random weights, written by transformers' ``save_pretrained``.

    .venv/bin/python scripts/banded_models.py DIR
    .venv/bin/python -m ropekv.bench.long_context DIR/gemma3-sliding --lengths 2048,8192,32768 --json ...
"""

import sys
from pathlib import Path

from ropekv.testing.tiny import tiny_checkpoint

LAYERS = 6
WINDOW = 512
CONTEXT = 40960

out = Path(sys.argv[1] if len(sys.argv) > 1 else "banded-models")
sliding = ["sliding_attention"] * (LAYERS - 1) + ["full_attention"]
for name, layer_types in (("gemma3-sliding", sliding), ("gemma3-global", ["full_attention"] * LAYERS)):
    path = tiny_checkpoint(
        "gemma3_text",
        save_to=out / name,
        num_hidden_layers=LAYERS,
        layer_types=layer_types,
        sliding_window=WINDOW,
        max_position_embeddings=CONTEXT,
    )
    print(path)
