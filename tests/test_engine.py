"""The paged engine against the independent float64 reference decoder.

Every numeric assertion compares the cached engine's decode logits with rows of a full float64
forward computed by ``ropekv.models.reference`` (itself checked against transformers), never with the
engine's own output.
"""

from __future__ import annotations

import pytest
import torch

from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.errors import CacheError, ContractMismatch, UsageError
from ropekv.models import load_checkpoint
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import token_stream
from ropekv.parity.recorder import attention_logits

KEY_FORMS = ("rotated", "raw")
ATOL = 2e-4  # float32 engine vs float64 reference on unit-scale tiny models


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


@pytest.fixture(scope="module")
def ref_llama(llama):
    return ReferenceDecoder(llama, dtype=torch.float64)


def make_engine(ckpt, key_form, block_size=16, num_blocks=256, **contract_kw):
    contract = CacheContract.for_model(
        ckpt.config,
        key_form=key_form,
        block_size=block_size,
        weights_fingerprint=ckpt.weights_fingerprint,
        **contract_kw,
    )
    return Engine(ckpt, contract, num_blocks)


def tokens_for(ckpt, n, seed=0):
    return token_stream(ckpt.config.vocab_size, n, seed)


def decode_logits(engine, seq, tokens, start, steps):
    """Decode tokens[start:start+steps] one by one; returns logits [steps, vocab]."""
    return torch.stack([engine.decode(seq, tokens[t]).logits[0] for t in range(start, start + steps)])


def assert_matches_reference(ref, tokens, start, logits, **fwd_kw):
    expected = ref.forward(tokens[: start + logits.shape[0]], **fwd_kw).logits[start:].float()
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def _lengths(block):
    return sorted({1, 2, 3, block - 1, block, block + 1} - {0})


@pytest.mark.parametrize("key_form", KEY_FORMS)
@pytest.mark.parametrize("block_size,length", [(b, n) for b in (1, 7, 16) for n in _lengths(b)])
def test_prefill_then_decode_matches_reference(llama, ref_llama, key_form, block_size, length):
    engine = make_engine(llama, key_form, block_size)
    toks = tokens_for(llama, length + 3)
    engine.prefill("s", toks[:length])
    assert_matches_reference(ref_llama, toks, length, decode_logits(engine, "s", toks, length, 3))


@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_long_chunked_prefill(llama, ref_llama, key_form):
    engine = make_engine(llama, key_form, block_size=7, num_blocks=64)
    toks = tokens_for(llama, 250, seed=1)  # a few hundred tokens, within the tiny model's 256 positions
    last = engine.prefill("s", toks[:247], chunk_size=37)
    expected = ref_llama.forward(toks).logits.float()
    torch.testing.assert_close(last, expected[246], atol=ATOL, rtol=0)
    torch.testing.assert_close(decode_logits(engine, "s", toks, 247, 3), expected[247:250], atol=ATOL, rtol=0)


@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_prefix_fork_at_offset_not_multiple_of_block(llama, ref_llama, key_form):
    engine = make_engine(llama, key_form, block_size=7)
    toks = tokens_for(llama, 40, seed=2)
    other = tokens_for(llama, 40, seed=3)
    prefix = 13
    engine.prefill("parent", torch.cat([toks[:prefix], other[:5]]))  # the parent continued differently
    engine.fork("child", "parent", prefix)
    engine.prefill("child", toks[prefix:30], chunk_size=5)
    assert_matches_reference(ref_llama, toks, 30, decode_logits(engine, "child", toks, 30, 3))
    # The parent's own continuation is untouched by the child's copy-on-write appends.
    parent_toks = torch.cat([toks[:prefix], other[:8]])
    assert_matches_reference(
        ref_llama, parent_toks, prefix + 5, decode_logits(engine, "parent", parent_toks, prefix + 5, 3)
    )


@pytest.mark.parametrize("key_form", KEY_FORMS)
@pytest.mark.parametrize("sinks", [0, 2])
def test_window_wrapped_several_times(llama, ref_llama, key_form, sinks):
    window = 7
    engine = make_engine(llama, key_form, block_size=3, window=window, sink_tokens=sinks)
    toks = tokens_for(llama, 60, seed=4)
    engine.prefill("s", toks[:50], chunk_size=9)  # 50 tokens through a ring of 7 (+ sinks): wrapped 6 times
    logits = decode_logits(engine, "s", toks, 50, 6)
    assert_matches_reference(ref_llama, toks, 50, logits, window=window, sink_tokens=sinks)
    view = engine.cache.view("s", 0)
    assert view.positions.tolist() == list(range(sinks)) + list(range(56 - window, 56))
    assert not torch.equal(view.slots, view.positions)  # slots wrapped, positions did not


