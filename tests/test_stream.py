"""The streamed handoff (ropekv.transfer.stream): exact pool-to-pool round trips, chunks received straight
into the pool, and all-or-nothing refusals (corruption, truncation, NaN, contract, capacity).

Sender and receiver run in two threads over :class:`Loopback`, an in-memory channel with the interface
of ``handshake.Channel`` (frames, JSON messages, posted tensor sends/receives that must match in size,
as gloo's do). The same code over real torch.distributed ranks is covered by tests/test_handoff.py
(the workers: a killed receiver, a bit flipped in flight, parity across the handoff).
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import threading

import pytest
import torch

from ropekv.cache.paged import PagedKVCache
from ropekv.contract import CacheContract
from ropekv.errors import (
    AdapterError,
    CacheError,
    CapacityError,
    ContractMismatch,
    PayloadError,
    TransportError,
    UsageError,
)
from ropekv.rope import RopeSpec
from ropekv.transfer.importer import ModelLimits
from ropekv.transfer.payload import window_rows
from ropekv.transfer.stream import (
    KIND_TRAILER,
    StreamHeader,
    chunk_plan,
    parse_trailer,
    rebuild_error,
    receive_sequence,
    send_sequence,
    trailer_bytes,
)

ROPE = RopeSpec(head_dim=8, rotary_dim=8, theta=10000.0)


def contract(**changes) -> CacheContract:
    base = dict(
        key_form="rotated", rope=ROPE, num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, weights_fingerprint="m"
    )
    return CacheContract(**{**base, **changes})


class _Sent:
    def wait(self) -> None:
        pass


class _Recv:
    def __init__(self, end: Loopback, tensor: torch.Tensor):
        self.end, self.tensor = end, tensor

    def wait(self) -> None:
        kind, data = self.end.take()
        want = self.tensor.numel() * self.tensor.element_size()
        if kind != "tensor" or len(data) != want:
            raise TransportError(f"loopback: expected a {want}-byte tensor, got {kind} of {len(data)} bytes")
        self.tensor.view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


class Loopback:
    """One end of an in-memory channel. ``drop_after``: the peer 'dies' after that many tensor sends."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue, drop_after: int | None = None):
        self.inbox, self.outbox, self.drop_after, self.sent_tensors = inbox, outbox, drop_after, 0

    @staticmethod
    def pair(drop_after: int | None = None) -> tuple[Loopback, Loopback]:
        a, b = queue.Queue(), queue.Queue()
        return Loopback(a, b, drop_after), Loopback(b, a)

    def take(self):
        try:
            item = self.inbox.get(timeout=10)
        except queue.Empty:
            raise TransportError("loopback: peer went silent") from None
        if item[0] == "dead":
            raise TransportError("loopback: connection reset by peer")
        return item

    def send(self, peer, kind, data, what):
        self.outbox.put(("frame", (kind, bytes(data))))

    def recv(self, peer, kind, max_bytes, what, after_header=None):
        got, (k, data) = self.take()
        assert got == "frame" and k == kind and len(data) <= max_bytes
        return data

    def send_json(self, peer, message, what):
        self.send(peer, 1, json.dumps(message).encode(), what)

    def recv_json(self, peer, what):
        return json.loads(self.recv(peer, 1, 1 << 20, what))

    def post_send(self, tensor, peer, what):
        if self.drop_after is not None and self.sent_tensors >= self.drop_after:
            self.outbox.put(("dead", None))
            raise TransportError("loopback: this end died mid-transfer")
        self.sent_tensors += 1
        self.outbox.put(("tensor", tensor.contiguous().view(torch.uint8).numpy().tobytes()))
        return _Sent()

    def post_recv(self, tensor, peer, what):
        return _Recv(self, tensor)


def filled(
    c: CacheContract, n: int, *, num_blocks: int = 64, seq_id="s", fragment: bool = False, seed: int = 0
) -> PagedKVCache:
    """A cache holding ``seq_id`` with ``n`` random tokens at positions 0.. (``fragment``: its blocks
    interleaved with another sequence's, so no chunk is consecutive in the pool)."""
    cache = PagedKVCache(c, num_blocks)
    g = torch.Generator().manual_seed(seed)
    cache.create(seq_id)
    if fragment:
        cache.create("other")
    for start in range(0, n, c.block_size):
        m = min(c.block_size, n - start)
        for sid in (seq_id, "other") if fragment else (seq_id,):
            last = cache.last_position(sid)
            pos = torch.arange(last + 1, last + 1 + m)
            keys = [
                torch.randn(m, c.num_kv_heads, c.head_dim, generator=g).to(c.torch_dtype) for _ in range(c.num_layers)
            ]
            values = [
                torch.randn(m, c.num_kv_heads, c.head_dim, generator=g).to(c.torch_dtype) for _ in range(c.num_layers)
            ]
            cache.append(sid, pos, keys, values, key_form=c.key_form)
    return cache


