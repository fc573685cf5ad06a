"""The probes only observe: logits are bit-identical with and without them, and what they record is
what the kernel computes with."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

from ropekv import check
from ropekv.adapters.mlx import MLXEngine
from ropekv.adapters.mlx.probes import ForwardProbe
from ropekv.parity.cases import Case


def _decode_logits(engine, case, tokens, probed: bool):
    caches = engine.new_caches(case)
    engine.prefill(caches, tokens[: case.length], case.chunk)
    out, layers = [], []
    for t in case.decode_positions:
        probe = ForwardProbe(engine.config.num_layers, "mlx") if probed else None
        out.append(engine.forward(tokens[t : t + 1], caches, probe))
        layers.append(probe.layers() if probed else None)
    return out, layers


def test_probes_leave_decode_logits_bit_identical(engine, tokens):
    for case in (Case(length=20, decode_steps=2), Case(length=20, window=9, sink_tokens=2, decode_steps=2)):
        plain, _ = _decode_logits(engine, case, tokens, probed=False)
        probed, layers = _decode_logits(engine, case, tokens, probed=True)
        for a, b in zip(plain, probed):
            assert torch.equal(a, b), case.label()
        assert len(layers[0]) == engine.config.num_layers
    # the model is restored: no wrapper left behind
    assert type(engine.model.layers[0].self_attn.rope).__name__ == "RoPE"
    assert type(engine.model.layers[0].input_layernorm).__name__ == "RMSNorm"


def test_probed_full_forward_is_the_uncached_forward_bit_for_bit(engine, tokens):
    toks = tokens[:24]
    plain = engine.model(mx.array(toks.numpy().astype(np.int32))[None])[0]
    mx.eval(plain)
    full = engine.full_forward(toks, [5, 23], Case(length=21))
    assert torch.equal(full.logits, torch.from_numpy(np.array(plain))[[5, 23]])
    k = full.layers[3].k
    assert k.shape == (24, engine.config.num_kv_heads, engine.config.head_dim)
    assert torch.equal(full.layers[3].key_positions, torch.arange(24))


def test_recorded_tensors_reproduce_the_kernel_output(engine, tokens):
    """softmax(q k^T / sqrt(d)) v from the recorded q, k, v equals what mlx's fused SDPA fed o_proj."""
    case = Case(length=30, decode_steps=1)
    caches = engine.new_caches(case)
    engine.prefill(caches, tokens[:30], None)
    probe = ForwardProbe(engine.config.num_layers, "mlx")
    captured = {}
    attn = engine.model.layers[4].self_attn
    o_proj = attn.o_proj

    def spy(x):
        captured["o_in"] = x
        return o_proj(x)

    attn.o_proj = type("SpyModule", (engine.rt.nn.Module,), {"__call__": lambda self, x: spy(x)})()
    try:
        engine.forward(tokens[30:31], caches, probe)
    finally:
        attn.o_proj = o_proj
    p = probe.layers()[4]
    q, k, v = p.q.double(), p.k.double(), p.v.double()  # [1, H, D], [N, KVH, D]
    group = engine.config.num_heads // engine.config.num_kv_heads
    kv = torch.arange(engine.config.num_heads) // group
    scores = torch.einsum("rhd,nhd->hrn", q, k[:, kv]) * engine.config.head_dim**-0.5
    out = torch.einsum("hrn,nhd->rhd", scores.softmax(-1), v[:, kv]).reshape(1, -1)
    fused = torch.from_numpy(np.array(captured["o_in"][0].astype(mx.float32))).double()
    assert (out - fused).abs().max() < 1e-5


def test_a_decode_mask_selects_the_keys_the_kernel_reads(engine, tokens):
    """Plain KVCaches under sliding layers: mlx-lm's llama masks the decode with the window (a boolean
    mask over every cached row); the probe keeps the rows that mask keeps, and the run passes."""
    kinds = ["sliding_attention" if i % 2 else "full_attention" for i in range(engine.config.num_layers)]

    class PlainCaches(MLXEngine):
        def new_caches(self, case):
            return [self.rt.cache.KVCache() for _ in self.model.layers]

    plain = PlainCaches(engine.path, overrides={"layer_types": kinds, "sliding_window": 8})
    case = Case(length=20, decode_steps=2)
    step = plain.run_case(case, tokens).steps[0]
    assert step.layers[1].key_positions.tolist() == list(range(13, 21))  # the window of 8 ending at 20
    assert step.layers[0].key_positions.tolist() == list(range(21))  # a full layer reads every key
    assert check(plain, cases=[case], progress="off").passed
