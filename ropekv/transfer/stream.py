"""The streamed handoff: one sequence's KV cache sent from the sender's pool into the receiver's pool.

Wire protocol, per sequence, over a :class:`~ropekv.transfer.handshake.Channel` (docs/handoff.md):

1. sender -> receiver, one frame of kind ``KIND_STREAM``: the *header*, ``JSON || tokens int64 [n] ||
   positions int64 [n] || sha256`` where the JSON holds ``format``, ``version``, the sender's
   contract, ``seq_id``, ``num_tokens``, ``chunk_rows`` and ``hash``, and the sha256 (32 bytes)
   covers everything before it.
2. receiver -> sender: ``{"step": "go"}``, or a refusal (the same message as 5.) having reserved nothing.
3. sender -> receiver: the chunks, each a ``[rows, D]`` run of one KV head of one layer's keys or
   values (:func:`chunk_plan`), sent as views of the (head-major) pool wherever its rows are consecutive.
4. sender -> receiver, one frame of kind ``KIND_TRAILER``: the *trailer*, ``le64 count || le64
   [count] || sha256``: one ``xxh3_64`` checksum per chunk, seeded with its index.
5. receiver -> sender: ``{"step": "ack", "ok": true}`` or ``{"ok": false, "error_class", "message", "fields"}``.

The checksums come after the chunks so that the sender can hash the chunks while they are on the
wire: it posts every chunk, then hashes them in order, then waits for the sends (version 2 hashed
them all before the header: 16 ms of 82 for 189 MB, docs/performance.md). The receiver receives
straight into blocks it reserved (``PagedKVCache.reserve``) with every chunk's receive posted up
front (up to 256 MB in flight), and hashes each chunk and checks its values are finite (one sum;
value by value only when the sum is not finite) while the later ones arrive. Only when the
trailer's checksums match every chunk and every value is finite are keys converted (an explicit key
form conversion, once) and the sequence committed; on any failure the blocks are released unread, so nothing is imported. The
sender only reads its pool: a receiver that dies mid-transfer leaves the sender's cache as it was.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache.import_policy import ImportPolicy
from ..cache.paged import PagedKVCache, Reservation, head_rows, pool_rows
from ..contract import CacheContract
from ..errors import ALL_ERRORS, AdapterError, ContractMismatch, PayloadError, RopeKVError, TransportError, UsageError
from ..numbers import is_int
from ..rope import MAX_POSITIONS
from .handshake import Channel, Posted
from .importer import ModelLimits, all_positions, plan_import
from .payload import MAX_TOKENS, check_token_ids, contract_of_metadata, held_rows

FORMAT = "ropekv.stream"
# 3: the checksums travel in a trailer after the chunks; 2: in the header; 2 and 3: a chunk is a run of
# one KV head's rows (the pool is head-major); 1 sent [rows, KVH * D]
VERSION = 3
KIND_STREAM = 3  # frame kinds of their own (handshake.py: 1 JSON, 2 payload)
KIND_TRAILER = 4
HASH = "xxh3_64"
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_IN_FLIGHT_BYTES = 256 << 20  # receives posted at once (staging copies included) bound the memory they hold
MAX_JSON_BYTES = 4 << 20
_DIGEST = 32
_ERRORS = {cls.__name__: cls for cls in ALL_ERRORS}


@dataclass(frozen=True)
class Chunk:
    """Rows ``[start, stop)`` of KV head ``head`` of one layer's keys (``part == 0``) or values (``part == 1``)."""

    layer: int
    part: int
    head: int
    start: int
    stop: int

    def label(self) -> str:
        return f"layer {self.layer} {('keys', 'values')[self.part]} head {self.head} rows {self.start}..{self.stop}"


def chunk_plan(c: CacheContract, num_tokens: int, chunk_rows: int) -> list[Chunk]:
    """Chunks in wire order: for each layer its keys, then its values, each KV head in turn,
    ``chunk_rows`` rows (of ``D`` values) at a time: one head's rows lie contiguously in the pool.
    A windowed layer carries only the rows its ring holds (``held_rows``), as the payload does."""
    out = []
    for layer in range(c.num_layers):
        rows = len(held_rows(c, layer, num_tokens))
        for part in (0, 1):
            for head in range(c.num_kv_heads):
                out += [Chunk(layer, part, head, a, min(rows, a + chunk_rows)) for a in range(0, rows, chunk_rows)]
    return out


