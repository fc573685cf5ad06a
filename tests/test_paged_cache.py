"""PagedKVCache: block tables, prefix forks with copy-on-write, sliding rings with sinks, and
validate-then-write appends (a rejected call leaves ``state_digest`` unchanged)."""

import math

import pytest
import torch

from ropekv.cache.paged import PagedKVCache
from ropekv.contract import CacheContract
from ropekv.errors import CacheError, CapacityError, ContractMismatch
from ropekv.rope import RopeSpec

KVH, D = 2, 4
ROPE = RopeSpec(head_dim=D, rotary_dim=D, theta=10000.0)


def contract(block_size=4, num_layers=2, window=None, window_layers=None, sinks=0, dtype="float32", key_form="rotated"):
    if window is not None and window_layers is None:
        window_layers = tuple(range(num_layers))
    return CacheContract(
        key_form=key_form,
        rope=ROPE,
        num_layers=num_layers,
        num_kv_heads=KVH,
        head_dim=D,
        window=window,
        window_layers=window_layers or (),
        sink_tokens=sinks,
        block_size=block_size,
        dtype=dtype,
    )


def live(n, window, sinks):
    """Write indices live after n appends (the reference rule, written independently)."""
    if window is None:
        return list(range(n))
    return [i for i in range(n) if i < sinks or i >= n - window]


def slot(i, window, sinks):
    return i if window is None or i < sinks else sinks + (i - sinks) % window


class Ref:
    """What was appended to each sequence, kept in float64 lists; the truth views are compared to."""

    def __init__(self, cache: PagedKVCache, seed=0):
        self.cache, self.c = cache, cache.contract
        self.gen = torch.Generator().manual_seed(seed)
        self.pos: dict = {}
        self.keys: dict = {}
        self.values: dict = {}

    def create(self, sid):
        self.cache.create(sid)
        self.pos[sid], self.keys[sid], self.values[sid] = (
            [],
            [[] for _ in range(self.c.num_layers)],
            [[] for _ in range(self.c.num_layers)],
        )

    def data(self, n):
        shape = (n, KVH, D)
        return (
            [torch.randn(shape, generator=self.gen) for _ in range(self.c.num_layers)],
            [torch.randn(shape, generator=self.gen) for _ in range(self.c.num_layers)],
        )

    def append(self, sid, n, start=None):
        first = (self.pos[sid][-1] + 1) if self.pos[sid] else (start if start is not None else 0)
        positions = torch.arange(first, first + n)
        k, v = self.data(n)
        self.cache.append(sid, positions, k, v, key_form=self.c.key_form)
        self.pos[sid] += positions.tolist()
        for layer in range(self.c.num_layers):
            self.keys[sid][layer] += list(k[layer])
            self.values[sid][layer] += list(v[layer])

    def fork(self, new, parent, p):
        self.cache.fork(new, parent, p)
        self.pos[new] = self.pos[parent][:p]
        self.keys[new] = [k[:p] for k in self.keys[parent]]
        self.values[new] = [v[:p] for v in self.values[parent]]

    def check(self, sid):
        n = len(self.pos[sid])
        assert self.cache.num_tokens(sid) == n
        assert self.cache.last_position(sid) == (self.pos[sid][-1] if n else -1)
        for layer in range(self.c.num_layers):
            w = self.c.window if layer in self.c.window_layers else None
            idx = live(n, w, self.c.sink_tokens)
            view = self.cache.view(sid, layer)
            assert view.positions.dtype == torch.int64 and view.slots.dtype == torch.int64
            assert view.positions.tolist() == [self.pos[sid][i] for i in idx]
            assert view.slots.tolist() == [slot(i, w, self.c.sink_tokens) for i in idx]
            dt = self.c.torch_dtype
            want_k = torch.stack([self.keys[sid][layer][i] for i in idx]) if idx else torch.empty(0, KVH, D)
            want_v = torch.stack([self.values[sid][layer][i] for i in idx]) if idx else torch.empty(0, KVH, D)
            assert view.keys.dtype == dt and view.keys.shape == (len(idx), KVH, D)
            torch.testing.assert_close(view.keys, want_k.to(dt), rtol=0, atol=0)
            torch.testing.assert_close(view.values, want_v.to(dt), rtol=0, atol=0)


# ---------------------------------------------------------------------- full attention


LENGTHS = [(b, n) for b in (1, 7, 16) for n in sorted({1, 2, 3, b - 1, b, b + 1, 300} - {0})]


