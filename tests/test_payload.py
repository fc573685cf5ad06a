"""The handoff payload: exact round trips, and a reader that raises only PayloadError, whatever the bytes.

Payloads here are synthetic (no model): two layers, two KV heads, head_dim 8, a handful of tokens, so
every single-bit flip and every truncation of a whole payload can be tried exhaustively.
"""

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ropekv.cache.paged import PagedKVCache
from ropekv.contract import CacheContract
from ropekv.errors import PayloadError
from ropekv.rope import RopeSpec
from ropekv.transfer import Handoff, read_payload, write_payload
from ropekv.transfer.importer import ModelLimits, import_handoff
from ropekv.transfer.payload import MAX_HEADER_BYTES, _checksum, window_rows

ROPE = RopeSpec(head_dim=8, rotary_dim=8, theta=10000.0)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def contract(**changes) -> CacheContract:
    base = dict(
        key_form="rotated", rope=ROPE, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, weights_fingerprint="m"
    )
    return CacheContract(**{**base, **changes})


def handoff(c: CacheContract | None = None, n: int = 3, seq_id="s", first_position: int = 0) -> Handoff:
    c = c or contract()
    g = torch.Generator().manual_seed(n)
    keys, values = [], []
    for layer in range(c.num_layers):
        rows = len(window_rows(n, c.window, c.sink_tokens)) if layer in c.window_layers else n
        keys.append(torch.randn(rows, c.num_kv_heads, c.head_dim, generator=g).to(c.torch_dtype))
        values.append(torch.randn(rows, c.num_kv_heads, c.head_dim, generator=g).to(c.torch_dtype))
    return Handoff(
        contract=c,
        seq_id=seq_id,
        tokens=torch.arange(n, dtype=torch.int64) + 7,
        positions=torch.arange(n, dtype=torch.int64) + first_position,
        keys=tuple(keys),
        values=tuple(values),
    )


PAYLOAD = write_payload(handoff())


def split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def forge(header: dict, body: bytes, *, fix_checksum: bool = True) -> bytes:
    """Bytes with ``header`` (re-encoded, length fixed) and ``body``; the checksum recomputed so that only
    the lie itself can give the payload away."""
    header = json.loads(json.dumps(header))
    meta = header.get("__metadata__")
    if fix_checksum and isinstance(meta, dict):
        try:
            entries = [
                (k, e["dtype"], e["shape"], memoryview(body)[e["data_offsets"][0] : e["data_offsets"][1]])
                for k, e in sorted(header.items())
                if k != "__metadata__"
            ]
            meta["checksum"] = _checksum(meta, entries)
        except (KeyError, TypeError, IndexError, ValueError):
            pass  # too broken to checksum: the lie is in the structure anyway
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def assert_same(a: Handoff, b: Handoff) -> None:
    assert a.contract == b.contract and a.seq_id == b.seq_id
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.positions, b.positions)
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert x.dtype == y.dtype and torch.equal(x, y)


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "c",
    [
        contract(),
        contract(dtype="bfloat16"),
        contract(key_form="raw"),
        contract(window=3, window_layers=(1,), sink_tokens=1),
        contract(window=2, window_layers=(0, 1)),
    ],
    ids=["float32", "bfloat16", "raw", "one-windowed-layer-with-sink", "all-windowed"],
)
@pytest.mark.parametrize("n", [1, 7])
def test_round_trip_is_exact(c, n):
    h = handoff(c, n, seq_id=3, first_position=5)
    assert_same(read_payload(write_payload(h)), h)
    assert read_payload(bytearray(write_payload(h))).num_tokens == n


def test_tensors_that_share_storage_are_written_apart():
    h = handoff()
    shared = Handoff(
        contract=h.contract, seq_id="s", tokens=h.tokens, positions=h.tokens[:3] - 7, keys=h.keys, values=h.keys
    )  # values are the key tensors themselves
    assert_same(read_payload(write_payload(shared)), shared)