def transfer(
    source: PagedKVCache, target: PagedKVCache, *, tokens=None, chunk_bytes=64, wire=None, drop_after=None, **receive
):
    """Run sender and receiver in two threads; returns (send result or error, receive result or error)."""
    n = source.num_tokens("s")
    tokens = torch.arange(n) + 11 if tokens is None else tokens
    a, b = Loopback.pair(drop_after)
    out: dict[str, object] = {}

    def run(name, fn):
        try:
            out[name] = fn()
        except Exception as exc:
            out[name] = exc

    threads = [
        threading.Thread(
            target=run,
            args=("send", lambda: send_sequence(a, 1, source, "s", tokens, chunk_bytes=chunk_bytes, wire=wire)),
        ),
        threading.Thread(target=run, args=("recv", lambda: receive_sequence(b, 0, target, **receive))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out["send"], out["recv"]


def assert_same_sequence(a: PagedKVCache, b: PagedKVCache, seq="s") -> None:
    assert a.num_tokens(seq) == b.num_tokens(seq) and a.last_position(seq) == b.last_position(seq)
    for layer in range(a.contract.num_layers):
        x, y = a.view(seq, layer), b.view(seq, layer)
        assert torch.equal(x.positions, y.positions) and torch.equal(x.slots, y.slots)
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "c",
    [
        contract(),
        contract(dtype="bfloat16"),
        contract(window=5, window_layers=(1,), sink_tokens=2),
        contract(window=3, window_layers=(0, 1, 2)),
    ],
    ids=["float32", "bfloat16", "one-wrapped-ring-with-sinks", "all-sliding"],
)
@pytest.mark.parametrize("n", [1, 13])
@pytest.mark.parametrize("fragment", [False, True], ids=["consecutive", "fragmented"])
def test_round_trip_is_exact(c, n, fragment):
    source = filled(c, n, fragment=fragment)
    target = filled(c, 5, seq_id="resident", fragment=fragment, seed=1)  # the receiver's pool is not empty
    before = source.state_digest()
    sent, got = transfer(source, target)
    assert not isinstance(got, Exception), got
    assert_same_sequence(source, target)
    assert source.state_digest() == before  # the sender only read its pool
    assert (
        got.chunks == sent.chunks == len(chunk_plan(c, n, max(1, 64 // (8 * c.torch_dtype.itemsize))))
    )  # rows of one head
    if not fragment and not c.window_layers:
        assert got.in_place_chunks == got.chunks  # straight into the pool, no staging copy


def test_chunks_land_straight_in_the_pool_rows_the_sequence_owns():
    c = contract()
    source, target = filled(c, 10), PagedKVCache(c, 8)
    _, got = transfer(source, target, chunk_bytes=4 << 20)
    assert got.in_place_chunks == got.chunks == 2 * c.num_layers * c.num_kv_heads  # one chunk per head
    assert target.block_table("s") == (0, 1, 2)
    assert torch.equal(target.keys[1][:3].reshape(12, 2, 8)[:10], source.view("s", 1).keys)


class _CountingLoopback(Loopback):
    """A receiving end that records how many receives were posted and not yet waited on."""

    def __init__(self, end: Loopback):
        super().__init__(end.inbox, end.outbox)
        self.open, self.most = 0, 0

    def post_recv(self, tensor, peer, what):
        self.open += 1
        self.most = max(self.most, self.open)
        inner, outer = _Recv(self, tensor), self

        class Counted:
            def wait(self) -> None:
                inner.wait()
                outer.open -= 1

        return Counted()


@pytest.mark.parametrize("budget, most", [(None, 24), (448, 2), (1, 1)])
def test_receives_are_posted_up_to_the_bytes_in_flight(monkeypatch, budget, most):
    """Every chunk of a small stream is posted at once by default (gloo moves a message only once its
    receive is posted); a budget of two chunks' bytes keeps two open, a budget under one chunk one."""
    c = contract()
    source, target = filled(c, 13), PagedKVCache(c, 8)
    ends: list[_CountingLoopback] = []
    real_pair = Loopback.pair

    def pair(drop_after=None):
        a, b = real_pair(drop_after)
        ends.append(_CountingLoopback(b))
        return a, ends[-1]

    monkeypatch.setattr(Loopback, "pair", staticmethod(pair))
    receive = {} if budget is None else {"in_flight_bytes": budget}
    _, got = transfer(source, target, chunk_bytes=224, **receive)  # 7 rows: 224 + 192 bytes per head
    assert not isinstance(got, Exception), got
    assert got.chunks == 24 and ends[0].most == most
    assert_same_sequence(source, target)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_a_bad_in_flight_budget_is_refused_before_anything_is_received(bad):
    c = contract()
    target = PagedKVCache(c, 8)
    with pytest.raises(UsageError, match="in_flight_bytes"):
        receive_sequence(Loopback.pair()[1], 0, target, in_flight_bytes=bad)
    assert target.seq_ids() == []


def test_explicit_conversion_rotates_raw_keys_once():
    raw = contract(key_form="raw")
    source, target = filled(raw, 9), PagedKVCache(contract(), 16)
    _, got = transfer(source, target, convert="explicit")
    assert got.conversion == "rotate"
    for layer in range(3):
        src = source.view("s", layer)
        torch.testing.assert_close(target.view("s", layer).keys, ROPE.rotate(src.keys, src.positions))


# ---------------------------------------------------------------------- all or nothing


def _flip(index):
    def wire(i, chunk):
        if i != index:
            return chunk
        bad = chunk.clone()
        bad.view(torch.uint8).view(-1)[-1] ^= 0x01
        return bad

    return wire


def test_a_flipped_bit_in_any_chunk_imports_nothing():
    c = contract(window=5, window_layers=(2,))
    source = filled(c, 11)
    target = filled(c, 4, seq_id="resident")
    before_target, before_source = target.state_digest(), source.state_digest()
    chunks = len(chunk_plan(c, 11, 2))
    for index in range(chunks):
        sent, got = transfer(source, target, wire=_flip(index))
        assert isinstance(got, PayloadError) and f"chunk {index} " in str(got), got
        assert isinstance(sent, PayloadError) and "checksum" in str(sent)
        assert target.state_digest() == before_target and target.seq_ids() == ["resident"]
        assert source.state_digest() == before_source
    _, got = transfer(source, target)  # the same stream, undamaged, then imports
    assert_same_sequence(source, target)


def test_a_stream_cut_short_imports_nothing():
    c = contract()
    source, target = filled(c, 12), filled(c, 3, seq_id="resident")
    before = target.state_digest()
    free = target.num_free_blocks()
    for cut in (0, 1, 5):
        sent, got = transfer(source, target, drop_after=cut)
        assert isinstance(got, TransportError) and isinstance(sent, TransportError)
        assert target.state_digest() == before and target.num_free_blocks() == free
        assert not target.has("s")


def test_non_finite_values_are_refused_with_their_position():
    c = contract()
    source, target = filled(c, 6), PagedKVCache(c, 8)
    source.values[1][1, 0, 0, 3] = float("nan")  # token 4 (block 1, offset 0) at position 4
    before = target.state_digest()
    sent, got = transfer(source, target)
    assert isinstance(got, PayloadError) and "layer 1 values" in str(got) and "position 4" in str(got), got
    assert isinstance(sent, PayloadError) and target.state_digest() == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_infinite_and_nan_values_are_refused_with_their_position_in_each_dtype(value, dtype):
    c = contract(dtype=dtype)
    source, target = filled(c, 6), PagedKVCache(c, 8)
    source.keys[0][0, 2, 1, 5] = value  # token 2 (block 0, offset 2), KV head 1, at position 2
    before = target.state_digest()
    sent, got = transfer(source, target)
    assert isinstance(got, PayloadError) and "layer 0 keys" in str(got) and "position 2" in str(got), got
    assert isinstance(sent, PayloadError) and target.state_digest() == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_finite_values_whose_sum_overflows_are_imported(dtype):
    # float32's largest values (bfloat16 holds them too): any two sum to infinity, yet each is finite
    c = contract(dtype=dtype)
    source, target = filled(c, 6), PagedKVCache(c, 8)
    source.values[2].fill_(3.0e38)
    source.keys[1].fill_(-3.0e38)
    sent, got = transfer(source, target)
    assert not isinstance(got, Exception) and not isinstance(sent, Exception), got
    assert_same_sequence(source, target)


@pytest.mark.parametrize(
    "theirs, error, match",
    [
        (contract(rope=ROPE.replace(theta=500000.0)), ContractMismatch, "rope.theta"),
        (contract(key_form="raw"), ContractMismatch, "key_form"),
    ],
)
def test_contract_mismatch_is_refused_at_the_header(theirs, error, match):
    source, target = filled(theirs, 5), PagedKVCache(contract(), 8)
    before = target.state_digest()
    sent, got = transfer(source, target)
    assert isinstance(got, error) and isinstance(sent, error) and match in str(sent)
    assert sent.fields == got.fields and target.state_digest() == before


def test_capacity_and_taken_ids_are_refused_at_the_header():
    c = contract()
    source = filled(c, 13)  # 4 blocks
    small = PagedKVCache(c, 3)
    sent, got = transfer(source, small)
    assert isinstance(got, CapacityError) and isinstance(sent, CapacityError)
    taken = filled(c, 2, seq_id="s")
    sent, got = transfer(source, taken)
    assert isinstance(got, CacheError) and "already exists" in str(sent)


def test_accept_hook_refuses_before_anything_is_reserved():
    def accept(header):
        raise PayloadError(f"not the planned tokens ({header.num_tokens})")

    source, target = filled(contract(), 5), PagedKVCache(contract(), 8)
    sent, got = transfer(source, target, accept=accept)
    assert isinstance(sent, PayloadError) and "planned tokens (5)" in str(sent)
    assert target.num_free_blocks() == 8


@pytest.mark.parametrize(
    "limits, shift, match",
    [
        (
            ModelLimits(position_limit=12, vocab_size=100),
            10,
            r"position 12 \(token 2\) is beyond the model's 12 positions",
        ),
        (ModelLimits(position_limit=4, vocab_size=100), 0, "holds 5 tokens, more than the model's 4 positions"),
        (ModelLimits(position_limit=64, vocab_size=13), 0, r"token id 13 \(token 2\) is beyond the vocabulary of 13"),
    ],
    ids=["position", "count", "token"],
)
def test_the_receiving_model_limits_are_checked_at_the_header(limits, shift, match):
    """Checksums and contract fine, content impossible for the receiving model: refused, nothing reserved."""
    source, target = filled(contract(), 5), PagedKVCache(contract(), 8)
    if shift:
        source.shift("s", shift, 0)
    digest = target.state_digest()
    sent, got = transfer(source, target, limits=limits)  # tokens 11..15
    assert isinstance(got, PayloadError) and re.search(match, str(got)), got
    assert isinstance(sent, PayloadError) and re.search(match, str(sent))
    assert target.num_free_blocks() == 8 and target.state_digest() == digest


# ---------------------------------------------------------------------- the header


def _header(n=7) -> bytes:
    c = contract(window=3, window_layers=(1,))
    return StreamHeader(c, "s", torch.arange(n) + 1, torch.arange(n) * 2, 2).to_bytes()


def test_header_round_trips():
    h = StreamHeader.from_bytes(_header())
    assert h.num_tokens == 7 and h.seq_id == "s" and h.positions.tolist() == [0, 2, 4, 6, 8, 10, 12]
    assert h.layer_positions(1).tolist() == [8, 10, 12] and len(h.plan()) == 3 * 2 * 2 * 4 - 2 * 2 * 2
    assert window_rows(7, 3, 0).tolist() == [4, 5, 6]


def test_every_bit_flip_and_truncation_of_the_header_is_refused():
    data = bytearray(_header())
    for i in range(len(data)):
        for bit in (0, 5):
            data[i] ^= 1 << bit
            with pytest.raises(PayloadError):
                StreamHeader.from_bytes(bytes(data))
            data[i] ^= 1 << bit
    for cut in range(0, len(data), 7):
        with pytest.raises(PayloadError):
            StreamHeader.from_bytes(bytes(data[:cut]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(positions=torch.tensor([0, 2, 2])), "strictly increase"),
        (dict(tokens=torch.tensor([0, -1, 2])), "negative"),
        (dict(tokens=torch.tensor([0, 2**40, 2])), r"token id 1099511627776 \(token 1\) is beyond any vocabulary"),
        (dict(positions=torch.tensor([0, 1, 2**62])), r"position 4611686018427387904 is beyond any model's positions"),
        (dict(chunk_rows=0), "chunk_rows"),
    ],
)
def test_header_refuses_inconsistent_state(kwargs, match):
    c = contract()
    fields = dict(
        contract=c,
        seq_id="s",
        tokens=torch.arange(3),
        positions=torch.arange(3),
        chunk_rows=2,
    )
    with pytest.raises(PayloadError, match=match):
        StreamHeader(**{**fields, **kwargs})


# ---------------------------------------------------------------------- the trailer


def test_trailer_round_trips_and_every_bit_flip_truncation_or_other_count_is_refused():
    sums = [0, 1, 2**64 - 1, 0x0123456789ABCDEF]
    data = bytearray(trailer_bytes(sums))
    assert parse_trailer(bytes(data), 4) == tuple(sums) and len(data) == 8 + 4 * 8 + 32
    for i in range(len(data)):
        for bit in (0, 7):
            data[i] ^= 1 << bit
            with pytest.raises(PayloadError, match="trailer"):
                parse_trailer(bytes(data), 4)
            data[i] ^= 1 << bit
    for cut in range(len(data)):
        with pytest.raises(PayloadError, match="trailer"):
            parse_trailer(bytes(data[:cut]), 4)
    for chunks in (3, 5):  # well formed, for another number of chunks
        with pytest.raises(PayloadError, match="trailer"):
            parse_trailer(bytes(data), chunks)
    with pytest.raises(PayloadError, match="counts 5 checksum"):  # a self-consistent lie about its count
        parse_trailer(_recount(trailer_bytes(sums), 5), 4)


def _sealed(body: bytes) -> bytes:
    """A trailer body with the digest that matches it (a sender that lies consistently)."""
    return body + hashlib.sha256(body).digest()


def _recount(data: bytes, count: int) -> bytes:
    """The trailer ``data``'s checksums under another count."""
    return _sealed(count.to_bytes(8, "little") + data[8:-32])


class _LyingTrailer(Loopback):
    """A sending end whose trailer says chunk ``index``'s checksum is one more than it is."""

    def __init__(self, end: Loopback, index: int):
        super().__init__(end.inbox, end.outbox, end.drop_after)
        self.index = index

    def send(self, peer, kind, data, what):
        if kind == KIND_TRAILER:
            body = bytearray(data[:-32])
            at = 8 + 8 * self.index
            value = (int.from_bytes(body[at : at + 8], "little") + 1) % 2**64
            body[at : at + 8] = value.to_bytes(8, "little")
            data = _sealed(bytes(body))
        super().send(peer, kind, data, what)


@pytest.mark.parametrize("index", [0, 7, 23])
def test_a_trailer_that_disagrees_with_a_chunk_imports_nothing(monkeypatch, index):
    """The chunks arrive intact and the trailer is well formed, but its checksum for one chunk is not
    that chunk's: the receiver names the chunk and imports nothing."""
    c = contract()
    source, target = filled(c, 13), filled(c, 4, seq_id="resident")
    before = target.state_digest()
    real_pair = Loopback.pair

    def pair(drop_after=None):
        sender, receiver = real_pair(drop_after)
        return _LyingTrailer(sender, index), receiver

    monkeypatch.setattr(Loopback, "pair", staticmethod(pair))
    sent, got = transfer(source, target, chunk_bytes=224)
    assert isinstance(got, PayloadError) and f"chunk {index} " in str(got) and "checksum" in str(got), got
    assert isinstance(sent, PayloadError) and "checksum" in str(sent)
    assert target.state_digest() == before and target.seq_ids() == ["resident"]


def test_an_adapter_error_another_process_reported_is_rebuilt_with_its_message():
    sent = AdapterError("vllm", "connector metadata", "a list", "dict")
    error = rebuild_error(type(sent).__name__, f"vLLM consumer: {sent}")
    assert type(error) is AdapterError and str(error) == f"vLLM consumer: {sent}"
    assert error.exit_code == sent.exit_code
