"""Cache operations at the cache and engine level: rollback (full group and a wrapped ring,
restored from the overwrite journal), eviction holes, shift, save/restore, batched decode. Every
refusal leaves ``state_digest`` unchanged. Expected values come from what was appended (kept here)
or from ropekv.rope's pure rotation, never from the operation under test."""

from __future__ import annotations

import pytest
import torch

from ropekv.adapters.native import NativeAdapter
from ropekv.cache.paged import PagedKVCache
from ropekv.contract import CacheContract
from ropekv.errors import CacheError, ContractMismatch, PayloadError
from ropekv.models import load_checkpoint
from ropekv.parity.cases import Case
from ropekv.rope import RopeScaling, RopeSpec
from ropekv.transfer.saved import load_sequence, save_sequence

KVH, D = 2, 8
ROPE = RopeSpec(head_dim=D, rotary_dim=D, theta=10000.0)


def make(window=None, sinks=0, block_size=3, key_form="rotated", depth=16, rope=ROPE, num_blocks=64):
    c = CacheContract(
        key_form=key_form,
        rope=rope,
        num_layers=2,
        num_kv_heads=KVH,
        head_dim=D,
        window=window,
        window_layers=(1,) if window else (),
        sink_tokens=sinks,
        block_size=block_size,
        dtype="float32",
    )
    return PagedKVCache(c, num_blocks, rollback_depth=depth)


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, KVH, D, generator=g) for _ in range(2)], [
        torch.randn(n, KVH, D, generator=g) for _ in range(2)
    ]


def put(cache, sid, start, n, seed):
    k, v = data(n, seed)
    cache.append(sid, torch.arange(start, start + n), k, v, key_form=cache.contract.key_form)
    return k, v


def views(cache, sid):
    return [cache.view(sid, layer) for layer in range(2)]


def same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x.positions, y.positions)
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


@pytest.mark.parametrize("draft", [1, 4, 9])  # 9 > the ring (2 sinks + 5): one chunk wraps over itself
def test_rollback_gives_back_exactly_the_draft_full_and_wrapped_ring(draft):
    cache = make(window=5, sinks=2)
    cache.create("s")
    put(cache, "s", 0, 11, seed=1)  # the ring (layer 1) has wrapped
    before, free = views(cache, "s"), cache.num_free_blocks("full")
    put(cache, "s", 11, draft, seed=2)  # the rejected draft overwrites ring slots
    cache.rollback("s", draft)
    same(views(cache, "s"), before)
    assert cache.num_free_blocks("full") == free and cache.last_position("s") == 10
    put(cache, "s", 11, 1, seed=3)  # the next token goes to the accepted length, not past the draft
    assert cache.positions("s")[-1] == 11


def test_rollback_beyond_the_journal_is_refused_unchanged():
    cache = make(window=5, sinks=2, depth=2)
    cache.create("s")
    put(cache, "s", 0, 11, seed=1)
    put(cache, "s", 11, 3, seed=2)
    digest = cache.state_digest()
    with pytest.raises(CacheError, match="rollback_depth=2"):
        cache.rollback("s", 3)
    with pytest.raises(CacheError):
        cache.rollback("s", 99)
    assert cache.state_digest() == digest
    cache.rollback("s", 2)  # within the journal: fine


def test_evict_keeps_survivor_positions_and_the_next_position():
    cache = make()
    cache.create("p")
    k, _ = put(cache, "p", 0, 10, seed=1)
    cache.fork("c", "p", 10)
    parent = views(cache, "p")
    cache.evict("c", [2, 5, 6])
    keep = [i for i in range(10) if i not in (2, 5, 6)]
    v = cache.view("c", 0)
    assert v.positions.tolist() == keep and torch.equal(v.keys, k[0][keep])
    same(views(cache, "p"), parent)  # copy-on-write: the shared blocks of the parent are untouched
    put(cache, "c", 10, 1, seed=2)  # last position + 1 = 10, not the 7 kept rows
    assert cache.positions("c").tolist() == keep + [10]
    digest = cache.state_digest()
    for bad in ([2], [11], [3, 3], []):
        with pytest.raises(CacheError):
            cache.evict("c", bad)
    assert cache.state_digest() == digest


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_shift_turns_rotated_keys_once_and_relabels_raw_keys(key_form):
    cache = make(key_form=key_form)
    cache.create("s")
    raw, _ = data(7, seed=4)
    stored = [ROPE.rotate(r, torch.arange(7)) for r in raw] if key_form == "rotated" else raw
    cache.append("s", torch.arange(7), stored, data(7, 5)[1], key_form=key_form)
    cache.shift("s", 1000, 3)
    v = cache.view("s", 0)
    want_pos = torch.tensor([0, 1, 2, 1003, 1004, 1005, 1006])
    assert torch.equal(v.positions, want_pos)
    if key_form == "rotated":  # as if rotated at the new positions from the start
        torch.testing.assert_close(v.keys, ROPE.rotate(raw[0].double(), want_pos).float(), atol=2e-5, rtol=0)
    else:
        assert torch.equal(v.keys, raw[0])


