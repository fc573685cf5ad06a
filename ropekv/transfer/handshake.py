"""Framed messages between ranks over torch.distributed, and the contract handshake built on them.

:class:`Channel` sends a frame as a header ``int64 [3] = [MAGIC, kind, nbytes]`` then the body as
``uint8`` chunks (point-to-point ``isend``/``irecv``). Every wait is bounded by ``timeout``: a dead peer
shows at once (connection reset), a silent one after ``timeout`` seconds; both raise
:class:`~ropekv.errors.TransportError`. The receiver checks ``nbytes`` against a bound before allocating.

Handshake (before any KV moves), between the prefill rank and each decode rank:

1. prefill -> decode ``{"step": "offer", "contract": <prefill contract JSON>}``
2. decode -> prefill ``{"step": "answer", "accepted", "conversion", "fields", "message", "contract"}``:
   the decode rank compares with :func:`~ropekv.transfer.importer.plan_import` (its own contract is
   the reader's), so the handshake and the import apply one rule.
3. prefill -> decode ``{"step": "verdict", "go", "refused_by"}``: one refusal stops every rank.

On a refusal both sides raise :class:`~ropekv.errors.ContractMismatch` naming the fields (exit 3).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ..contract import CacheContract
from ..errors import ContractMismatch, PayloadError, RopeKVError, TransportError
from .importer import plan_import

MAGIC = 0x524F50454B560001  # "ROPEKV" + frame version 1
KIND_JSON, KIND_PAYLOAD = 1, 2
MAX_JSON_BYTES = 1 << 20
HANDSHAKE = "ropekv.handshake"
HANDSHAKE_VERSION = 1


class Channel:
    """Framed, bounded, timed point-to-point messages with peers in the default process group."""

    def __init__(self, *, timeout: float, device: str | torch.device = "cpu", chunk_bytes: int = 16 << 20):
        self.timeout = timedelta(seconds=timeout)
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes

    # -------------------------------------------------------------- primitives

    def _op(self, start: Callable[[], Any], peer: int, what: str) -> None:
        """Start one isend/irecv and wait for it, at most ``timeout``; any backend error is a TransportError."""
        self._wait(self._start(start, peer, what), peer, what)

    def _start(self, start: Callable[[], Any], peer: int, what: str) -> Any:
        try:
            return start()
        except RuntimeError as exc:
            raise self._transport_error(exc, peer, what) from None

    def _wait(self, work: Any, peer: int, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:  # gloo/NCCL errors (DistBackendError is a RuntimeError)
            raise self._transport_error(exc, peer, what) from None

    def _transport_error(self, exc: RuntimeError, peer: int, what: str) -> TransportError:
        text = str(exc).strip()
        detail = text.splitlines()[0].split(". This is typically")[0] if text else type(exc).__name__
        return TransportError(
            f"{what}: rank {peer} failed or went silent: {detail[:300]} "
            f"(waits are bounded by {self.timeout.total_seconds():g} s)"
        )

    # -------------------------------------------------------------- posted tensors (the KV stream)

    def post_send(self, tensor: torch.Tensor, peer: int, what: str) -> Posted:
        """Start sending the contiguous ``tensor`` as it lies in memory (no copy on a CPU channel);
        the caller keeps it unchanged until :meth:`Posted.wait` returns."""
        import torch.distributed as dist

        buf = tensor.to(self.device)
        return Posted(self, self._start(lambda: dist.isend(buf, peer), peer, what), buf, None, peer, what)

    def post_recv(self, tensor: torch.Tensor, peer: int, what: str) -> Posted:
        """Start receiving into the contiguous CPU ``tensor`` (straight into it on a CPU channel)."""
        import torch.distributed as dist

        buf = tensor if self.device.type == "cpu" else torch.empty_like(tensor, device=self.device)
        return Posted(
            self,
            self._start(lambda: dist.irecv(buf, peer), peer, what),
            buf,
            None if buf is tensor else tensor,
            peer,
            what,
        )

    def _send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        import torch.distributed as dist

        buf = tensor.to(self.device)
        self._op(lambda: dist.isend(buf, peer), peer, what)

    def _recv_into(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        """Receive into the contiguous CPU tensor ``tensor`` (via the device for NCCL)."""
        import torch.distributed as dist

        buf = tensor if self.device.type == "cpu" else torch.empty_like(tensor, device=self.device)
        self._op(lambda: dist.irecv(buf, peer), peer, what)
        if buf is not tensor:
            tensor.copy_(buf)

    # -------------------------------------------------------------- frames

    def send(self, peer: int, kind: int, data: bytes, what: str) -> None:
        """Send one frame: header, then ``data`` in chunks of at most ``chunk_bytes``."""
        self._send(torch.tensor([MAGIC, kind, len(data)], dtype=torch.int64), peer, f"{what} (header)")
        with warnings.catch_warnings():  # a read-only view of ``data``: isend only reads it, no copy needed
            warnings.simplefilter("ignore", UserWarning)
            body = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        for start in range(0, len(data), self.chunk_bytes):
            self._send(body[start : start + self.chunk_bytes], peer, f"{what} (bytes {start}..)")

    def recv(
        self, peer: int, kind: int, max_bytes: int, what: str, after_header: Callable[[int], None] | None = None
    ) -> bytes:
        """Receive one frame of ``kind`` of at most ``max_bytes``; ``after_header(nbytes)`` is a test hook."""
        header = torch.zeros(3, dtype=torch.int64)
        self._recv_into(header, peer, f"{what} (header)")
        magic, got_kind, nbytes = (int(x) for x in header)
        if magic != MAGIC or got_kind != kind:
            raise TransportError(
                f"{what}: rank {peer} sent a frame of kind {got_kind} (magic {magic:#x}), "
                f"expected kind {kind}: the ranks run different protocols or are out of step"
            )
        if not 0 <= nbytes <= max_bytes:
            raise PayloadError(f"{what}: rank {peer} announced {nbytes} bytes, the bound is {max_bytes}")
        if after_header is not None:
            after_header(nbytes)
        body = torch.empty(nbytes, dtype=torch.uint8)
        for start in range(0, nbytes, self.chunk_bytes):
            end = min(nbytes, start + self.chunk_bytes)
            self._recv_into(body[start:end], peer, f"{what} (bytes {start}..{end} of {nbytes})")
        return body.numpy().tobytes()

    def send_json(self, peer: int, message: dict[str, Any], what: str) -> None:
        self.send(peer, KIND_JSON, json.dumps(message, sort_keys=True).encode(), what)

    def recv_json(self, peer: int, what: str) -> dict[str, Any]:
        data = self.recv(peer, KIND_JSON, MAX_JSON_BYTES, what)
        try:
            message = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise TransportError(f"{what}: rank {peer} sent a message that is not JSON: {exc}") from None
        if not isinstance(message, dict):
            raise TransportError(f"{what}: rank {peer} sent a JSON {type(message).__name__}, expected an object")
        return message


@dataclass(frozen=True, eq=False)
class Posted:
    """One started isend/irecv of a :class:`Channel`; :meth:`wait` is bounded by the channel's timeout."""

    channel: Channel
    work: Any
    buffer: torch.Tensor
    target: torch.Tensor | None  # the CPU tensor a device buffer is copied back into
    peer: int
    what: str

    def wait(self) -> None:
        self.channel._wait(self.work, self.peer, self.what)
        if self.target is not None:
            self.target.copy_(self.buffer)


