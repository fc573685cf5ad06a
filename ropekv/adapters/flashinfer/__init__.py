"""FlashInfer's decode kernel with RoPE inside (``pos_encoding_mode="ROPE_LLAMA"``), checked on a GPU once
and judged on CPU from what was recorded (docs/engines/flashinfer.md).

On the GPU (``scripts/flashinfer_gpu.py``): :mod:`.driver` runs a truncated model (:mod:`.model`) over a
paged cache (:mod:`.pages`) through FlashInfer's append and decode (:mod:`.kernel`), probing the keys the
kernel multiplied (:mod:`.probe`), and :mod:`.record` writes what it saw (:mod:`.bundle`). On CPU:
:mod:`.pack` builds the truncated model and the bundle that travels, and :mod:`.replay` serves the
recordings to ``ropekv.check``. :mod:`.cpu_kernel` stands in for FlashInfer in the tests.

Only :mod:`.pack` and :mod:`.replay` import ropekv beyond ``errors`` and ``files``: the GPU machine runs
the rest with torch and safetensors alone.
"""
