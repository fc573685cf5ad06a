"""Banded attention: a sliding or chunked layer reads only the keys it can see.

Independent references: the visibility rule is written out here by hand (``j <= i``, ``i - W < j`` or
``j < sinks``, the chunk of ``i``), transformers' eager forward gives the logits of sliding models, and
a dense float64 softmax written here gives the engine's attention.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ropekv.engine import attention
from ropekv.models import load_checkpoint
from ropekv.models import reference as reference_module
from ropekv.models.reference import ReferenceDecoder, band

ATOL = 1e-4  # float32 transformers against the float64 reference (as tests/test_reference.py)


def _visible_by_hand(i: int, j: int, window: int | None, sinks: int, chunk: int | None) -> bool:
    if j > i:
        return False
    if window is not None and not (i - window < j or j < sinks):
        return False
    return chunk is None or j >= (i // chunk) * chunk


@pytest.mark.parametrize(
    "window,sinks,chunk", [(None, 0, None), (5, 0, None), (5, 2, None), (7, 3, None), (None, 0, 6), (9, 2, 6)]
)
def test_the_band_holds_every_key_a_block_of_queries_can_see(window, sinks, chunk):
    T = 40
    positions = torch.arange(T)
    for start, size in itertools.product(range(T), (1, 3, 8)):
        stop = min(T, start + size)
        keys = set(band(start, stop, window, sinks, chunk, positions).indices().tolist())
        need = {j for i in range(start, stop) for j in range(T) if _visible_by_hand(i, j, window, sinks, chunk)}
        assert need <= keys, (start, stop, sorted(need - keys))
        assert all(j < stop for j in keys)
        if window is not None and chunk is None:  # the band is the window's, not the whole prefix
            assert len(keys) <= window + sinks + size


def test_a_chunked_band_starts_at_the_first_querys_chunk_of_positions():
    positions = torch.arange(100, 140)  # a shifted sequence: chunks cut by position, not index
    b = band(30, 34, None, 0, 16, positions)  # positions 130..133: their chunk starts at position 128
    assert (b.lo, b.stop) == (28, 34)


@pytest.fixture(scope="module")
def small_blocks():
    """Query blocks of 4 rows, so a 23-token forward has several blocks and each reads its band."""
    saved = reference_module._QUERY_BLOCK
    reference_module._QUERY_BLOCK = 4
    yield
    reference_module._QUERY_BLOCK = saved


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens[None]).logits[0].double()


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("mistral", {}),  # every layer slides over 5 keys
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),  # sliding and full
    ],
)
def test_banded_reference_logits_match_transformers(arch, overrides, make_tiny_checkpoint, hf_model, small_blocks):
    path = make_tiny_checkpoint(arch, **overrides)
    tokens = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(3))
    want = _hf_logits(hf_model(path), tokens)
    got = ReferenceDecoder(load_checkpoint(path)).forward(tokens).logits
    assert (got - want).abs().max() < ATOL
    assert want.abs().max() > 0.5


def test_a_sliding_layer_scores_only_its_band(tiny_mistral_dir, monkeypatch, small_blocks):
    checkpoint = load_checkpoint(tiny_mistral_dir)
    window = checkpoint.config.layer_window(0)
    T = 200
    scored: list[int] = []
    original = ReferenceDecoder._attn_logits

    def counting(self, q_rot, rows, k_heads, *args, **kwargs):
        scored.append(q_rot.shape[0] * k_heads.shape[0])
        return original(self, q_rot, rows, k_heads, *args, **kwargs)

    monkeypatch.setattr(ReferenceDecoder, "_attn_logits", counting)
    ReferenceDecoder(checkpoint).forward(torch.randint(0, 96, (T,), generator=torch.Generator().manual_seed(0)))
    per_layer = sum(scored) / checkpoint.config.num_layers
    assert per_layer <= T * (window + 4)  # each block of 4 queries reads at most window + 3 keys
    assert per_layer < T * T / 10  # far below the causal triangle (T^2 / 2)


@pytest.mark.parametrize("window,sinks", [(6, 0), (6, 2), (None, 0)])
def test_engine_attention_over_the_seen_keys_equals_a_dense_softmax(window, sinks, monkeypatch):
    monkeypatch.setattr(attention, "_BLOCK_BYTES", 4 * 4 * 80 * 5)  # 5 query rows per block
    n, heads, kv, d = 80, 4, 2, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, d, generator=g, dtype=torch.float64) for h in (heads, kv, kv))
    pos = torch.arange(n)
    mask = attention.visibility(pos, pos, window, sinks)
    out, logits = attention.attend(q, k, v, mask, with_logits=False)
    assert logits is None
    want = torch.empty(n, heads, d, dtype=torch.float64)
    for i, h in itertools.product(range(n), range(heads)):
        seen = [j for j in range(n) if _visible_by_hand(i, j, window, sinks, None)]
        s = torch.stack([q[i, h] @ k[j, h // 2] for j in seen]) / d**0.5
        want[i, h] = torch.softmax(s, 0) @ v[seen, h // 2]
    assert (out - want).abs().max() < 1e-12
