"""Transfer hooks for the handoff tests: a stream damaged on the wire, a decode rank killed mid-transfer.

Handed to :func:`ropekv.handoff.workers.launch` (``hooks=``); the shipped command lines take none.
Each is pickled into the rank processes, so it is a module-level class with plain fields.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from ropekv.handoff.workers import TransferHooks, Wire


def _flip_one_bit(index: int, chunk: torch.Tensor) -> torch.Tensor:
    """Chunk 0 as a damaged copy (one bit of its middle byte flipped): what a bad link would deliver."""
    if index != 0:
        return chunk
    damaged = chunk.clone()
    damaged.view(torch.uint8).view(-1)[damaged.numel() * damaged.element_size() // 2] ^= 0x10
    return damaged


class CorruptInFlight(TransferHooks):
    """The first attempt of sequence ``index``'s stream has one bit flipped in flight."""

    def __init__(self, index: int):
        self.index = index

    def wire(self, index: int, attempt: int) -> Wire | None:
        return _flip_one_bit if index == self.index and attempt == 1 else None


class KillDecodeMidTransfer(TransferHooks):
    """The decode rank receiving sequence ``index`` dies (SIGKILL) with the header read and the chunks
    on the wire."""

    def __init__(self, index: int):
        self.index = index

    def header_received(self, index: int) -> None:
        if index == self.index:
            os.kill(os.getpid(), signal.SIGKILL)


class HangWithProgressBar(TransferHooks):
    """The decode rank receiving sequence ``index`` opens a progress bar (as the parity harness does),
    writes ``marker`` and then hangs: a rank a Ctrl-C finds in the middle of its work."""

    def __init__(self, index: int, marker: str):
        self.index, self.marker = index, marker

    def header_received(self, index: int) -> None:
        if index != self.index:
            return
        from tqdm import tqdm

        bar = tqdm(total=1, disable=True)  # tqdm's lock: a named semaphore unless the rank replaced it
        with open(self.marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)
        bar.close()