def test_payload_is_self_describing_safetensors():
    from safetensors.torch import load

    header, _ = split(PAYLOAD)
    meta = header["__metadata__"]
    assert meta["format"] == "ropekv.handoff" and meta["version"] == "1"
    assert CacheContract.from_json(meta["contract"]) == contract()
    assert json.loads(meta["sequence"]) == {"seq_id": "s", "num_tokens": 3}
    assert meta["checksum"].startswith("sha256:")
    assert sorted(load(PAYLOAD)) == [
        "layers.0.keys",
        "layers.0.values",
        "layers.1.keys",
        "layers.1.values",
        "positions",
        "tokens",
    ]


def test_overhead_is_the_header_and_two_int64_vectors():
    h = handoff(n=64)
    data = write_payload(h)
    header_len = struct.unpack("<Q", data[:8])[0]
    assert len(data) == 8 + header_len + h.tensor_bytes() + 2 * 64 * 8


def test_window_rows_keep_sinks_and_the_last_window():
    assert window_rows(4, 3, 1).tolist() == [0, 1, 2, 3]
    assert window_rows(5, 3, 1).tolist() == [0, 2, 3, 4]
    assert window_rows(9, 3, 1).tolist() == [0, 6, 7, 8]
    assert window_rows(9, 3, 0).tolist() == [6, 7, 8]


# ---------------------------------------------------------------------- the writer's side of validation


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda h: dict(positions=torch.tensor([0, 2, 2])), "strictly increase"),
        (lambda h: dict(positions=torch.tensor([-1, 0, 1])), "negative"),
        (lambda h: dict(tokens=torch.tensor([1, -2, 3])), "negative"),
        (lambda h: dict(tokens=torch.tensor([1, 2])), "3 position"),
        (lambda h: dict(tokens=torch.tensor([1.0, 2.0, 3.0])), "int64"),
        (lambda h: dict(keys=(h.keys[0],)), "tuple of 2"),
        (lambda h: dict(keys=(h.keys[0][:2], h.keys[1])), r"keys of layer 0"),
        (lambda h: dict(values=(h.values[0].double(), h.values[1])), r"values of layer 0"),
        (lambda h: dict(keys=(h.keys[0], torch.full_like(h.keys[1], float("nan")))), "NaN"),
        (lambda h: dict(values=(h.values[0], torch.full_like(h.values[1], float("inf")))), "infinite"),
        (lambda h: dict(seq_id=1.5), "seq_id"),
    ],
)
def test_handoff_refuses_inconsistent_state(mutate, match):
    h = handoff()
    fields = dict(
        contract=h.contract, seq_id=h.seq_id, tokens=h.tokens, positions=h.positions, keys=h.keys, values=h.values
    )
    with pytest.raises(PayloadError, match=match):
        Handoff(**{**fields, **mutate(h)})


# ---------------------------------------------------------------------- the reader


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "truncated"),
        (PAYLOAD[:7], "truncated"),
        (struct.pack("<Q", 0) + PAYLOAD[8:], "header length 0"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + PAYLOAD[8:], "header length"),
        (struct.pack("<Q", 1 << 62) + PAYLOAD[8:], "header length"),
        (PAYLOAD[:40], "truncated"),
        (PAYLOAD[:-1], "data section"),
        (PAYLOAD + b"\0", "data section"),
        (b"GGUF" + bytes(60), "header length"),
        ("not bytes", "must be bytes"),
        (None, "must be bytes"),
    ],
)
def test_reader_names_what_is_wrong(data, match):
    with pytest.raises(PayloadError, match=match):
        read_payload(data)


def _lie(edit):
    header, body = split(PAYLOAD)
    edit(header)
    return forge(header, body)


def _set_meta(key, value):
    return lambda h: h["__metadata__"].__setitem__(key, value)


def _sequence(**fields):
    return _set_meta("sequence", json.dumps({"seq_id": "s", "num_tokens": 3, **fields}))