@pytest.mark.parametrize("block_size, n", LENGTHS)
def test_views_match_appended_tensors(block_size, n):
    cache = PagedKVCache(contract(block_size), num_blocks=320)
    ref = Ref(cache)
    ref.create("s")
    ref.append("s", n, start=37)  # a nonzero first position
    ref.check("s")
    assert cache.num_free_blocks() == 320 - math.ceil(n / block_size)
    assert cache.positions("s").tolist() == list(range(37, 37 + n))
    assert len(cache.block_table("s")) == math.ceil(n / block_size)


@pytest.mark.parametrize("block_size", [1, 3, 7])
def test_chunked_appends_and_views_between_them(block_size):
    cache = PagedKVCache(contract(block_size), num_blocks=64)
    ref = Ref(cache)
    ref.create(0)
    for n in (1, 2, block_size, 5, 1, 1, 2 * block_size + 1):
        ref.append(0, n, start=11)
        ref.check(0)  # also proves the cached gather index is invalidated on append


def test_empty_sequence_view():
    cache = PagedKVCache(contract(), num_blocks=4)
    ref = Ref(cache)
    ref.create("e")
    ref.check("e")
    assert cache.last_position("e") == -1 and cache.positions("e").numel() == 0


def test_dtype_is_the_contract_dtype():
    cache = PagedKVCache(contract(dtype="bfloat16"), num_blocks=8)
    ref = Ref(cache)
    ref.create("b")
    ref.append("b", 9)
    ref.check("b")
    assert cache.keys[0].dtype == torch.bfloat16


def test_accounting():
    c = contract(block_size=4, num_layers=3, window=5, window_layers=(1,), sinks=2)
    cache = PagedKVCache(c, num_blocks=10)
    per_block = 4 * KVH * D * 4 * 2  # keys + values, float32
    assert cache.nbytes() == 10 * per_block * 3
    assert cache.bytes_in_use() == 0
    ref = Ref(cache)
    ref.create("a")
    ref.append("a", 30)
    # full group: 30 tokens -> 8 blocks for 2 layers; sliding ring of 7 slots -> 2 blocks for 1 layer
    assert cache.num_free_blocks("full") == 2 and cache.num_free_blocks("sliding") == 8
    assert cache.bytes_in_use() == 8 * per_block * 2 + 2 * per_block * 1
    cache.free("a")
    assert cache.bytes_in_use() == 0 and cache.num_free_blocks("full") == 10


# ---------------------------------------------------------------------- forks


def test_fork_shares_full_blocks_and_copies_the_partial_one_on_write():
    cache = PagedKVCache(contract(block_size=4), num_blocks=16)
    ref = Ref(cache)
    ref.create("p")
    ref.append("p", 10, start=100)  # blocks 0, 1, 2; block 1 holds tokens 4..7
    parent_table = cache.block_table("p")
    ref.fork("c", "p", 6)  # not a multiple of 4: block 1 is shared, partially used by the child
    assert cache.block_table("c") == parent_table[:2]
    assert [cache.refcount(b) for b in parent_table] == [2, 2, 1]
    ref.check("c")  # the child's view excludes the parent's tokens 6, 7 in the shared block
    before = cache.view("p", 0)

    ref.append("c", 3)
    child_table = cache.block_table("c")
    assert child_table[0] == parent_table[0]  # the full block stays shared
    assert child_table[1] != parent_table[1]  # the partial one was copied on write
    assert [cache.refcount(b) for b in parent_table] == [2, 1, 1]
    assert cache.block_table("p") == parent_table
    ref.check("c")
    ref.check("p")
    torch.testing.assert_close(cache.view("p", 0).keys, before.keys, rtol=0, atol=0)

    ref.append("p", 5)  # parent writes only into its own blocks
    ref.check("p")
    ref.check("c")
    cache.free("p")
    assert cache.refcount(parent_table[0]) == 1
    ref.check("c")


def test_parent_copies_on_write_when_the_child_shares_its_last_block():
    cache = PagedKVCache(contract(block_size=4), num_blocks=16)
    ref = Ref(cache)
    ref.create("p")
    ref.append("p", 6)
    ref.fork("c", "p", 6)
    shared = cache.block_table("p")[1]
    ref.append("p", 1)  # writes into the shared partial block: the parent copies it
    assert cache.block_table("p")[1] != shared and cache.block_table("c")[1] == shared
    assert cache.refcount(shared) == 1
    ref.check("p")
    ref.check("c")
    ref.append("c", 4)  # refcount 1 now: the child writes in place
    assert cache.block_table("c")[1] == shared
    ref.check("c")
    ref.check("p")


