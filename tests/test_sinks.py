"""Attention sinks (gpt_oss): a learned logit per query head joins every softmax denominator.

The sinks are weights, not cache contents, so the cache contract does not carry them
(docs/architectures.md); what must hold is that every attention path of the engine uses them and
that an engine which drops them fails the check. The harness compares pre-softmax attention logits,
which sinks do not change, so a dropped sink shows where its output lands: layer 1's input and the
next-token logits, both against the float64 reference.
"""

from __future__ import annotations

import dataclasses

import torch
from test_architectures import BY_ID, TOL, cases_for, scaled

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.engine.attention import attend, softmax_with_sinks
from ropekv.engine.transformer import DecoderWeights
from ropekv.models import ReferenceDecoder, load_checkpoint
from ropekv.models.config import Checkpoint

GPT_OSS = BY_ID["gpt_oss"][1]


def _checkpoint(make_arch_checkpoint) -> Checkpoint:
    return load_checkpoint(make_arch_checkpoint("gpt_oss", **GPT_OSS))


def test_softmax_with_sinks_is_the_softmax_with_one_more_column_dropped():
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    logits[0, 1, 4:] = float("-inf")  # masked keys stay at zero weight
    sinks = torch.randn(3, 1, 1, dtype=torch.float64)
    probs = softmax_with_sinks(logits, sinks)
    expected = logits.exp() / (logits.exp().sum(-1, keepdim=True) + sinks.exp())  # written out
    torch.testing.assert_close(probs, expected, rtol=1e-12, atol=1e-15)
    assert bool((probs.sum(-1) < 1).all()) and float(probs[0, 1, 4:].abs().max()) == 0.0


def test_attend_uses_the_sinks_per_query_head():
    """Grouped heads: head h's sink is sinks[h], whichever KV head it reads (a permuted sink vector fails)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64) for n, h in ((2, 4), (6, 2), (6, 2)))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    out, _ = attend(q, k, v, None, sinks=sinks)
    kv_head = torch.arange(4) // 2
    scores = torch.einsum("nhd,mhd->hnm", q, k[:, kv_head]) * 8**-0.5  # [H, n, N]
    weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sinks.exp()[:, None, None])
    expected = torch.einsum("hnm,mhd->nhd", weights, v[:, kv_head])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(attend(q, k, v, None, sinks=sinks.flip(0))[0], expected)


def test_gpt_oss_reads_sinks_from_the_checkpoint(make_arch_checkpoint):
    ckpt = _checkpoint(make_arch_checkpoint)
    cfg = ckpt.config
    assert cfg.attention_sinks and cfg.moe.swiglu_limit == 0.5 and cfg.moe.bias
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == 5
    assert ckpt.weights["model.layers.0.self_attn.sinks"].shape == (cfg.num_heads,)
    # The contract: sinks are weights, not cache contents; keys and windows are as for any model.
    contract = CacheContract.for_model(cfg, key_form="rotated")
    assert contract.window_layers == (0,) and contract.window == 5 and contract.sink_tokens == 0


def test_batched_decode_uses_the_sinks(make_arch_checkpoint):
    """The left-padded batched decode (its own attention) against the reference, rows of other lengths."""
    ckpt = _checkpoint(make_arch_checkpoint)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    engine = Engine(ckpt, CacheContract.for_model(ckpt.config, key_form="rotated", block_size=3), num_blocks=32)
    engine.prefill("a", tokens[0, :13])
    engine.prefill("b", tokens[1, :9])
    outs = engine.decode_batch(["a", "b"], torch.stack([tokens[0, 13], tokens[1, 9]]))
    ref = ReferenceDecoder(ckpt)
    for out, row, t in zip(outs, tokens, (13, 9)):
        assert scaled(out.logits[0], ref.forward(row[: t + 1]).logits[t]) < TOL


class _SinksDropped(NativeAdapter):
    """ropekv's engine with a kernel that drops the sinks, reporting the real checkpoint: the engine
    someone wrote before reading gpt_oss's attention. Its caches hold the same kind of keys."""

    def __init__(self, checkpoint: Checkpoint):
        super().__init__(checkpoint, name="engine without sinks")
        weights = DecoderWeights.from_checkpoint(checkpoint, self.dtype)
        self._weights = dataclasses.replace(
            weights, layers=tuple(dataclasses.replace(layer, sinks=None) for layer in weights.layers)
        )


def test_an_engine_that_drops_the_sinks_fails_the_check(make_arch_checkpoint):
    ckpt = _checkpoint(make_arch_checkpoint)
    cases = cases_for(ckpt.config)
    assert check(NativeAdapter(ckpt), cases=cases).passed  # the same engine with its sinks
    report = check(_SinksDropped(ckpt), cases=cases)
    assert not report.passed, report.table()
    assert min(max(c.logit_errors) for c in report.cases) > 100 * TOL
    fd = next(c for c in report.cases if not c.passed).first_divergence
    # Layer 0's q and k are right (sinks change no logit before the softmax); its output is not.
    assert fd.layer == 1, report.table()
    # Not a RoPE bug, and not named as one: every query and key sits at its logical position.
    assert report.diagnosis.kind == "unknown" and "no RoPE error visible" in report.diagnosis.evidence


def test_cache_index_rotation_uses_the_sinks(make_arch_checkpoint):
    """The StreamingLLM re-indexing path (rotation_index="cache", raw keys) attends row by row with
    its own call; with nothing evicted the cache index is the position, so it must match the
    reference exactly (full attention on every layer, as the contract says)."""
    ckpt = _checkpoint(make_arch_checkpoint)
    contract = CacheContract.for_model(ckpt.config, key_form="raw", window=None, rotation_index="cache", block_size=4)
    engine = Engine(ckpt, contract, num_blocks=16)
    tokens = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(4))
    engine.prefill("s", tokens[:10], chunk_size=3)
    ref = ReferenceDecoder(ckpt).forward(tokens, window=None).logits
    for t in range(10, 14):
        assert scaled(engine.decode("s", int(tokens[t])).logits[0], ref[t]) < TOL
