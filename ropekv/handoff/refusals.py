"""The refusals a contract-carrying vLLM connector wrote, read back as one :class:`ContractMismatch`.

ropekv's ``ContractConnector`` (``ropekv.adapters.vllm.connector``), on the consumer, compares the
contract stored beside an entry with its own before it injects anything; on each refusal it appends
one JSON line ``{"request_id", "key", "fields": [...], "message", "policy"}`` to
``<store>/ropekv-refusals.jsonl``. The driver turns those lines into exit 3 naming the fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ContractMismatch, TransportError

REFUSALS_FILE = "ropekv-refusals.jsonl"
MAX_REFUSALS_BYTES = 16 * 2**20  # a refusal line is well under 4 KiB; more than this is not a refusal log


@dataclass(frozen=True)
class Refusal:
    request_id: str
    key: str
    fields: tuple[str, ...]
    message: str
    policy: str


def read_refusals(store: Path) -> list[Refusal]:
    """Every refusal in ``store``'s refusal file (none if there is no file). A line that is not a
    refusal record is a broken transfer log: TransportError naming the line."""
    path = Path(store) / REFUSALS_FILE
    if not path.exists():
        return []
    try:
        if path.stat().st_size > MAX_REFUSALS_BYTES:
            raise TransportError(f"{path}: over {MAX_REFUSALS_BYTES} bytes: not a refusal log")
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TransportError(f"{path}: unreadable: {exc}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            fields = d["fields"]
            if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
                raise TypeError("fields must be a list of strings")
            out.append(Refusal(str(d["request_id"]), str(d["key"]), tuple(fields), str(d["message"]), str(d["policy"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(f"{path}:{n}: not a refusal record ({type(exc).__name__}: {exc})") from None
    return out


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