@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_model_sliding_window(tiny_mistral_dir, key_form):
    ckpt = load_checkpoint(tiny_mistral_dir)
    ref = ReferenceDecoder(ckpt, dtype=torch.float64)
    engine = make_engine(ckpt, key_form, block_size=4)  # window="model": mistral's own window
    assert engine.contract.window == ckpt.config.sliding_window
    toks = tokens_for(ckpt, 30, seed=5)
    engine.prefill("s", toks[:24], chunk_size=7)
    assert_matches_reference(ref, toks, 24, decode_logits(engine, "s", toks, 24, 4))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_bias_and_qk_norm_architectures(make_tiny_checkpoint, arch):
    ckpt = load_checkpoint(make_tiny_checkpoint(arch))
    ref = ReferenceDecoder(ckpt, dtype=torch.float64)
    for key_form in KEY_FORMS:
        engine = make_engine(ckpt, key_form, block_size=5)
        toks = tokens_for(ckpt, 20, seed=6)
        engine.prefill("s", toks[:17])
        assert_matches_reference(ref, toks, 17, decode_logits(engine, "s", toks, 17, 3))


def test_three_interleaved_sequences_equal_running_alone(llama, ref_llama):
    streams = {name: tokens_for(llama, 30, seed=s) for name, s in (("a", 10), ("b", 11), ("c", 12))}
    shared = make_engine(llama, "rotated", block_size=7)
    alone = {}
    for name, toks in streams.items():
        e = make_engine(llama, "rotated", block_size=7)
        chunks = (toks[:11], toks[11:20]) if name == "b" else (toks[:20],)  # same chunking as below
        for chunk in chunks:
            e.prefill(name, chunk)
        alone[name] = decode_logits(e, name, toks, 20, 5)
    shared.prefill("a", streams["a"][:20])
    shared.prefill("b", streams["b"][:11])
    got = {name: [] for name in streams}
    got["a"].append(shared.decode("a", streams["a"][20]).logits[0])
    shared.prefill("c", streams["c"][:20])
    shared.prefill("b", streams["b"][11:20])
    for t in range(20, 25):
        for name in ("c", "b", "a"):
            if name == "a" and t == 20:
                continue
            got[name].append(shared.decode(name, streams[name][t]).logits[0])
    for name, toks in streams.items():
        torch.testing.assert_close(torch.stack(got[name]), alone[name], atol=0, rtol=0)
        assert_matches_reference(ref_llama, toks, 20, alone[name])


def test_dynamic_ntk_crossing_original_length(make_tiny_checkpoint):
    ckpt = load_checkpoint(
        make_tiny_checkpoint(
            "llama",
            max_position_embeddings=32,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        )
    )
    ref = ReferenceDecoder(ckpt, dtype=torch.float64)
    toks = tokens_for(ckpt, 40, seed=7)
    engine = make_engine(ckpt, "raw")
    engine.prefill("s", toks[:28])
    for t in range(28, 38):  # crosses the original 32 positions
        out = engine.decode("s", toks[t], probe=True)
        full = ref.forward(toks[: t + 1], probe_rows=[t])  # a full forward over exactly t + 1 tokens
        # Raw keys rotated on read with the current length's frequencies: layer 0 is exact.
        scale = ckpt.config.head_dim**-0.5
        layer0 = attention_logits(full.layers[0], full.rows, scale=scale)[:, 0]
        mine = attention_logits(out.layers[0], torch.tensor([t]), scale=scale)[:, 0]
        assert out.layers[0].key_positions.tolist() == list(range(t + 1))
        torch.testing.assert_close(mine, layer0, atol=1e-5, rtol=0)
    # Rotated keys would keep stale frequencies: the engine refuses that contract.
    with pytest.raises(ContractMismatch, match="stale|rotated"):
        make_engine(ckpt, "rotated")


def test_rotation_index_cache_matches_manual_rotation(llama, ref_llama):
    """StreamingLLM-style: with raw keys, rotation indices are the order among visible keys."""
    window, sinks = 5, 2
    engine = make_engine(llama, "raw", block_size=4, window=window, sink_tokens=sinks, rotation_index="cache")
    toks = tokens_for(llama, 30, seed=8)
    engine.prefill("s", toks[:25])
    out = engine.decode("s", toks[25], probe=True)
    probe = ref_llama.forward(toks[:26], probe_rows=[25]).layers[0]
    visible = list(range(sinks)) + list(range(26 - window, 26))
    rope = llama.config.rope
    ranks = torch.arange(len(visible))
    k = rope.rotate(probe.k_raw[visible], ranks)  # [N, KVH, D]
    q = rope.rotate(probe.q_raw, ranks[-1:])  # [1, H, D]
    group = llama.config.num_heads // llama.config.num_kv_heads
    expected = torch.einsum("hd,nhd->hn", q[0], k.repeat_interleave(group, dim=1)) / llama.config.head_dim**0.5
    trace = out.layers[0]  # a decode probe holds exactly the keys the kernel attended to
    assert trace.key_positions.tolist() == visible
    got = attention_logits(trace, torch.tensor([25]), scale=llama.config.head_dim**-0.5, mask_by_position=False)
    torch.testing.assert_close(got[:, 0], expected, atol=1e-5, rtol=0)
    # Without a window, cache order and logical positions coincide.
    plain = make_engine(llama, "raw", rotation_index="cache")
    plain.prefill("s", toks[:20])
    assert_matches_reference(ref_llama, toks, 20, decode_logits(plain, "s", toks, 20, 2))


