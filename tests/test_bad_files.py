"""Files a user's folder can hold instead of what ropekv expects: a FIFO, a link to /dev/zero, JSON
nested 100,000 deep, another user's mode-0600 file, a GGUF array of millions of empty strings. Each is
one typed error (or, for a record ropekv only caches, "not verified"), never a hang, a MemoryError or a
traceback (ropekv/files.py's read_json / open_regular, used at every such read)."""

from __future__ import annotations

import builtins
import io
import os
import signal
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_default_model import _tiny_convert
from tokenizers import Tokenizer as Backend
from tokenizers import models

from ropekv.errors import CheckpointError, ConfigError
from ropekv.files import json_depth, read_json
from ropekv.models import default, load_checkpoint
from ropekv.models.default import default_checkpoint
from ropekv.models.gguf_file import MAX_ARRAY_ELEMENTS, open_gguf
from ropekv.models.tokenizer import Tokenizer


class Hung(BaseException):
    """Raised by :func:`within`; not an OSError (TimeoutError is one), so no ``except OSError`` hides it."""


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging the suite) if the block runs longer than ``seconds``."""

    def alarm(signum, frame):
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def unreadable(monkeypatch: pytest.MonkeyPatch):
    """Make chosen paths fail to open with EACCES, as another user's mode-0600 file does (the tests may
    run as root, who reads every file)."""
    denied: set[str] = set()
    real_os_open, real_open = os.open, io.open

    def deny(path: object) -> None:
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)) in denied:
            raise PermissionError(13, "Permission denied", os.fspath(path))

    def os_open(path, *args, **kwargs):
        deny(path)
        return real_os_open(path, *args, **kwargs)

    def io_open(path, *args, **kwargs):
        deny(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(io, "open", io_open)
    monkeypatch.setattr(builtins, "open", io_open)
    return lambda path: denied.add(os.path.abspath(path))


def _tokenizer_folder(tmp_path: Path) -> Path:
    Backend(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_json_depth_ignores_brackets_inside_strings():
    assert json_depth(b'{"a": [1, [2]], "b": "[[[[{{"}') == 3
    assert json_depth(b"[" * 5000 + b"]" * 5000) == 5000
    assert json_depth(b'"\\"[["') == 0 and json_depth(b"7") == 0


def test_a_verification_record_that_is_a_fifo_is_not_waited_on(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default, "_convert", _tiny_convert(tiny_llama_dir))
    first = default_checkpoint()
    record = default.cache_dir() / default.VERIFIED_FILE
    record.unlink()
    os.mkfifo(record)
    with within(20):
        again = default_checkpoint()  # the record cannot be read: the weights are hashed instead
    assert again.fingerprint == first.fingerprint


def test_a_tokenizer_config_nested_100000_deep_is_one_error(tmp_path):
    tokenizer_json = _tokenizer_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not valid JSON: nested 100000 deep"):
        Tokenizer.from_file(tokenizer_json)


def test_a_tokenizer_config_linked_to_dev_zero_is_not_read(tmp_path):
    tokenizer_json = _tokenizer_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").symlink_to("/dev/zero")
    with within(10), pytest.raises(CheckpointError, match="not a regular file \\(a character device\\)"):
        Tokenizer.from_file(tokenizer_json)


def test_a_tokenizer_file_that_is_a_fifo_is_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "tokenizer.json")
    with within(10), pytest.raises(CheckpointError, match="not a regular file \\(a FIFO\\)"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("name,error", [("config.json", ConfigError), ("model.safetensors", CheckpointError)])
def test_another_users_model_file_is_one_error(name, error, tmp_path, tiny_llama_dir, unreadable):
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in tiny_llama_dir.iterdir():
        (ck / f.name).write_bytes(f.read_bytes())
    unreadable(ck / name)
    with pytest.raises(error, match=f"{name}: Permission denied"):
        load_checkpoint(ck)


def test_read_json_refuses_what_is_too_large_or_unreadable(tmp_path, unreadable):
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 100 + "0]")
    with pytest.raises(ConfigError, match="implausibly large for a record \\(203 bytes; at most 100\\)"):
        read_json(big, "record", ConfigError, max_bytes=100)
    unreadable(big)
    with pytest.raises(ConfigError, match="cannot read the record .*big.json: Permission denied"):
        read_json(big, "record", ConfigError)


def _str(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def test_a_gguf_array_of_millions_of_empty_strings_is_refused_before_reading(tmp_path):
    count = MAX_ARRAY_ELEMENTS + 1  # each an 8-byte length of 0: a file the count fits
    kv = _str("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, count) + b"\0" * (8 * count)
    path = tmp_path / "strings.gguf"
    path.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + kv + b"\0" * 64)
    with within(10), pytest.raises(CheckpointError, match=f"declares {count} array elements; ropekv reads at most"):
        open_gguf(path)


def test_a_gguf_that_is_a_fifo_is_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "m.gguf")
    with within(10), pytest.raises(CheckpointError, match="not a regular file \\(a FIFO\\)"):
        open_gguf(tmp_path / "m.gguf")