@pytest.mark.parametrize(
    "edit, match",
    [
        (_set_meta("format", "ropekv.other"), "format"),
        (_set_meta("version", "2"), "version '2' is not supported"),
        (lambda h: h.pop("__metadata__"), "no __metadata__"),
        (lambda h: h["__metadata__"].pop("sequence"), "exactly the strings"),
        (_set_meta("contract", "{}"), "contract"),
        (_set_meta("contract", contract(num_kv_heads=4).to_json()), r"layers.0.keys.*\[3, 4, 8\]"),
        (_set_meta("contract", contract(num_layers=3).to_json()), "missing"),
        (_set_meta("contract", contract(dtype="float16").to_json()), "F16"),
        (_set_meta("contract", contract(window=1, window_layers=(0,)).to_json()), r"layers.0.keys.*\[1, 2, 8\]"),
        (_sequence(num_tokens=4), r"num_tokens=4"),
        (_sequence(num_tokens=0), "num_tokens"),
        (_sequence(num_tokens=1 << 40), "num_tokens"),
        (_sequence(extra=1), "exactly seq_id"),
        (_sequence(seq_id=[1]), "seq_id"),
        (_set_meta("sequence", "[["), "not JSON"),
        (lambda h: h["tokens"].__setitem__("dtype", "F64"), r"'tokens' is F64"),
        (lambda h: h["tokens"].__setitem__("dtype", "U8"), "dtype 'U8'"),
        (lambda h: h["tokens"].__setitem__("shape", [2]), "data_offsets span"),
        (lambda h: h["tokens"].__setitem__("shape", [1 << 60]), "data_offsets span"),
        (lambda h: h["tokens"].__setitem__("shape", [-3]), "non-negative"),
        (lambda h: h["tokens"].__setitem__("data_offsets", [0, 1 << 50]), "not within"),
        (lambda h: h["tokens"].__setitem__("shape", [3, 1]), r"'tokens' is I64 \[3, 1\]"),
        (lambda h: h.__setitem__("extra", {"dtype": "I64", "shape": [0], "data_offsets": [0, 0]}), "unexpected"),
        (lambda h: h.pop("positions"), "(missing|tile|cover)"),
        (lambda h: h["positions"].__setitem__("junk", 1), "exactly dtype"),
    ],
)
def test_reader_catches_header_lies_even_with_a_valid_checksum(edit, match):
    with pytest.raises(PayloadError, match=match):
        read_payload(_lie(edit))


def test_reader_catches_swapped_offsets():
    header, body = split(PAYLOAD)
    a, b = header["layers.0.keys"], header["layers.1.keys"]
    a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]
    forged = forge(header, body, fix_checksum=False)
    with pytest.raises(PayloadError, match="checksum"):
        read_payload(forged)


def _with_tensor(name, tensor):
    """A forged payload (valid checksum) whose tensor ``name`` is replaced by ``tensor`` of the same size."""
    header, body = split(PAYLOAD)
    a, b = header[name]["data_offsets"]
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    assert len(raw) == b - a
    return forge(header, body[:a] + raw + body[b:])


@pytest.mark.parametrize(
    "name, tensor, match",
    [
        ("positions", torch.tensor([0, 2, 1]), "strictly increase"),
        ("positions", torch.tensor([-5, 0, 1]), "negative"),
        ("tokens", torch.tensor([3, -1, 4]), "negative"),
        ("positions", torch.tensor([0, 1, 2]) + 2**62, r"position 4611686018427387904 \(token 0\) is beyond any model"),
        ("positions", torch.tensor([0, 1, 2**40]), r"position 1099511627776 \(token 2\) is beyond any model"),
        ("tokens", torch.tensor([3, 2**40, 4]), r"token id 1099511627776 \(token 1\) is beyond any vocabulary"),
        ("layers.1.values", torch.full((3, 2, 8), float("nan")), "NaN"),
        ("layers.0.keys", torch.full((3, 2, 8), float("-inf")), "infinite"),
    ],
)
def test_reader_catches_bad_values_even_with_a_valid_checksum(name, tensor, match):
    with pytest.raises(PayloadError, match=match):
        read_payload(_with_tensor(name, tensor))


def test_every_single_bit_flip_is_detected():
    data = bytearray(PAYLOAD)
    for i in range(len(data)):
        for bit in range(8):
            data[i] ^= 1 << bit
            with pytest.raises(PayloadError):
                read_payload(bytes(data))
            data[i] ^= 1 << bit