def test_shift_refusals_leave_the_cache_unchanged():
    cache = make()
    cache.create("s")
    put(cache, "s", 0, 7, seed=1)
    digest = cache.state_digest()
    for delta, start in ((-2, 3), (-1, 0), (0, 0)):  # 3 -> 1 collides with 2; 0 -> -1; no-op
        with pytest.raises(CacheError):
            cache.shift("s", delta, start)
    with pytest.raises(CacheError):
        cache.shift("s", 5, 100)  # nothing at or after 100
    assert cache.state_digest() == digest
    dyn = make(
        rope=ROPE.replace(scaling=RopeScaling("dynamic", factor=2.0), max_position_embeddings=16), key_form="raw"
    )
    dyn.create("s")
    put(dyn, "s", 0, 4, seed=1)
    digest = dyn.state_digest()
    with pytest.raises(ContractMismatch, match="not shift-invariant"):
        dyn.shift("s", 10, 0)
    assert dyn.state_digest() == digest


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


def test_restore_refuses_another_contract_and_corruption_importing_nothing(llama, tmp_path):
    tokens = torch.arange(16, 36)
    src = NativeAdapter(llama).make_engine(Case(length=20, block_size=7))
    src.prefill("s", tokens)
    path = tmp_path / "s.safetensors"
    save_sequence(src, "s", path, tokens)
    other = NativeAdapter(llama, key_form="raw").make_engine(Case(length=20, block_size=7))
    digest = other.cache.state_digest()
    with pytest.raises(ContractMismatch) as err:
        load_sequence(other, path)
    assert err.value.exit_code == 3 and other.cache.state_digest() == digest
    data_ = bytearray(path.read_bytes())
    data_[-5] ^= 0x40
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data_))
    same_contract = NativeAdapter(llama).make_engine(Case(length=20, block_size=7))
    digest = same_contract.cache.state_digest()
    with pytest.raises(PayloadError):
        load_sequence(same_contract, bad)
    assert same_contract.cache.state_digest() == digest and not same_contract.cache.seq_ids()
    sid, back = load_sequence(same_contract, path)
    assert torch.equal(back, tokens) and same_contract.cache.positions(sid).tolist() == list(range(20))
    src.evict("s", [3])
    with pytest.raises(CacheError, match="evicted"):
        save_sequence(src, "s", tmp_path / "holes.safetensors", tokens)


def test_batched_decode_matches_one_by_one(llama):
    """Left-padded batch vs each sequence decoded alone (per-row positions, never a shared cursor)."""
    tokens = torch.arange(16, 60)
    case = Case(length=30, block_size=7)
    alone, batched = NativeAdapter(llama).make_engine(case), NativeAdapter(llama).make_engine(case)
    for e in (alone, batched):
        for r, L in enumerate((30, 17, 4)):
            e.prefill(r, tokens[:L])
    outs = batched.decode_batch([0, 1, 2], tokens[[30, 17, 4]])
    for r, (L, out) in enumerate(zip((30, 17, 4), outs)):
        one = alone.decode(r, tokens[L])
        assert int(out.positions[0]) == L
        torch.testing.assert_close(out.logits, one.logits, atol=1e-4, rtol=0)


def test_ring_rollback_copies_a_shared_block_before_restoring_it():
    """A child forked after the draft shares the parent's ring blocks: the parent's rollback copies
    them first, so the child still sees the draft and the parent sees exactly its pre-draft state."""
    cache = make(window=5, sinks=2)
    cache.create("p")
    put(cache, "p", 0, 11, seed=1)
    before = views(cache, "p")
    put(cache, "p", 11, 3, seed=2)
    cache.fork("c", "p", 14)
    child = views(cache, "c")
    cache.rollback("p", 3)
    same(views(cache, "p"), before)
    same(views(cache, "c"), child)


def test_batched_decode_refusals_leave_the_cache_unchanged(llama):
    engine = NativeAdapter(llama).make_engine(Case(length=20, block_size=7))
    engine.prefill("a", torch.arange(16, 30))
    engine.prefill("b", torch.arange(16, 22))
    digest = engine.cache.state_digest()
    from ropekv.errors import UsageError

    with pytest.raises(UsageError):
        engine.decode_batch(["a", "a"], torch.tensor([20, 21]))
    with pytest.raises(CacheError):
        engine.decode_batch(["a", "zzz"], torch.tensor([20, 21]))
    with pytest.raises(UsageError):
        engine.decode_batch(["a", "b"], torch.tensor([20]))
    assert engine.cache.state_digest() == digest