def test_fork_of_a_fork_and_free_in_any_order():
    cache = PagedKVCache(contract(block_size=3, num_layers=3, window=5, window_layers=(0, 2), sinks=1), num_blocks=40)
    ref = Ref(cache)
    ref.create("a")
    ref.append("a", 5, start=1000)
    ref.fork("b", "a", 5)
    ref.append("b", 1)
    ref.fork("c", "b", 4)
    for sid, n in (("a", 2), ("c", 7), ("b", 3)):
        ref.append(sid, n)
    for sid in "abc":
        ref.check(sid)
    cache.free("b")
    ref.check("a")
    ref.check("c")
    cache.free("a")
    cache.free("c")
    assert cache.num_free_blocks("full") == cache.num_free_blocks("sliding") == 40


def _fork_is_safe(p, n_parent, window, sinks):
    """Brute force: every write index the child needs still owns its slot in the parent's ring."""
    for j in live(p, window, sinks):
        last_writer = max(m for m in range(n_parent) if slot(m, window, sinks) == slot(j, window, sinks))
        if last_writer != j:
            return False
    return True


@pytest.mark.parametrize("window, sinks, block_size", [(5, 0, 2), (5, 2, 3), (7, 1, 4), (3, 3, 1)])
def test_sliding_fork_refused_exactly_when_the_parent_overwrote_needed_slots(window, sinks, block_size):
    c = contract(block_size=block_size, num_layers=2, window=window, window_layers=(1,), sinks=sinks)
    ring = window + sinks
    for n_parent in range(1, 2 * ring + 3):
        cache = PagedKVCache(c, num_blocks=4 * ring + 8)
        ref = Ref(cache, seed=n_parent)
        ref.create("p")
        ref.append("p", n_parent, start=3)
        for p in range(1, n_parent + 1):
            digest = cache.state_digest()
            if _fork_is_safe(p, n_parent, window, sinks):
                ref.fork(("c", p), "p", p)
                ref.check(("c", p))
                ref.append(("c", p), ring + 2)  # wraps the child's ring through shared blocks
                ref.check(("c", p))
                ref.check("p")
                cache.free(("c", p))
            else:
                with pytest.raises(CacheError, match="already overwrote the slot of token"):
                    cache.fork(("c", p), "p", p)
                assert cache.state_digest() == digest and not cache.has(("c", p))


@pytest.mark.parametrize(
    "args, match",
    [
        (("c", "nope", 2), "unknown sequence 'nope'"),
        (("p", "p", 2), "sequence 'p' already exists"),
        (("c", "p", 0), r"prefix_len 0 out of range \(0, 6\]"),
        (("c", "p", 7), r"prefix_len 7 out of range"),
        (("c", "p", 2.0), r"prefix_len 2.0 out of range"),
    ],
)
def test_bad_forks_raise_and_change_nothing(args, match):
    cache = PagedKVCache(contract(), num_blocks=8)
    ref = Ref(cache)
    ref.create("p")
    ref.append("p", 6)
    digest = cache.state_digest()
    with pytest.raises(CacheError, match=match):
        cache.fork(*args)
    assert cache.state_digest() == digest and cache.seq_ids() == ["p"]


# ---------------------------------------------------------------------- sliding windows


@pytest.mark.parametrize("window", [5, 7])
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_sliding_window_wraps_with_logical_positions(window, sinks, block_size):
    c = contract(block_size=block_size, num_layers=3, window=window, window_layers=(0, 2), sinks=sinks)
    cache = PagedKVCache(c, num_blocks=64)
    ref = Ref(cache)
    ref.create("w")
    total = 0
    for n in (1, 2, 3, 1, window, 1, 2 * window + 1, 4, 1, 1, 3):  # several wraps, odd chunk sizes
        ref.append("w", n, start=50)
        total += n
        ref.check("w")
    view = cache.view("w", 0)
    expected = list(range(50, 50 + sinks)) + list(range(50 + total - window, 50 + total))
    assert view.positions.tolist() == expected
    assert sorted(view.slots.tolist()) == list(range(sinks + window))  # every ring slot is live
    assert view.slots.tolist() != sorted(view.slots.tolist())  # and the slots have wrapped
    assert cache.view("w", 1).positions.tolist() == list(range(50, 50 + total))  # the full layer keeps all
    assert len(cache.block_table("w", "sliding")) == math.ceil((sinks + window) / block_size)


@pytest.mark.parametrize("sinks", [0, 2])
def test_chunk_longer_than_the_ring(sinks):
    c = contract(block_size=3, num_layers=1, window=5, sinks=sinks)
    cache = PagedKVCache(c, num_blocks=8)
    ref = Ref(cache)
    ref.create("x")
    ref.append("x", 23, start=7)
    ref.check("x")
    ref.append("x", 12)
    ref.check("x")
    assert cache.groups == ("sliding",)
    assert cache.positions("x").tolist() == ref.pos["x"][:sinks] + ref.pos["x"][-5:]


