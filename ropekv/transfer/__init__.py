"""Prefill->decode handoff: the payload format, the import boundary and the torch.distributed workers.

- :func:`write_payload` / :func:`read_payload`: one sequence's KV cache as self-describing,
  checksummed safetensors bytes (:class:`Handoff`); the reader raises only ``PayloadError``.
- ``export_handoff(cache, ...)`` / ``import_handoff(cache, ...)`` (``ropekv.transfer.importer``): the
  contract check, the explicit key-form conversion, the all-or-nothing import, on a ``PagedKVCache``.
- ``send_sequence`` / ``receive_sequence`` (``ropekv.transfer.stream``): the streamed handoff between
  ranks, from the sender's pool straight into the receiver's, checksummed chunk by chunk.
- ``ropekv.transfer.workers``: prefill and decode ranks (``torchrun`` or ``ropekv handoff``), with the
  contract handshake of ``ropekv.transfer.handshake``. See docs/handoff.md.
"""

from .payload import Handoff, read_payload, write_payload

__all__ = ["Handoff", "read_payload", "write_payload"]
