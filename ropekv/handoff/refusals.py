"""The refusals a contract-carrying vLLM connector wrote, read back as one :class:`ContractMismatch`.

ropekv's ``ContractConnector`` (``ropekv.adapters.vllm.connector``), on the consumer, compares the
contract stored beside an entry with its own before it injects anything; on each refusal it appends
one JSON line ``{"request_id", "key", "fields": [...], "message", "policy", "run"}`` to
``<store>/ropekv-refusals.jsonl``. ``run`` is the id the driver handed this run's connector
(``kv_connector_extra_config["ropekv_run"]``); the store, and its log, outlive a run, so the driver
reads only its own run's lines and turns them into exit 3 naming the fields.

The log is read as any file a user can hand over (:mod:`ropekv.files`): a regular file only (a FIFO is
refused, never waited on), of bounded size, each line bounded in length (a line of arrays nested
100,000 deep is no record, and is refused before the JSON parser recurses into it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ContractMismatch, TransportError
from ..files import open_regular, read_exactly

REFUSALS_FILE = "ropekv-refusals.jsonl"
MAX_REFUSALS_BYTES = 16 * 2**20  # a refusal line is well under 4 KiB; more than this is not a refusal log
MAX_LINE_BYTES = 64 * 2**10  # a refusal's message names every differing field: a few KiB at most
RUN_FIELD = "run"  # the record's field holding the run id


@dataclass(frozen=True)
class Refusal:
    request_id: str
    key: str
    fields: tuple[str, ...]
    message: str
    policy: str
    run: str | None  # the run that wrote it (None: a connector that was given no run id)


def read_refusals(store: Path, run: str | None) -> list[Refusal]:
    """The refusals run ``run`` wrote in ``store``'s refusal file (none if there is no file); with
    ``run`` None, every refusal. A file that is not a regular file, or a line that is not a refusal
    record, is a broken transfer log: TransportError naming it (and the line)."""
    path = Path(store) / REFUSALS_FILE
    if not path.exists() and not path.is_symlink():
        return []
    f, size = open_regular(path, "vLLM refusal log", TransportError)
    with f:
        if size > MAX_REFUSALS_BYTES:
            raise TransportError(f"{path}: over {MAX_REFUSALS_BYTES} bytes: not a refusal log")
        data = bytearray(size)
        read_exactly(f, memoryview(data), str(path), TransportError)
    out = []
    for n, line in enumerate(bytes(data).split(b"\n"), 1):
        if not line.strip():
            continue
        record = _record(line, f"{path}:{n}")
        if run is None or record.run == run:
            out.append(record)
    return out


def _record(line: bytes, where: str) -> Refusal:
    if len(line) > MAX_LINE_BYTES:
        raise TransportError(f"{where}: a line of {len(line)} bytes, over {MAX_LINE_BYTES}: not a refusal record")
    try:
        d = json.loads(line.decode("utf-8"))
        if not isinstance(d, dict):
            raise TypeError(f"a JSON {type(d).__name__}, not an object")
        fields = d["fields"]
        if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
            raise TypeError("fields must be a list of strings")
        run = d.get(RUN_FIELD)
        if run is not None and not isinstance(run, str):
            raise TypeError("run must be a string")
        return Refusal(str(d["request_id"]), str(d["key"]), tuple(fields), str(d["message"]), str(d["policy"]), run)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise TransportError(f"{where}: not a refusal record ({type(exc).__name__}: {str(exc)[:200]})") from None


def refusal_error(refusals: list[Refusal]) -> ContractMismatch | None:
    """One ContractMismatch for ``refusals`` (None if there are none): every field named, in order of
    first appearance, and the first refusal's message."""
    if not refusals:
        return None
    fields = tuple(dict.fromkeys(f for r in refusals for f in r.fields))
    more = f" (and {len(refusals) - 1} more refusal(s))" if len(refusals) > 1 else ""
    first = refusals[0]
    return ContractMismatch(
        f"the consumer's connector refused the stored KV of request {first.request_id} "
        f"(policy {first.policy}): {first.message}{more}",
        fields=fields,
    )