def checksum(data: torch.Tensor, index: int) -> int:
    """xxh3_64 of the bytes of the contiguous CPU tensor ``data``, seeded with the chunk index (a chunk
    delivered in another chunk's place fails its check)."""
    import xxhash

    return xxhash.xxh3_64_intdigest(data.view(torch.uint8).numpy().data, seed=index)


@dataclass(frozen=True, eq=False)
class StreamHeader:
    """What the receiver knows before any key or value arrives. Validated on construction."""

    contract: CacheContract
    seq_id: str | int
    tokens: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64, strictly increasing, >= 0
    chunk_rows: int

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        if not (self.tokens.dtype == self.positions.dtype == torch.int64) or self.positions.numel() != n:
            raise PayloadError("stream header: tokens and positions must be int64 of equal length")
        if not 1 <= n <= MAX_TOKENS:
            raise PayloadError(f"stream header: {n} token(s), not in [1, {MAX_TOKENS}]")
        check_token_ids(self.tokens, "stream header:")
        pos = self.positions
        if int(pos[0]) < 0 or (n > 1 and not bool((pos[1:] > pos[:-1]).all())):
            raise PayloadError("stream header: positions must be non-negative and strictly increase")
        if int(pos[-1]) >= MAX_POSITIONS:
            raise PayloadError(
                f"stream header: position {int(pos[-1])} is beyond any model's positions (at most 2**40)"
            )
        if not is_int(self.chunk_rows) or self.chunk_rows < 1:
            raise PayloadError(f"stream header: chunk_rows {self.chunk_rows!r} is not a positive integer")

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def plan(self) -> list[Chunk]:
        return chunk_plan(self.contract, self.num_tokens, self.chunk_rows)

    def layer_positions(self, layer: int) -> torch.Tensor:
        """Positions ``[rows]`` of the tokens ``layer`` carries."""
        if self.contract.layer(layer).attention.window is None:
            return self.positions
        return self.positions[held_rows(self.contract, layer, self.num_tokens)]

    def to_bytes(self) -> bytes:
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "contract": self.contract.to_json(),
            "seq_id": self.seq_id,
            "num_tokens": self.num_tokens,
            "chunk_rows": self.chunk_rows,
            "hash": HASH,
        }
        text = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        body = len(text).to_bytes(8, "little") + text + self.tokens.numpy().tobytes() + self.positions.numpy().tobytes()
        return body + hashlib.sha256(body).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> StreamHeader:
        """Parse and validate header bytes; raises only :class:`PayloadError`."""
        if len(data) < 8 + _DIGEST:
            raise PayloadError(f"stream header truncated: {len(data)} byte(s)")
        body, digest = data[:-_DIGEST], data[-_DIGEST:]
        if hashlib.sha256(body).digest() != digest:
            raise PayloadError("stream header digest mismatch: the header was changed in transit")
        json_len = int.from_bytes(body[:8], "little")
        if not 2 <= json_len <= min(MAX_JSON_BYTES, len(body) - 8):
            raise PayloadError(f"stream header: JSON length {json_len} does not fit the {len(body)}-byte header")
        try:
            meta = json.loads(body[8 : 8 + json_len])
        except (ValueError, RecursionError) as exc:
            raise PayloadError(f"stream header JSON: {exc}") from None
        keys = {"format", "version", "contract", "seq_id", "num_tokens", "chunk_rows", "hash"}
        if not isinstance(meta, dict) or set(meta) != keys:
            raise PayloadError(f"stream header must hold exactly {', '.join(sorted(keys))}")
        if meta["format"] != FORMAT or meta["version"] != VERSION or meta["hash"] != HASH:
            raise PayloadError(
                f"stream header: {meta['format']!r} version {meta['version']!r} hash {meta['hash']!r} "
                f"is not {FORMAT!r} version {VERSION} hash {HASH!r}"
            )
        n, seq_id = meta["num_tokens"], meta["seq_id"]
        if not is_int(n) or not 1 <= n <= MAX_TOKENS or len(body) != 8 + json_len + 16 * n:
            raise PayloadError(f"stream header: num_tokens {str(n)[:40]} does not match its {len(body)} bytes")
        if not ((isinstance(seq_id, str) and len(seq_id) <= 256) or is_int(seq_id)):
            raise PayloadError("stream header: seq_id must be a string (<= 256 chars) or an integer")
        ints = torch.frombuffer(bytearray(body[8 + json_len :]), dtype=torch.int64)
        return cls(
            contract_of_metadata(str(meta["contract"])),
            seq_id,
            ints[:n].clone(),
            ints[n:].clone(),
            meta["chunk_rows"],
        )