def test_bfloat16_engine_close_to_reference(llama, ref_llama):
    contract = CacheContract.for_model(llama.config, key_form="raw", dtype="bfloat16")
    engine = Engine(llama, contract, 64)
    assert engine.cache.view if engine.dtype == torch.bfloat16 else False
    toks = tokens_for(llama, 40, seed=9)
    engine.prefill("s", toks[:37])
    logits = decode_logits(engine, "s", toks, 37, 3)
    expected = ref_llama.forward(toks).logits[37:].float()
    err = (logits - expected).abs().max() / expected.abs().max()
    assert err < 0.1


def test_rejected_append_leaves_storage_unchanged(llama):
    engine = make_engine(llama, "rotated", block_size=7)
    toks = tokens_for(llama, 20)
    engine.prefill("s", toks[:10])
    before = engine.cache.state_digest()
    n, kvh, d = 1, llama.config.num_kv_heads, llama.config.head_dim
    keys = [torch.zeros(n, kvh, d)] * llama.config.num_layers
    with pytest.raises(ContractMismatch, match="key_form"):
        engine.cache.append("s", torch.tensor([10]), keys, keys, key_form="raw")
    with pytest.raises(CacheError):
        engine.cache.append("s", torch.tensor([9]), keys, keys, key_form="rotated")  # position not increasing
    with pytest.raises(CacheError):
        engine.decode("nope", 3)
    with pytest.raises(CacheError):
        engine.fork("t", "s", 11)  # longer than what is cached
    assert engine.cache.state_digest() == before


def test_capacity_error_leaves_cache_unchanged(llama):
    from ropekv.errors import CapacityError

    engine = make_engine(llama, "rotated", block_size=4, num_blocks=3)
    toks = tokens_for(llama, 20)
    engine.prefill("s", toks[:10])
    before = engine.cache.state_digest()
    with pytest.raises(CapacityError):
        engine.prefill("s", toks[10:20])
    assert engine.cache.state_digest() == before
    with pytest.raises(CapacityError):
        engine.prefill("t", toks[:20])
    assert engine.cache.state_digest() == before and not engine.cache.has("t")


def test_backend_contract_pairing_refused(llama):
    contract = CacheContract.for_model(llama.config, key_form="rotated")
    with pytest.raises(ContractMismatch, match="twice their position"):
        Engine(llama, contract, 8, backend="rotate_on_read")
    other = CacheContract.for_model(
        llama.config.replace(num_layers=1, layer_types=("full_attention",)), key_form="rotated"
    )
    with pytest.raises(ContractMismatch, match="num_layers"):
        Engine(llama, other, 8)
    with pytest.raises(UsageError):
        make_engine(llama, "rotated").prefill("s", torch.tensor([llama.config.vocab_size]))


@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_a_prefill_hands_the_cache_rows_that_hold_no_more_than_themselves(llama, key_form, monkeypatch):
    """The step's new keys and values reach the cache write as tensors of their own: a view of the
    layer's fused qkv projection would keep every layer's whole projection alive until the write
    (3 GB in a 32k-token prefill of Gemma 3 270M)."""
    engine = make_engine(llama, key_form)
    seen: list[torch.Tensor] = []
    real = engine.cache.append

    def append(seq_id, positions, keys, values, **kw):
        seen.extend([*keys, *values])
        return real(seq_id, positions, keys, values, **kw)

    monkeypatch.setattr(engine.cache, "append", append)
    tokens = tokens_for(llama, 33)
    engine.prefill("s", tokens[:33])  # one step of 33 rows (a decode step's one row may stay a view: it holds no more)
    assert len(seen) == 2 * llama.config.num_layers  # keys and values of each layer
    for t in seen:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), tuple(t.shape)


@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_a_probed_full_forward_keeps_tensors_that_hold_no_more_than_themselves(llama, key_form):
    """A check keeps a full forward's probes until its last case reads them: a probe's values (or raw
    keys) as views of the layer's fused qkv projection would keep every layer's whole projection
    alive (3 GB at 32,766 tokens of Gemma 3 270M)."""
    engine = make_engine(llama, key_form)
    out = engine.forward_full(tokens_for(llama, 33), probe_rows=[30, 32], logits_rows=[30, 32])
    assert len(out.layers) == llama.config.num_layers
    for probe in out.layers:
        for name in ("q", "k", "v", "q_raw", "k_raw", "hidden_in", "key_positions", "key_slots"):
            t = getattr(probe, name)
            if t is not None:
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (name, tuple(t.shape))
