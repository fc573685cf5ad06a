"""Moving one sequence's KV cache: the payload format, saved files, the import boundary, the stream.

- :func:`write_payload` / :func:`read_payload`: one sequence's KV cache as self-describing,
  checksummed safetensors bytes (:class:`Handoff`); the reader raises only ``PayloadError``.
- ``export_handoff(cache, ...)`` / ``import_handoff(cache, ...)`` (``ropekv.transfer.importer``): the
  contract check, the explicit key-form conversion, the all-or-nothing import, on a ``PagedKVCache``.
- ``send_sequence`` / ``receive_sequence`` (``ropekv.transfer.stream``): the streamed handoff between
  ranks, from the sender's pool straight into the receiver's, checksummed chunk by chunk.
- ``save_sequence`` / ``load_sequence`` (``ropekv.transfer.saved``): a sequence to a file and back.
- the contract handshake (``ropekv.transfer.handshake``); the prefill and decode ranks that use all of
  this live above the adapters, in ``ropekv.handoff``. See docs/handoff.md.
"""

from .payload import Handoff, read_payload, write_payload

__all__ = ["Handoff", "read_payload", "write_payload"]