def trailer_bytes(checksums: list[int]) -> bytes:
    """The trailer: ``le64 count || le64 [count] || sha256`` (the digest over everything before it)."""
    body = len(checksums).to_bytes(8, "little") + b"".join(x.to_bytes(8, "little") for x in checksums)
    return body + hashlib.sha256(body).digest()


def trailer_bound(chunks: int) -> int:
    """The trailer's size for ``chunks`` chunks: the receiver takes no more."""
    return 8 + 8 * chunks + _DIGEST


def parse_trailer(data: bytes, chunks: int) -> tuple[int, ...]:
    """The checksums of a trailer that must carry ``chunks`` of them; raises only :class:`PayloadError`."""
    if len(data) != trailer_bound(chunks):
        raise PayloadError(
            f"stream trailer: {len(data)} byte(s), not the {trailer_bound(chunks)} of {chunks} checksum(s)"
        )
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise PayloadError("stream trailer digest mismatch: the checksums were changed in transit")
    if int.from_bytes(body[:8], "little") != chunks:
        raise PayloadError(
            f"stream trailer: it counts {int.from_bytes(body[:8], 'little')} checksum(s) for {chunks} chunk(s)"
        )
    return tuple(int.from_bytes(body[8 + 8 * i : 16 + 8 * i], "little") for i in range(chunks))


# ---------------------------------------------------------------------- sending


@dataclass
class SendFacts:
    seq_id: Hashable
    tokens: int
    tensor_bytes: int
    header_bytes: int
    chunks: int
    seconds: dict[str, float] = field(default_factory=dict)  # header (incl. go), send (incl. hashing), trailer, ack

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self), seq_id=str(self.seq_id))


