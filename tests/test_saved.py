"""Saved caches as a user hands them over: ``load_sequence`` on files of every kind and on files whose
checksum is valid but whose content no model could have written.

- The file is checked before it is read: a directory, a FIFO, a character device (``/dev/zero``) or a
  12 GiB sparse file is refused at once, in a bounded time and with a small peak of traced memory.
- Content, not only integrity: positions beyond the model's limit (+1e6, +2**62), a token id past the
  vocabulary, another contract, all refused with every forged file carrying a valid checksum.
- A refused load leaves the engine's cache exactly as it was (``state_digest``, sequence ids).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from bounded import bounded
from safetensors.torch import load, save

from ropekv.adapters.native import NativeAdapter
from ropekv.errors import ContractMismatch, PayloadError, UsageError
from ropekv.models import load_checkpoint
from ropekv.parity.cases import Case
from ropekv.transfer.payload import _checksum
from ropekv.transfer.saved import load_sequence, save_sequence

TOKENS = torch.arange(16, 36)  # 20 tokens of a 96-token vocabulary
CASE = Case(length=20, block_size=7)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory) -> Path:
    engine = NativeAdapter(llama).make_engine(CASE)
    engine.prefill("s", TOKENS)
    path = tmp_path_factory.mktemp("saved") / "s.safetensors"
    save_sequence(engine, "s", path, TOKENS)
    return path


def engine_with_a_sequence(llama):
    """An engine that already holds a sequence, so that 'unchanged' is a real claim."""
    engine = NativeAdapter(llama).make_engine(CASE)
    engine.prefill("other", torch.arange(5, 12))
    return engine


def refused(engine, path, error, match):
    digest, ids = engine.cache.state_digest(), engine.cache.seq_ids()
    with pytest.raises(error, match=match):
        load_sequence(engine, path)
    assert engine.cache.state_digest() == digest and engine.cache.seq_ids() == ids


# ---------------------------------------------------------------------- what kind of file


def test_a_round_trip_still_restores_tokens_and_positions(llama, saved):
    engine = engine_with_a_sequence(llama)
    sid, tokens = load_sequence(engine, saved)
    assert torch.equal(tokens, TOKENS) and engine.cache.positions(sid).tolist() == list(range(20))
    assert sorted(map(str, engine.cache.seq_ids())) == ["other", "s"]


def test_a_fifo_is_refused_without_blocking(llama, tmp_path):
    fifo = tmp_path / "cache.fifo"
    os.mkfifo(fifo)
    with bounded(seconds=3.0, peak_bytes=16 << 20):
        refused(engine_with_a_sequence(llama), fifo, UsageError, r"cache\.fifo.*not a regular file \(a FIFO\)")


def test_a_character_device_is_refused_without_reading(llama):
    with bounded(seconds=3.0, peak_bytes=16 << 20):
        refused(engine_with_a_sequence(llama), Path("/dev/zero"), UsageError, "not a regular file .a character device")


def test_a_directory_and_a_missing_file_are_refused(llama, tmp_path):
    engine = engine_with_a_sequence(llama)
    refused(engine, tmp_path, UsageError, "not a regular file .a directory")
    refused(engine, tmp_path / "missing.safetensors", UsageError, "No such file")


def test_a_12_gib_sparse_file_is_refused_from_its_header(llama, tmp_path):
    sparse = tmp_path / "sparse.safetensors"
    with open(sparse, "wb") as f:
        f.truncate(12 << 30)  # declared size only: all zeros, a header length of 0
    with bounded(peak_bytes=16 << 20):
        refused(engine_with_a_sequence(llama), sparse, PayloadError, "header length 0")


def test_a_huge_file_behind_a_valid_header_is_refused_before_its_tensors_are_read(llama, saved, tmp_path):
    """A real header followed by 12 GiB: the header's tensors must tile the data section exactly."""
    big = tmp_path / "big.safetensors"
    big.write_bytes(saved.read_bytes())
    with open(big, "r+b") as f:
        f.truncate(12 << 30)
    with bounded(peak_bytes=16 << 20):
        refused(engine_with_a_sequence(llama), big, PayloadError, "unaccounted for")


def test_a_file_written_under_another_contract_is_refused_before_its_tensors_are_read(llama, saved, monkeypatch):
    import ropekv.transfer.saved as saved_module

    def no_tensors(*args, **kwargs):
        raise AssertionError("tensors were read for a file the engine cannot import")

    monkeypatch.setattr(saved_module, "read_tensors", no_tensors)
    other = NativeAdapter(llama, key_form="raw").make_engine(CASE)
    refused(other, saved, ContractMismatch, "key_form")


# ---------------------------------------------------------------------- content, with a valid checksum


def forged(saved: Path, tmp_path: Path, edit) -> Path:
    """``saved`` with its tensors changed by ``edit`` and its checksum recomputed: only the content lies."""
    data = saved.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    tensors = load(data)
    edit(tensors)
    entries = [
        (k, "I64" if t.dtype == torch.int64 else "F32", list(t.shape), t.contiguous().view(torch.uint8).numpy().data)
        for k, t in sorted(tensors.items())
    ]
    meta["checksum"] = _checksum(meta, entries)
    path = tmp_path / "forged.safetensors"
    path.write_bytes(save(tensors, metadata=meta))
    return path


def shifted(delta):
    return lambda ts: ts.__setitem__("positions", ts["positions"] + delta)


def token(value):
    return lambda ts: ts["tokens"].__setitem__(3, value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (shifted(10**6), r"position 1000000 \(token 0\) is beyond the model's 256 positions"),
        (shifted(237), r"position 256 \(token 19\) is beyond the model's 256 positions"),
        (shifted(2**62), r"position 4611686018427387904 \(token 0\) is beyond any model's positions"),
        (token(10**9), r"token id 1000000000 \(token 3\) is beyond the vocabulary of 96"),
        (token(96), r"token id 96 \(token 3\) is beyond the vocabulary of 96"),
        (token(2**62), r"token id 4611686018427387904 \(token 3\) is beyond any vocabulary"),
    ],
    ids=["positions+1e6", "last-position-at-the-limit", "positions+2**62", "token-1e9", "token-96", "token-2**62"],
)
def test_impossible_content_with_a_valid_checksum_is_refused(llama, saved, tmp_path, edit, match):
    refused(engine_with_a_sequence(llama), forged(saved, tmp_path, edit), PayloadError, match)


def test_positions_just_inside_the_limit_are_imported(llama, saved, tmp_path):
    """The bound is the model's, not a guess: the last position 255 of a 256-position model loads."""
    engine = engine_with_a_sequence(llama)
    sid, _ = load_sequence(engine, forged(saved, tmp_path, shifted(236)))
    assert engine.cache.positions(sid).tolist() == list(range(236, 256))