def test_diagram_example_s2_w5_after_13_tokens():
    """The ring drawn in docs/contract.md."""
    cache = PagedKVCache(contract(block_size=4, num_layers=1, window=5, sinks=2), num_blocks=4)
    ref = Ref(cache)
    ref.create("d")
    ref.append("d", 13)
    view = cache.view("d", 0)
    assert view.positions.tolist() == [0, 1, 8, 9, 10, 11, 12]
    assert view.slots.tolist() == [0, 1, 3, 4, 5, 6, 2]


# ---------------------------------------------------------------------- rejected appends


def _cache_with_data():
    cache = PagedKVCache(contract(block_size=4, num_layers=2, window=5, window_layers=(1,), sinks=1), num_blocks=8)
    ref = Ref(cache)
    ref.create("s")
    ref.append("s", 6, start=20)
    return cache, ref


def _kv(n, layers=2, kvh=KVH, d=D):
    return [torch.randn(n, kvh, d) for _ in range(layers)], [torch.randn(n, kvh, d) for _ in range(layers)]


def _nan_keys():
    k, v = _kv(2)
    k[1][1, 0, 2] = float("nan")
    return k, v


def _inf_values():
    k, v = _kv(2)
    v[0][0, 1, 0] = float("inf")
    return k, v


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda c: c.append("nope", torch.arange(30, 32), *_kv(2), key_form="rotated"),
            CacheError,
            "unknown sequence 'nope'",
        ),
        (
            lambda c: c.append("s", torch.arange(30, 32), *_kv(2), key_form="raw"),
            ContractMismatch,
            "every key would sit at position 0",
        ),
        (
            lambda c: c.append("s", torch.tensor([30, 30]), *_kv(2), key_form="rotated"),
            CacheError,
            "position 30 follows 30",
        ),
        (lambda c: c.append("s", torch.tensor([31, 30]), *_kv(2), key_form="rotated"), CacheError, "strictly increase"),
        (
            lambda c: c.append("s", torch.tensor([25, 26]), *_kv(2), key_form="rotated"),
            CacheError,
            "first position 25 does not follow the last cached position 25",
        ),
        (lambda c: c.append("s", torch.tensor([3]), *_kv(1), key_form="rotated"), CacheError, "first position 3"),
        (
            lambda c: c.append("s", torch.tensor([30.0, 31.0]), *_kv(2), key_form="rotated"),
            CacheError,
            "positions must be integers",
        ),
        (lambda c: c.append("s", torch.tensor([[30, 31]]), *_kv(2), key_form="rotated"), CacheError, "1-D"),
        (
            lambda c: c.append("s", torch.tensor([], dtype=torch.long), *_kv(0), key_form="rotated"),
            CacheError,
            "n >= 1",
        ),
        (lambda c: c.append("s", [30, 31], *_kv(2), key_form="rotated"), CacheError, "positions must be a tensor"),
        (
            lambda c: c.append("s", torch.arange(30, 33), *_kv(2), key_form="rotated"),
            CacheError,
            r"keys\[0\] has shape \(2, 2, 4\), expected \(3, 2, 4\)",
        ),
        (lambda c: c.append("s", torch.arange(30, 32), *_kv(2, kvh=1), key_form="rotated"), CacheError, "expected"),
        (lambda c: c.append("s", torch.arange(30, 32), *_kv(2, d=8), key_form="rotated"), CacheError, "expected"),
        (
            lambda c: c.append("s", torch.arange(30, 32), *_kv(2, layers=1), key_form="rotated"),
            CacheError,
            "one tensor per layer",
        ),
        (
            lambda c: c.append("s", torch.arange(30, 32), torch.randn(2, 2, KVH, D), _kv(2)[1], key_form="rotated"),
            CacheError,
            "one tensor per layer",
        ),
        (
            lambda c: c.append(
                "s", torch.arange(30, 32), [torch.ones(2, KVH, D, dtype=torch.int64)] * 2, _kv(2)[1], key_form="rotated"
            ),
            CacheError,
            "floating-point",
        ),
        (
            lambda c: c.append("s", torch.arange(30, 32), *_nan_keys(), key_form="rotated"),
            CacheError,
            r"keys\[1\] holds NaN",
        ),
        (
            lambda c: c.append("s", torch.arange(30, 32), *_inf_values(), key_form="rotated"),
            CacheError,
            r"values\[0\] holds NaN or infinite",
        ),
        (
            lambda c: c.append("s", torch.arange(30, 60), *_kv(30), key_form="rotated"),
            CapacityError,
            r"needs 7 block\(s\) in the full group \(7 new, 0 copy-on-write\) with 6 free",
        ),
        (lambda c: c.view("nope", 0), CacheError, "unknown sequence"),
        (lambda c: c.free("nope"), CacheError, "unknown sequence"),
        (lambda c: c.create("s"), CacheError, "already exists"),
    ],
)
def test_rejected_calls_raise_typed_errors_and_change_nothing(call, error, match):
    cache, ref = _cache_with_data()
    digest = cache.state_digest()
    with pytest.raises(error, match=match):
        call(cache)
    assert cache.state_digest() == digest
    ref.check("s")


