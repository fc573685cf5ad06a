"""Engine refusals: every bad request is refused with a RopeKVError and the cache unchanged.

"Unchanged" is checked three ways after each refusal: ``cache.state_digest()`` (every pool, positions
tensor, allocator and block table), a ``torch.equal`` of a copy of every key/value pool tensor, and the
gathered view of every live sequence. Each case runs in both key forms and three cache layouts: full
attention, a window (with a sink) on every layer, and a window on one layer only (two block groups).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.errors import CacheError, CapacityError, ConfigError, ContractMismatch, RopeKVError, UsageError
from ropekv.models import load_checkpoint
from ropekv.parity.cases import token_stream

KEY_FORMS = ("rotated", "raw")
LAYOUTS = ("full", "window", "mixed")
BLOCK = 4
WINDOW, SINKS = 5, 1
PREFILL = 12  # three full blocks of 4; wraps the 6-slot ring (1 sink + window 5) of windowed layers


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


def contract_for(ckpt, key_form: str, layout: str) -> CacheContract:
    c = CacheContract.for_model(
        ckpt.config, key_form=key_form, block_size=BLOCK, window=None, weights_fingerprint=ckpt.weights_fingerprint
    )
    if layout == "window":
        c = c.replace(window=WINDOW, window_layers=tuple(range(c.num_layers)), sink_tokens=SINKS)
    elif layout == "mixed":
        c = c.replace(window=WINDOW, window_layers=(1,), sink_tokens=SINKS)
    return c


def make_engine(ckpt, key_form: str, layout: str, num_blocks: int = 64) -> Engine:
    return Engine(ckpt, contract_for(ckpt, key_form, layout), num_blocks)


def tokens(ckpt, n: int, seed: int = 0) -> torch.Tensor:
    return token_stream(ckpt.config.vocab_size, n, seed)


@dataclass
class Snapshot:
    digest: str
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    views: dict
    tables: dict
    free: dict


def snapshot(engine: Engine) -> Snapshot:
    cache = engine.cache
    layers = range(cache.contract.num_layers)
    return Snapshot(
        digest=cache.state_digest(),
        keys=[t.clone() for t in cache.keys],
        values=[t.clone() for t in cache.values],
        views={(s, layer): cache.view(s, layer) for s in cache.seq_ids() for layer in layers},
        tables={
            (s, g): (cache.num_tokens(s), cache.last_position(s), cache.block_table(s, g))
            for s in cache.seq_ids()
            for g in cache.groups
        },
        free={g: cache.num_free_blocks(g) for g in cache.groups},
    )


def assert_unchanged(engine: Engine, before: Snapshot) -> None:
    after = snapshot(engine)
    assert after.digest == before.digest
    for name in ("keys", "values"):
        for layer, (a, b) in enumerate(zip(getattr(before, name), getattr(after, name))):
            assert torch.equal(a, b), f"{name} pool of layer {layer} changed"
    assert after.tables == before.tables and after.free == before.free
    assert after.views.keys() == before.views.keys()
    for key, view in before.views.items():
        other = after.views[key]
        for field in ("keys", "values", "positions", "slots"):
            assert torch.equal(getattr(view, field), getattr(other, field)), f"view {key} {field} changed"


def refused(engine: Engine, error: type[RopeKVError], match: str, call) -> RopeKVError:
    """``call()`` raises exactly ``error`` (message matching ``match``) and changes nothing."""
    before = snapshot(engine)
    with pytest.raises(RopeKVError, match=match) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert_unchanged(engine, before)
    return info.value


@pytest.fixture(params=[(k, lay) for k in KEY_FORMS for lay in LAYOUTS], ids=lambda p: f"{p[0]}-{p[1]}")
def served(request, llama):
    """An engine holding sequence "s" (PREFILL tokens, prefilled in chunks) and "f", a fork of all of "s"
    (a wrapped ring only keeps what a whole-prefix fork needs) that decoded one more token."""
    key_form, layout = request.param
    engine = make_engine(llama, key_form, layout)
    engine.prefill("s", tokens(llama, PREFILL), chunk_size=5)
    engine.fork("f", "s", PREFILL)
    engine.decode("f", 7)
    return engine


def kv(engine: Engine, n: int, fill: float = 0.5) -> list[torch.Tensor]:
    c = engine.contract
    return [torch.full((n, c.num_kv_heads, c.head_dim), fill) for _ in range(c.num_layers)]


# ----------------------------------------------------------------------------------- capacity


@pytest.mark.parametrize("key_form", KEY_FORMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_beyond_capacity(llama, key_form, layout):
    engine = make_engine(llama, key_form, layout, num_blocks=3)
    engine.prefill("s", tokens(llama, PREFILL))  # full layers: 3 blocks of 3; windowed layers: 2 of 3
    err = refused(engine, CapacityError, "needs", lambda: engine.prefill("t", tokens(llama, PREFILL, seed=1)))
    assert "'t'" in str(err) and "free" in str(err)
    assert not engine.cache.has("t")  # the refused new sequence is not left behind, empty
    if layout != "window":  # a full-attention layer grows: one more token needs a fourth block
        refused(engine, CapacityError, "full group", lambda: engine.decode("s", 9))
        refused(engine, CapacityError, "full group", lambda: engine.prefill("s", tokens(llama, 3)))
    else:  # every layer is a ring: the sequence can grow forever in its two blocks
        engine.decode("s", 9)


def test_copy_on_write_beyond_capacity(llama):
    """A fork writing into a block it shares needs a private copy; with no free block it is refused."""
    engine = make_engine(llama, "rotated", "full", num_blocks=3)
    engine.prefill("s", tokens(llama, 10))  # blocks 0, 1, 2 (the last one half full)
    engine.fork("t", "s", 9)  # shares all three
    refused(engine, CapacityError, "copy-on-write", lambda: engine.decode("t", 5))


# ----------------------------------------------------------------------------------- positions


NOT_INCREASING = [
    ([PREFILL - 1], "does not follow the last cached position 11"),
    ([3], "does not follow"),
    ([PREFILL, PREFILL], "strictly increase"),
    ([PREFILL + 1, PREFILL], "strictly increase"),
    ([PREFILL, PREFILL + 2, PREFILL + 2], "strictly increase"),
]


def test_position_that_does_not_increase(served):
    c = served.contract
    for positions, match in NOT_INCREASING:
        n = len(positions)
        refused(
            served,
            CacheError,
            match,
            lambda: served.cache.append(
                "s", torch.tensor(positions), kv(served, n), kv(served, n), key_form=c.key_form
            ),
        )


def test_malformed_positions_and_keys(served):
    c = served.contract
    for positions, match in [
        (torch.tensor([12.0]), "integers"),
        (torch.tensor([[12]]), "1-D"),
        (torch.tensor([], dtype=torch.int64), "1-D"),
        ([12], "tensor"),
    ]:
        refused(
            served,
            CacheError,
            match,
            lambda: served.cache.append("s", positions, kv(served, 1), kv(served, 1), key_form=c.key_form),
        )
    for keys, match in [
        (kv(served, 1, float("nan")), "NaN or infinite"),
        (kv(served, 1, float("inf")), "NaN or infinite"),
        (kv(served, 2), "shape"),
        (kv(served, 1)[:1], "one tensor per layer"),
        ([t.to(torch.int32) for t in kv(served, 1)], "floating-point"),
    ]:
        refused(
            served,
            CacheError,
            match,
            lambda: served.cache.append("s", torch.tensor([PREFILL]), keys, kv(served, 1), key_form=c.key_form),
        )
        refused(
            served,
            CacheError,
            match,
            lambda: served.cache.append("s", torch.tensor([PREFILL]), kv(served, 1), keys, key_form=c.key_form),
        )


def test_position_beyond_the_model(llama):
    engine = make_engine(llama, "rotated", "full")
    limit = llama.config.position_limit
    engine.prefill("s", tokens(llama, limit))
    refused(engine, UsageError, f"beyond the model's {limit} positions", lambda: engine.decode("s", 5))


# ----------------------------------------------------------------------------------- key form


def test_key_form_the_contract_does_not_allow(served):
    ours = served.contract.key_form
    other = "raw" if ours == "rotated" else "rotated"
    err = refused(
        served,
        ContractMismatch,
        f"key_form={other!r}",
        lambda: served.cache.append("s", torch.tensor([PREFILL]), kv(served, 1), kv(served, 1), key_form=other),
    )
    assert err.fields == ("key_form",) and err.exit_code == 3
    assert ("twice their position" if other == "rotated" else "position 0") in str(err)
    refused(
        served,
        ContractMismatch,
        "key_form='sideways'",
        lambda: served.cache.append("s", torch.tensor([PREFILL]), kv(served, 1), kv(served, 1), key_form="sideways"),
    )


@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_backend_that_contradicts_the_key_form(llama, key_form):
    contract = contract_for(llama, key_form, "window")
    wrong = "rotated" if key_form == "raw" else "rotate_on_read"
    with pytest.raises(ContractMismatch):
        Engine(llama, contract, 8, backend=wrong)


def test_contracts_that_cannot_exist(llama):
    with pytest.raises(ConfigError, match="rotation_index='cache' needs key_form='raw'"):
        contract_for(llama, "rotated", "window").replace(rotation_index="cache")
    assert contract_for(llama, "raw", "full").kernel_rotates  # derived: it cannot disagree with key_form
    assert not contract_for(llama, "rotated", "full").kernel_rotates


def test_rotated_keys_for_length_dependent_rope_are_refused(make_tiny_checkpoint):
    ckpt = load_checkpoint(
        make_tiny_checkpoint("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    )
    with pytest.raises(ContractMismatch, match="stale frequencies"):
        make_engine(ckpt, "rotated", "full")
    make_engine(ckpt, "raw", "full")  # rotate on read: accepted


def test_contract_for_another_model_is_refused(llama):
    contract = contract_for(llama, "rotated", "full").replace(weights_fingerprint="0" * 16)
    with pytest.raises(ContractMismatch, match="weights_fingerprint"):
        Engine(llama, contract, 8)


# ----------------------------------------------------------------------------------- unknown sequences


def test_decode_for_an_unknown_sequence(served):
    refused(served, CacheError, "unknown sequence 'nope'", lambda: served.decode("nope", 5))
    refused(served, CacheError, "unknown sequence", lambda: served.free("nope"))
    refused(served, CacheError, "unknown sequence 'nope'", lambda: served.fork("g", "nope", 1))
    refused(
        served,
        CacheError,
        "unknown sequence",
        lambda: served.cache.append(
            "nope", torch.tensor([0]), kv(served, 1), kv(served, 1), key_form=served.contract.key_form
        ),
    )
    refused(served, CacheError, "unknown sequence", lambda: served.decode(["not", "hashable"], 5))
    served.free("f")
    refused(served, CacheError, "unknown sequence 'f'", lambda: served.decode("f", 5))


def test_bad_tokens_are_refused_before_anything_runs(served):
    vocab = served.config.vocab_size
    refused(served, UsageError, "token ids", lambda: served.decode("s", vocab))
    refused(served, UsageError, "token ids", lambda: served.decode("s", -1))
    refused(served, UsageError, "token ids", lambda: served.prefill("s", torch.tensor([1, vocab])))
    refused(served, UsageError, "non-empty 1-D", lambda: served.prefill("s", torch.tensor([], dtype=torch.int64)))
    refused(served, UsageError, "non-empty 1-D", lambda: served.prefill("t", torch.tensor([[1, 2]])))
    refused(served, UsageError, "chunk_size", lambda: served.prefill("s", torch.tensor([1, 2]), chunk_size=0))
    assert not served.cache.has("t")


# ----------------------------------------------------------------------------------- forks


def test_fork_longer_than_what_is_cached(served):
    refused(served, CacheError, r"prefix_len 13 out of range \(0, 12\]", lambda: served.fork("g", "s", PREFILL + 1))
    for bad in (0, -1, 2.5, True, "3", None):
        refused(served, CacheError, "out of range", lambda: served.fork("g", "s", bad))
    refused(served, CacheError, "already exists", lambda: served.fork("f", "s", PREFILL))
    assert not served.cache.has("g")


@pytest.mark.parametrize("key_form", KEY_FORMS)
@pytest.mark.parametrize("layout", ["window", "mixed"])
def test_fork_of_a_prefix_the_ring_already_overwrote(llama, key_form, layout):
    engine = make_engine(llama, key_form, layout)
    engine.prefill("s", tokens(llama, PREFILL))
    # token 1 (the oldest live non-sink token of a 4-token prefix) was overwritten by token 6
    refused(engine, CacheError, "already overwrote the slot of token 1", lambda: engine.fork("g", "s", 4))
    refused(engine, CacheError, "already overwrote the slot of token 6", lambda: engine.fork("g", "s", PREFILL - 1))
    engine.fork("g", "s", PREFILL)  # the whole ring: accepted
    engine.fork("h", "s", SINKS)  # only the sink: accepted


# ------------------------------------------------------------------ chunked prefill is all or nothing


@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_chunked_prefill_refused_midway_changes_nothing(llama, key_form):
    engine = make_engine(llama, key_form, "full", num_blocks=3)
    engine.prefill("s", tokens(llama, 4))
    refused(engine, CapacityError, "needs", lambda: engine.prefill("s", tokens(llama, 12), chunk_size=4))


@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_chunked_prefill_past_the_position_limit_changes_nothing(llama, key_form):
    engine = make_engine(llama, key_form, "full", num_blocks=64)
    engine.prefill("s", tokens(llama, 4))
    limit = llama.config.position_limit
    refused(engine, UsageError, "beyond", lambda: engine.prefill("s", tokens(llama, limit), chunk_size=16))
