"""Runs onnxruntime-genai's model builder on a transformers folder (``python -m ropekv.adapters.ort.builder_main
SRC OUT CACHE``): float32 weights, the CPU execution provider, as ``python -m
onnxruntime_genai.models.builder -i SRC -o OUT -p fp32 -e cpu`` does (whose ``--help`` crashes in 0.18.0).

One config shim, for Gemma 3 under transformers 5: the builder reads ``rope_parameters["rope_type"]``,
but transformers 5 gives ``gemma3_text`` one ``rope_parameters`` entry per layer type (``full_attention``,
``sliding_attention``) and the builder then stops with ``KeyError: 'rope_type'``. The loaded config gets
back the spelling the builder reads (transformers 4's): ``rope_parameters`` of the global layers,
``rope_theta`` and ``rope_local_base_freq``. Only the in-memory config changes; the folder is untouched
and the graph's cos/sin caches are read back and checked against ropekv's reading (``graph.py``).

Run in a child process by :func:`ropekv.adapters.converted.converted` (once per folder).
"""

from __future__ import annotations

import sys

LAYER_TYPES = ("full_attention", "sliding_attention")


def flatten_layer_type_rope(config) -> bool:
    """Give ``config`` the transformers-4 spelling of per-layer-type RoPE bases; True when it changed."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_type" in params or set(params) != set(LAYER_TYPES):
        return False
    full, sliding = params["full_attention"], params["sliding_attention"]
    config.rope_parameters = dict(full)
    config.rope_theta = full["rope_theta"]
    config.rope_local_base_freq = sliding["rope_theta"]
    return True


def main(argv: list[str]) -> int:
    src, out, cache = argv
    from onnxruntime_genai.models import builder

    options = builder.parse_extra_options(None, src, out, "fp32", "cpu", cache, None)
    if flatten_layer_type_rope(options["hf_details"]["hf_config"]):
        print("ropekv: rope_parameters per layer type given to the builder as rope_theta + rope_local_base_freq")
    builder.create_model(None, src, out, "fp32", "cpu", cache, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