# ---------------------------------------------------------------------- handshake


@dataclass(frozen=True)
class HandshakeResult:
    """One decode rank's answer to the prefill contract."""

    rank: int
    accepted: bool
    conversion: str | None  # "rotate" (raw -> rotated), "unrotate", or None
    fields: tuple[str, ...]  # fields that differ
    message: str
    decode_contract: str = ""  # the decode rank's contract JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "accepted": self.accepted,
            "conversion": self.conversion,
            "fields": list(self.fields),
            "message": self.message,
            "decode_contract_fingerprint": _fingerprint(self.decode_contract),
        }


def decide(ours: CacheContract, theirs: CacheContract, convert: str, rank: int) -> HandshakeResult:
    """The decode side's verdict on the prefill contract ``theirs`` (pure; same rule as the import)."""
    fields = tuple(d.field for d in ours.diff(theirs))
    try:
        conversion = plan_import(ours, theirs, convert)
    except ContractMismatch as exc:
        return HandshakeResult(rank, False, None, exc.fields, str(exc), ours.to_json())
    message = (
        "contracts match"
        if not fields
        else (f"key form differs ({theirs.key_form} -> {ours.key_form}); converting once at import ({conversion})")
    )
    return HandshakeResult(rank, True, conversion, fields, message, ours.to_json())