def send_sequence(
    channel: Channel,
    peer: int,
    cache: PagedKVCache,
    seq_id: Hashable,
    tokens: torch.Tensor,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    wire: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> SendFacts:
    """Stream ``seq_id`` of ``cache`` (``tokens [n]``: the ids it consumed) to ``peer``; returns when
    the receiver acknowledged the import, or raises its refusal as the typed error it reported.

    ``wire(index, chunk)`` may replace a chunk on the wire (tests: a bit flipped in flight). The
    cache is only read, and must not change until this returns."""
    t0 = time.perf_counter()
    c = cache.contract
    if c.kv_quant is not None:  # refused before anything is sent: the stream's chunks are pool bytes only
        raise UsageError(
            f"stream of {seq_id!r}: an 8-bit cache's codes need their per-layer scales, which the stream format "
            "does not carry; hand it off as a payload (export_handoff / write_payload) instead"
        )
    n = cache.num_tokens(seq_id)
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 1 or tokens.numel() != n or tokens.is_floating_point() or n == 0:
        raise UsageError(f"stream of {seq_id!r}: tokens must be 1-D integer ids, one per cached token ({n})")
    row_bytes = c.head_dim * c.torch_dtype.itemsize  # one row of one KV head
    chunk_rows = max(1, chunk_bytes // row_bytes)
    plan = chunk_plan(c, n, chunk_rows)
    header = StreamHeader(
        c,
        seq_id if isinstance(seq_id, (str, int)) else str(seq_id),
        tokens.to(torch.int64).cpu().clone(),
        all_positions(cache, seq_id).cpu(),
        chunk_rows,
    )
    blob = header.to_bytes()
    what = f"stream of {seq_id!r} to rank {peer}"
    channel.send(peer, KIND_STREAM, blob, f"{what} (header)")
    data = _sender_chunks(cache, seq_id, plan)  # while the receiver checks the header and reserves
    facts = SendFacts(seq_id, n, sum(d.numel() * d.element_size() for d in data), len(blob), len(plan))
    verdict = channel.recv_json(peer, f"{what}: go or refusal")
    t1 = time.perf_counter()
    if verdict.get("step") != "go":
        raise refusal(verdict, f"{what}: rank {peer} refused the header")
    # Every chunk is posted first, then hashed while it is on the wire: the pool does not change
    # until this returns, so the bytes hashed are the bytes sent, and hashing before each post held
    # every chunk back by the hashing of the ones before it.
    posted = [
        channel.post_send(d if wire is None else wire(i, d), peer, f"{what}, chunk {i} ({ch.label()})")
        for i, (d, ch) in enumerate(zip(data, plan))
    ]
    sums = [checksum(d, i) for i, d in enumerate(data)]
    for p in posted:
        p.wait()
    t2 = time.perf_counter()
    channel.send(peer, KIND_TRAILER, trailer_bytes(sums), f"{what} (trailer)")
    t3 = time.perf_counter()
    ack = channel.recv_json(peer, f"ack of {what}")
    t4 = time.perf_counter()
    facts.seconds = {"header": t1 - t0, "send": t2 - t1, "trailer": t3 - t2, "ack": t4 - t3, "total": t4 - t0}
    if not ack.get("ok"):
        raise refusal(ack, f"{what}: rank {peer} refused it")
    return facts


def _sender_chunks(cache: PagedKVCache, seq_id: Hashable, plan: list[Chunk]) -> list[torch.Tensor]:
    """Each chunk's rows ``[rows, D]``: a view of the pool where they are consecutive, else a copy."""
    flat = {layer: cache.flat_rows(seq_id, layer) for layer in {ch.layer for ch in plan}}  # [rows] per layer
    starts = _run_starts(flat)
    out = []
    for ch in plan:
        pool = head_rows((cache.keys, cache.values)[ch.part][ch.layer])[ch.head]  # [pool rows, D], contiguous
        first = _chunk_start(ch, flat, starts)
        rows = (
            pool[first : first + ch.stop - ch.start]
            if first is not None
            else pool.index_select(0, flat[ch.layer][ch.start : ch.stop])
        )
        out.append(rows.cpu())  # a view of a CPU pool where the rows are one run
    return out


def _run_starts(rows: dict[int, torch.Tensor]) -> dict[int, int]:
    """The first pool row of each layer whose rows ``[k]`` are one ascending run (an unfragmented
    pool): every chunk of such a layer is a slice of the pool, found once per layer, not per chunk."""
    return {layer: int(r[0]) for layer, r in rows.items() if _consecutive(r)}


def _chunk_start(ch: Chunk, rows: dict[int, torch.Tensor], starts: dict[int, int]) -> int | None:
    """The first pool row of chunk ``ch`` where its rows (of ``rows[ch.layer]``) are one run, else None."""
    if ch.layer in starts:
        return starts[ch.layer] + ch.start
    flat = rows[ch.layer][ch.start : ch.stop]
    return int(flat[0]) if _consecutive(flat) else None


def _consecutive(flat: torch.Tensor) -> bool:
    """Whether the rows ``flat [k]`` are one ascending run (then the chunk is a view of the pool)."""
    return int(flat[-1]) - int(flat[0]) == flat.numel() - 1 and bool((flat[1:] - flat[:-1] == 1).all())


# ---------------------------------------------------------------------- receiving


@dataclass
class ReceiveFacts:
    seq_id: Hashable
    tokens: int
    conversion: str | None
    in_place_chunks: int  # chunks received straight into the pool (the rest through a staging copy)
    chunks: int
    seconds: dict[str, float] = field(default_factory=dict)  # header, receive (incl. checks), commit

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self), seq_id=str(self.seq_id))


def receive_sequence(
    channel: Channel,
    peer: int,
    cache: PagedKVCache,
    *,
    convert: str = "never",
    policy: ImportPolicy | None = None,
    seq_id: Hashable | None = None,
    accept: Callable[[StreamHeader], None] | None = None,
    after_header: Callable[[StreamHeader], None] | None = None,
    in_flight_bytes: int = DEFAULT_IN_FLIGHT_BYTES,
    limits: ModelLimits | None = None,
) -> ReceiveFacts:
    """Receive one streamed sequence from ``peer`` into ``cache`` as ``seq_id`` (default: the sender's).

    ``in_flight_bytes``: how many bytes of chunks may be posted and not yet checked (at least one
    chunk). ``limits``: the receiving model's positions and vocabulary, checked on the header's
    tokens and positions before anything is reserved. ``accept(header)`` may refuse it by raising a RopeKVError
    (e.g. tokens other than planned);
    ``after_header`` is a test hook. All or nothing: on any refusal the sender is told, the reserved
    blocks are released and the error is raised; the cache is as before."""
    if not is_int(in_flight_bytes) or in_flight_bytes < 1:
        raise UsageError(f"receive_sequence: in_flight_bytes must be a positive integer, got {in_flight_bytes!r}")
    policy = policy or ImportPolicy()
    t0 = time.perf_counter()
    what = f"stream from rank {peer}"
    blob = channel.recv(peer, KIND_STREAM, MAX_JSON_BYTES + 16 * MAX_TOKENS + 8 + _DIGEST, f"{what} (header)")
    res: Reservation | None = None
    try:
        header = StreamHeader.from_bytes(blob)
        conversion = plan_import(cache.contract, header.contract, convert)
        if limits is not None:
            limits.check(header.tokens, header.positions, "stream header:")
        if accept is not None:
            accept(header)
        res = cache.reserve(header.seq_id if seq_id is None else seq_id, header.num_tokens)
    except RopeKVError as exc:
        channel.send_json(peer, refusal_message(exc), f"{what}: refusal of the header")
        raise
    channel.send_json(peer, {"step": "go"}, f"{what}: go")
    if after_header is not None:
        after_header(header)
    t1 = time.perf_counter()
    try:
        facts = ReceiveFacts(res.seq_id, header.num_tokens, conversion, 0, len(header.plan()))
        failure: RopeKVError | None = _receive_chunks(channel, peer, cache, res, header, facts, in_flight_bytes, what)
        t2 = time.perf_counter()
        if failure is None:
            failure = _finish(cache, res, header, conversion, policy)
        if failure is not None:
            raise failure
    except RopeKVError as exc:
        cache.release(res)
        if not isinstance(exc, TransportError):
            channel.send_json(peer, refusal_message(exc), f"{what}: refusal")
        raise
    except BaseException:
        cache.release(res)
        raise
    channel.send_json(peer, {"step": "ack", "ok": True, "facts": facts.to_dict()}, f"{what}: ack")
    t3 = time.perf_counter()
    facts.seconds = {"header": t1 - t0, "receive": t2 - t1, "commit": t3 - t2, "total": t3 - t0}
    return facts


