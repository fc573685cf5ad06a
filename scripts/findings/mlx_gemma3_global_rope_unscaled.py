"""Finding, by hand (no ropekv code): mlx-lm up to 0.28.4 turns Gemma 3's global layers without
``rope_scaling``; 0.29.1 turns them as transformers does.

One forward of 12 tokens through mlx-lm and through transformers (float32, eager) on the same folder:
the replay corpus's tiny gemma3_text model (window 8, pattern 2, ``rope_theta`` 1e6, linear scaling x8
on the global layers), which ``ropekv replay --entries mlx-gemma3-global-rope-unscaled`` writes under
``~/.cache/ropekv/replay/models/``. Run it with each release's replay venv, which holds mlx-lm and
transformers:

    ~/.cache/ropekv/replay/mlx-lm-0.28.4/bin/python scripts/findings/mlx_gemma3_global_rope_unscaled.py MODEL_DIR
    ~/.cache/ropekv/replay/mlx-lm-0.29.1/bin/python scripts/findings/mlx_gemma3_global_rope_unscaled.py MODEL_DIR

Measured (transformers 5.25.0): 0.28.4 agrees at position 0 (2e-6: no turn at 0) and differs 0.06 to
0.73 max|dlogit| from position 1 on; 0.29.1 agrees to 2e-6 at every position.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import torch
import transformers
from mlx_lm.utils import load_model
from transformers import AutoModelForCausalLM

TOKENS = [5, 17, 33, 2, 81, 40, 9, 64, 23, 11, 70, 3]


def main(folder: Path) -> None:
    model, _ = load_model(folder)
    got = np.array(model(mx.array([TOKENS])).astype(mx.float32))[0]
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", use_safetensors=True
    )
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0].numpy()
    per_position = np.abs(got - ref).max(-1)
    print(f"mlx-lm {mlx_lm.__version__} against transformers {transformers.__version__}, max|dlogit| by position:")
    print(" ".join(f"{x:.2g}" for x in per_position))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