def test_every_truncation_is_detected():
    for n in range(len(PAYLOAD)):
        with pytest.raises(PayloadError):
            read_payload(PAYLOAD[:n])


def _only_payload_error(data: bytes) -> None:
    try:
        read_payload(data)
    except PayloadError:
        return
    raise AssertionError("a damaged payload was accepted")


@FUZZ
@given(st.lists(st.integers(0, len(PAYLOAD) * 8 - 1), min_size=1, max_size=8, unique=True))
def test_fuzz_bit_flips(bits):
    data = bytearray(PAYLOAD)
    for b in bits:
        data[b // 8] ^= 1 << (b % 8)
    _only_payload_error(bytes(data))


@FUZZ
@given(st.integers(0, len(PAYLOAD) - 1), st.binary(max_size=64))
def test_fuzz_truncated_and_spliced(cut, tail):
    data = PAYLOAD[:cut] + tail
    if data != PAYLOAD:
        _only_payload_error(data)


@FUZZ
@given(st.integers(0, len(PAYLOAD) - 1), st.binary(min_size=1, max_size=16))
def test_fuzz_overwritten_bytes(at, junk):
    data = bytearray(PAYLOAD)
    data[at : at + len(junk)] = junk
    data = bytes(data[: len(PAYLOAD)])
    if data != PAYLOAD:
        _only_payload_error(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@FUZZ
@given(
    st.sampled_from(["tokens", "positions", "layers.0.keys", "layers.1.values", "__metadata__"]),
    st.sampled_from(["dtype", "shape", "data_offsets", "format", "version", "contract", "sequence", "checksum"]),
    json_values,
    st.booleans(),
)
def test_fuzz_header_lies(entry, key, value, fix_checksum):
    header, body = split(PAYLOAD)
    assume(header[entry].get(key) != value and not (key == "checksum" and fix_checksum))
    header[entry][key] = value
    _only_payload_error(forge(header, body, fix_checksum=fix_checksum))


@FUZZ
@given(st.binary(max_size=256))
def test_fuzz_arbitrary_bytes(data):
    _only_payload_error(data)


@FUZZ
@given(json_values)
def test_fuzz_arbitrary_headers(header):
    text = json.dumps(header).encode()
    _only_payload_error(struct.pack("<Q", len(text)) + text)


# ---------------------------------------------------------------------- the reading model's limits


@pytest.mark.parametrize(
    "limits, match",
    [
        (ModelLimits(position_limit=3, vocab_size=100), r"position 3 \(token 1\) is beyond the model's 3 positions"),
        (ModelLimits(position_limit=2, vocab_size=100), "holds 3 tokens, more than the model's 2 positions"),
        (ModelLimits(position_limit=100, vocab_size=8), r"token id 8 \(token 1\) is beyond the vocabulary of 8"),
    ],
    ids=["position", "count", "token"],
)
def test_import_refuses_content_the_reading_model_cannot_run_leaving_the_cache_as_it_was(limits, match):
    """Positions 0, 3, 4 and tokens 7, 8, 9: a valid handoff, impossible for these models."""
    h = handoff()
    h = Handoff(
        contract=h.contract,
        seq_id="s",
        tokens=h.tokens,
        positions=torch.tensor([0, 3, 4]),
        keys=h.keys,
        values=h.values,
    )
    cache = PagedKVCache(h.contract, 8)
    cache.create("other")
    k = [torch.ones(2, 2, 8), torch.ones(2, 2, 8)]
    cache.append("other", torch.arange(2), k, k, key_form="rotated")
    digest, ids = cache.state_digest(), cache.seq_ids()
    with pytest.raises(PayloadError, match=match):
        import_handoff(cache, h, limits=limits)
    assert cache.state_digest() == digest and cache.seq_ids() == ids and cache.num_free_blocks() == 7
    assert import_handoff(cache, h, limits=ModelLimits(position_limit=5, vocab_size=10)) == "s"