def _receive_chunks(
    channel: Channel,
    peer: int,
    cache: PagedKVCache,
    res: Reservation,
    header: StreamHeader,
    facts: ReceiveFacts,
    in_flight_bytes: int,
    what: str,
) -> PayloadError | None:
    """Receive every chunk, as many posted at once as ``in_flight_bytes`` allows (at least one),
    hashing each one and checking its values in order while the later ones arrive, then the trailer.
    Returns the first failure in chunk order (a chunk's checksum before its values; every chunk is
    still received, so the stream stays in step), or None.

    Why so many at once: gloo moves a message's bytes only once its receive is posted, so with a few
    posted, a receiver slowed by its checks (or a loaded machine) stalls the sender between chunks
    (docs/performance.md has the figures, loaded and quiet)."""
    c = cache.contract
    plan = header.plan()
    width = c.head_dim
    pending: deque[tuple[int, Posted, torch.Tensor, torch.Tensor | None]] = deque()
    sums: list[int] = []  # each chunk's checksum, as received
    bad_values: dict[int, PayloadError] = {}  # chunks holding NaN or infinite values

    reserved = {layer: cache.reserved_rows(res, layer) for layer in {ch.layer for ch in plan}}  # [rows] per layer
    starts = _run_starts(reserved)

    def post(i: int) -> None:
        ch = plan[i]
        pool = head_rows((cache.keys, cache.values)[ch.part][ch.layer])[ch.head]  # [pool rows, D]
        count = ch.stop - ch.start
        first = _chunk_start(ch, reserved, starts)
        if pool.device.type == "cpu" and first is not None:
            dest, scatter = pool[first : first + count], None
            facts.in_place_chunks += 1
        else:
            dest, scatter = torch.empty((count, width), dtype=pool.dtype), reserved[ch.layer][ch.start : ch.stop]
        pending.append((i, channel.post_recv(dest, peer, f"{what}, chunk {i} ({ch.label()})"), dest, scatter))

    chunk_bytes = [(ch.stop - ch.start) * width * c.torch_dtype.itemsize for ch in plan]
    posted_bytes, following = 0, 0  # bytes posted and not yet checked; the next chunk to post

    def post_more() -> None:
        nonlocal posted_bytes, following
        while following < len(plan) and (not pending or posted_bytes + chunk_bytes[following] <= in_flight_bytes):
            post(following)
            posted_bytes += chunk_bytes[following]
            following += 1

    post_more()
    while pending:
        i, posted, dest, scatter = pending.popleft()
        posted.wait()
        sums.append(checksum(dest, i))
        if not bad_values:
            found = _nonfinite(plan[i], dest, header)
            if found is not None:
                bad_values[i] = found
        if scatter is not None:  # into reserved rows: released unread on any failure
            pool = head_rows((cache.keys, cache.values)[plan[i].part][plan[i].layer])[plan[i].head]
            pool.index_copy_(0, scatter, dest.to(pool.device))
        posted_bytes -= chunk_bytes[i]
        post_more()
    expected = parse_trailer(channel.recv(peer, KIND_TRAILER, trailer_bound(len(plan)), f"{what} (trailer)"), len(plan))
    for i, (got, want) in enumerate(zip(sums, expected)):
        if got != want:
            return PayloadError(
                f"stream chunk {i} ({plan[i].label()}) checksum mismatch: bytes were changed or lost in transit"
            )
        if i in bad_values:
            return bad_values[i]
    return None