def test_key_form_mismatch_names_the_field_and_the_consequence():
    cache = PagedKVCache(contract(key_form="raw"), num_blocks=4)
    cache.create("r")
    with pytest.raises(
        ContractMismatch, match="stored keys are rotated, reader rotates again: keys would sit at twice their position"
    ) as info:
        cache.append("r", torch.arange(2), *_kv(2), key_form="rotated")
    assert info.value.fields == ("key_form",)


def test_capacity_error_leaves_state_unchanged():
    cache = PagedKVCache(contract(block_size=4), num_blocks=3)
    ref = Ref(cache)
    ref.create("a")
    ref.append("a", 9)  # 3 blocks: pool full, last block has room for 3 more
    digest = cache.state_digest()
    with pytest.raises(
        CapacityError, match=r"needs 1 block\(s\) in the full group \(1 new, 0 copy-on-write\) with 0 free"
    ):
        ref.append("a", 4)
    assert cache.state_digest() == digest
    ref.pos["a"] = ref.pos["a"][:9]
    ref.append("a", 3)  # fits in the last block
    ref.check("a")


def test_copy_on_write_counts_against_capacity():
    cache = PagedKVCache(contract(block_size=4), num_blocks=3)
    ref = Ref(cache)
    ref.create("p")
    ref.append("p", 6)  # blocks 0, 1
    ref.fork("c", "p", 6)
    ref.create("q")
    ref.append("q", 1)  # the last free block
    digest = cache.state_digest()
    with pytest.raises(CapacityError, match=r"\(0 new, 1 copy-on-write\) with 0 free"):
        cache.append("c", torch.tensor([6]), *_kv(1), key_form="rotated")
    assert cache.state_digest() == digest
    cache.free("q")
    ref.append("c", 1)
    ref.check("c")
    ref.check("p")


def test_sliding_group_capacity_is_checked_too():
    c = contract(block_size=2, num_layers=2, window=5, window_layers=(1,), sinks=0)
    cache = PagedKVCache(c, num_blocks=4)
    ref = Ref(cache)
    ref.create("a")
    ref.append("a", 7)  # full: 4 blocks (pool full), sliding: 3 blocks
    ref.create("b")
    digest = cache.state_digest()
    with pytest.raises(CapacityError, match="full group .* sliding group"):
        cache.append("b", torch.arange(3), *_kv(3), key_form="rotated")
    assert cache.state_digest() == digest


# ---------------------------------------------------------------------- several sequences


def test_three_interleaved_sequences_do_not_disturb_each_other():
    c = contract(block_size=3, num_layers=2, window=7, window_layers=(0,), sinks=1)
    cache = PagedKVCache(c, num_blocks=60)
    ref = Ref(cache)
    starts = {"a": 0, "b": 1000, "c": 17}
    for sid in starts:
        ref.create(sid)
    for step, n in enumerate((1, 4, 2, 3, 1, 5, 1, 1, 2, 6, 1, 3)):
        sid = "abc"[step % 3]
        ref.append(sid, n + step % 2, start=starts[sid])
        for other in "abc":
            ref.check(other)
    assert set(cache.seq_ids()) == {"a", "b", "c"}
    cache.free("b")
    assert not cache.has("b")
    ref.create("d")  # reuses b's blocks
    ref.append("d", 20, start=5)
    for sid in "acd":
        ref.check(sid)


def test_state_digest_sees_every_kind_of_change():
    cache = PagedKVCache(contract(block_size=2, window=3, window_layers=(1,)), num_blocks=8)
    ref = Ref(cache)
    seen = {cache.state_digest()}
    ref.create("a")
    seen.add(cache.state_digest())
    ref.append("a", 3)
    seen.add(cache.state_digest())
    ref.fork("b", "a", 2)
    seen.add(cache.state_digest())
    cache.keys[0][0, 0, 0, 0] += 1.0
    seen.add(cache.state_digest())
    assert len(seen) == 5
