"""The eval-callback tap: what it records is what llama.cpp's kernels computed, and recording changes nothing."""

from __future__ import annotations

import torch

from ropekv.adapters.llamacpp import LlamaCppEngine
from ropekv.parity.cases import Case
from ropekv.parity.protocol import Tier
from ropekv.parity.recorder import attention_logits


def test_recorded_q_and_k_reproduce_the_kernels_own_scores(f32_engine, tokens):
    """kq-N is llama.cpp's own q.k before scaling: ropekv's logits from the recorded q and k (the K-cache
    view the kernel multiplied) must give it back, every layer (the forensics-tier promise)."""
    ctx = f32_engine._cached
    ctx.clear()
    ctx.prefill(tokens[:40].tolist(), 0)
    step = f32_engine.decode_step(ctx, int(tokens[40]), 40, keep_scores=True)
    cap = f32_engine.last_capture
    scale = f32_engine.config.head_dim**-0.5
    for layer, probe in enumerate(step.layers):
        mine = attention_logits(probe, torch.tensor([40]), scale=1.0, mask_by_position=False)[:, 0]  # [H, N]
        kernel = torch.from_numpy(cap.kq[layer][:, 0, probe.key_slots.numpy()]).double()  # [H, N]
        assert (mine - kernel).abs().max() < 1e-4 * max(1.0, float(kernel.abs().max())), layer
    assert scale < 1


def test_positions_and_slots_come_from_llama_cpp_metadata(f32_engine, tokens):
    """A prefix hit (seq_rm past 13) then a chunked prefill: every key's position is what the batch
    said, the cells are llama.cpp's, and the newest position equals llama_memory_seq_pos_max."""
    case = Case(length=30, prefix=13, chunk=7, decode_steps=2)
    run = f32_engine.run_case(case, tokens)
    for step in run.steps:
        probe = step.layers[0]
        assert sorted(probe.key_positions.tolist()) == list(range(step.position + 1))
        assert probe.key_slots.unique().numel() == probe.key_slots.numel()
    assert f32_engine._cached.position_range() == (0, case.decode_positions[-1])
    assert any("13 cached prompt tokens" in n for n in run.notes)


def test_tap_does_not_change_the_logits(f32_engine, tokens):
    """The tapped context (graph split at every observed node) gives the public API's logits."""
    plain = LlamaCppEngine(f32_engine.gguf_path, tier=Tier.LOGITS)
    case = Case(length=33, prefix=5, chunk=11)
    a = plain.run_case(case, tokens)
    b = f32_engine.run_case(case, tokens)
    for x, y in zip(a.steps, b.steps):
        assert (x.logits - y.logits).abs().max() < 1e-4
        assert int(x.logits.argmax()) == int(y.logits.argmax())