def _nonfinite(ch: Chunk, data: torch.Tensor, header: StreamHeader) -> PayloadError | None:
    """The refusal of a chunk holding NaN or infinite values, naming the first one's position; else None.

    One pass in the common case: a sum is finite only if every term is (a NaN or an infinity carries
    through any order of additions), and ``sum`` is one reduction where ``aminmax`` is two (for a
    1 MiB chunk here, 17 against 24 microseconds with 2 threads, 13 against 44 with one). A sum that
    is not finite may still be an overflow of finite values, so only then are the values looked at
    one by one. Half-precision chunks are summed in float32, so that their narrow range does not
    send every large chunk down the slow path."""
    total = data.sum(dtype=torch.float64 if data.dtype == torch.float64 else torch.float32)
    if math.isfinite(total.item()):
        return None
    if not bool(torch.isfinite(data).all()):
        row = ch.start + int(torch.nonzero(~torch.isfinite(data).all(dim=1))[0])
        position = int(header.layer_positions(ch.layer)[row])
        return PayloadError(f"stream {ch.label()}: NaN or infinite values (first at row {row}, position {position})")
    return None


def _finish(
    cache: PagedKVCache, res: Reservation, header: StreamHeader, conversion: str | None, policy: ImportPolicy
) -> RopeKVError | None:
    """Convert the received keys in place when the key form differs (once, here), apply the import
    policy, and commit. Returns the refusal instead of raising it."""
    c = cache.contract
    rope = c.rope
    if type(policy).received_rows is not ImportPolicy.received_rows:  # a fault reads the rows otherwise
        for layer in range(c.num_layers):
            flat = cache.reserved_rows(res, layer)
            for pool in (pool_rows(cache.keys[layer]), pool_rows(cache.values[layer])):
                pool.index_copy_(0, flat, policy.received_rows(header.contract, pool.index_select(0, flat)))
    touches_keys = conversion is not None or type(policy).imported_keys is not ImportPolicy.imported_keys
    for layer in range(c.num_layers if touches_keys else 0):
        pool = pool_rows(cache.keys[layer])  # [pool rows, KVH, D]
        flat = cache.reserved_rows(res, layer)
        pos = header.layer_positions(layer)
        k = pool.index_select(0, flat)  # [rows, KVH, D]
        turned = rope.rotate(k, pos) if conversion == "rotate" else rope.unrotate(k, pos) if conversion else k
        turned = policy.imported_keys(rope, turned, pos)
        if turned is not k:
            pool.index_copy_(0, flat, turned.to(pool.dtype))
    try:
        cache.commit(res, header.positions.to(cache.device))
    except RopeKVError as exc:
        return exc
    return None


# ---------------------------------------------------------------------- refusals


def refusal_message(exc: RopeKVError) -> dict[str, Any]:
    return {
        "step": "ack",
        "ok": False,
        "error_class": type(exc).__name__,
        "message": str(exc),
        "fields": list(getattr(exc, "fields", ())),
    }


def refusal(message: dict[str, Any], context: str) -> RopeKVError:
    return rebuild_error(message.get("error_class"), f"{context}: {message.get('message')}", message.get("fields"))


def rebuild_error(class_name: Any, message: str, fields: Any = ()) -> RopeKVError:
    """The typed error another rank reported (by class name), with its message and contract fields."""
    cls = _ERRORS.get(str(class_name), RopeKVError)
    if issubclass(cls, ContractMismatch):
        return cls(message, tuple(fields or ()))
    if issubclass(cls, AdapterError):  # built from its parts; the other rank sent the whole message
        error = cls.__new__(cls)
        RopeKVError.__init__(error, message)
        error.adapter = error.field = error.expected = error.got = ""
        return error
    return cls(message)


__all__ = [
    "Chunk",
    "DEFAULT_CHUNK_BYTES",
    "KIND_STREAM",
    "ReceiveFacts",
    "SendFacts",
    "StreamHeader",
    "chunk_plan",
    "checksum",
    "rebuild_error",
    "receive_sequence",
    "send_sequence",
]