def offer(channel: Channel, contract: CacheContract, decode_ranks: list[int]) -> list[HandshakeResult]:
    """Prefill side: offer ``contract`` to every decode rank, collect answers, announce the verdict.

    Raises ContractMismatch (after every rank was told) when any decode rank refused."""
    hello = {"format": HANDSHAKE, "version": HANDSHAKE_VERSION, "step": "offer", "contract": contract.to_json()}
    for r in decode_ranks:
        channel.send_json(r, hello, f"handshake offer to rank {r}")
    answers = []
    for r in decode_ranks:
        a = _expect(channel.recv_json(r, f"handshake answer from rank {r}"), "answer", r)
        try:
            answers.append(
                HandshakeResult(
                    r, bool(a["accepted"]), a["conversion"], tuple(a["fields"]), str(a["message"]), str(a["contract"])
                )
            )
        except (KeyError, TypeError) as exc:
            raise TransportError(f"handshake: rank {r} sent a malformed answer (missing {exc})") from None
    refused = [a for a in answers if not a.accepted]
    for r in decode_ranks:
        verdict = {
            "step": "verdict",
            "go": not refused,
            "refused_by": [a.rank for a in refused],
            "fields": sorted({f for a in refused for f in a.fields}),
        }
        channel.send_json(r, verdict, f"handshake verdict to rank {r}")
    if refused:
        first = refused[0]
        raise ContractMismatch(
            f"handshake: decode rank {first.rank} refused the prefill contract: {first.message}", fields=first.fields
        )
    return answers


def answer(
    channel: Channel, contract: CacheContract, convert: str, rank: int, src: int = 0
) -> tuple[HandshakeResult, CacheContract]:
    """Decode side: judge the prefill rank's contract against ours, say so, and wait for the verdict.

    Returns our answer and the prefill contract; raises ContractMismatch when the handshake refused."""
    hello = _expect(channel.recv_json(src, "handshake offer"), "offer", src)
    if hello.get("format") != HANDSHAKE or hello.get("version") != HANDSHAKE_VERSION:
        raise TransportError(
            f"handshake: rank {src} speaks {hello.get('format')!r} version {hello.get('version')!r}, "
            f"expected {HANDSHAKE!r} version {HANDSHAKE_VERSION}"
        )
    theirs: CacheContract | None = None
    try:
        theirs = CacheContract.from_json(str(hello.get("contract")))
        result = decide(contract, theirs, convert, rank)
    except RopeKVError as exc:  # an unreadable contract is refused like a mismatching one
        result = HandshakeResult(
            rank, False, None, getattr(exc, "fields", ()), f"unreadable prefill contract: {exc}", contract.to_json()
        )
    channel.send_json(
        src,
        {
            "step": "answer",
            "accepted": result.accepted,
            "conversion": result.conversion,
            "fields": list(result.fields),
            "message": result.message,
            "contract": contract.to_json(),
        },
        "handshake answer",
    )
    verdict = _expect(channel.recv_json(src, "handshake verdict"), "verdict", src)
    if not result.accepted:
        raise ContractMismatch(
            f"handshake: this decode rank ({rank}) refused the prefill contract: {result.message}", fields=result.fields
        )
    if not verdict.get("go"):
        raise ContractMismatch(
            f"handshake: decode rank(s) {verdict.get('refused_by')} refused the prefill contract",
            fields=tuple(verdict.get("fields") or ()),
        )
    assert theirs is not None  # an unreadable contract was refused above
    return result, theirs


def _expect(message: dict[str, Any], step: str, peer: int) -> dict[str, Any]:
    if message.get("step") != step:
        raise TransportError(f"handshake: rank {peer} sent step {message.get('step')!r}, expected {step!r}")
    return message


def _fingerprint(contract_json: str) -> str | None:
    try:
        return CacheContract.from_json(contract_json).fingerprint() if contract_json else None
    except RopeKVError:
        return None
