"""mlx-lm prompt caches saved and loaded: parity after a checked load, each RoPE or window mismatch
refused and named, damaged files refused, and what mlx-lm's own load_prompt_cache does (as measured).

Readers with another configuration are mlx-lm's own models built from config overrides
(``load_model(path, lazy=True, model_config=...)``): the same weights, so they are passed the writer's
fingerprint where a test is about one RoPE or window field and not about the weights' digest.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch
from conftest import RUNTIME

from ropekv.adapters.mlx.cache_contract import model_fingerprint
from ropekv.adapters.mlx.prompt_cache import load_checked, save_checked
from ropekv.errors import CacheError, ContractMismatch, PayloadError, UsageError
from ropekv.parity.compare import scaled_error

mx, cache_mod = RUNTIME.mx, RUNTIME.cache
LENGTH = 30
SLIDING = ["sliding_attention" if i % 2 else "full_attention" for i in range(30)]


@pytest.fixture(scope="module")
def fingerprint(engine):
    return model_fingerprint(engine.model)


@pytest.fixture(scope="module")
def saved(engine, tokens, fingerprint, tmp_path_factory):
    """A 30-token prompt cache of the embedded model, written by save_checked."""
    caches = cache_mod.make_prompt_cache(engine.model)
    engine.forward(tokens[:LENGTH], caches)
    path = tmp_path_factory.mktemp("mlx-prompt") / "prompt.safetensors"
    save_checked(path, caches, engine.model, metadata={"note": "kept"}, fingerprint=fingerprint)
    return path


def variant(engine, **overrides):
    model, _ = RUNTIME.utils.load_model(engine.path, lazy=True, model_config=overrides)
    return model


def decode(model, caches, tokens, start, steps):
    """Logits ``[steps, vocab]`` of one-token calls at ``start .. start + steps - 1``."""
    out = []
    for t in range(start, start + steps):
        x = mx.array(tokens[t : t + 1].numpy().astype("int32"))[None]
        y = model(x, cache=caches)[0, -1].astype(mx.float32)
        mx.eval(y)
        out.append(torch.from_numpy(np.array(y)))
    return torch.stack(out)


def full(model, tokens):
    """mlx-lm's uncached forward (a ConcatenateKVCache from empty): logits ``[T, vocab]``."""
    x = mx.array(tokens.numpy().astype("int32"))[None]
    y = model(x, cache=[cache_mod.ConcatenateKVCache() for _ in model.layers])[0].astype(mx.float32)
    mx.eval(y)
    return torch.from_numpy(np.array(y))


def test_checked_load_decodes_like_the_reference(engine, reference, tokens, tol, saved, fingerprint):
    loaded = load_checked(saved, engine.model, fingerprint=fingerprint)
    assert [type(c).__name__ for c in loaded.caches] == ["KVCache"] * 30
    assert {c.offset for c in loaded.caches} == {LENGTH}
    assert loaded.sequence.num_tokens == LENGTH and loaded.metadata == {"note": "kept"}
    assert loaded.contract.rope.theta == 100000.0 and loaded.contract.key_form == "rotated"
    got = decode(engine.model, loaded.caches, tokens, LENGTH, 3)
    ref = reference.forward(tokens[: LENGTH + 3]).logits[LENGTH:]
    own = full(engine.model, tokens[: LENGTH + 3])[LENGTH:]
    assert scaled_error(got, ref) < tol.logits and scaled_error(got, own) < tol.logits
    # the file is still mlx-lm's: its own loader reads it, ropekv's entries in the metadata
    _, meta = cache_mod.load_prompt_cache(str(saved), return_metadata=True)
    assert {"note", "ropekv_contract", "ropekv_sequence", "ropekv_checksum"} <= set(meta)


@pytest.mark.parametrize(
    "overrides, fields",
    [
        ({"rope_theta": 20000.0}, ("rope.theta",)),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ("rope.scaling.rope_type", "rope.scaling.factor")),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ("rope.scaling.rope_type", "rope.scaling.factor")),
        ({"rope_traditional": True}, ("rope.layout",)),
    ],
    ids=["theta", "linear", "dynamic", "layout"],
)
def test_another_rope_is_refused_and_named(engine, saved, fingerprint, overrides, fields):
    with pytest.raises(ContractMismatch) as exc:
        load_checked(saved, variant(engine, **overrides), fingerprint=fingerprint)
    assert exc.value.fields == fields and exc.value.exit_code == 3
    assert "reader and writer cache contracts differ" in str(exc.value)
    assert "keys and queries would turn at different frequencies" in str(exc.value) or fields == ("rope.layout",)


def test_other_weights_and_dtype_are_refused(engine, saved, fingerprint):
    other = variant(engine)
    w = other.layers[3].mlp.down_proj.weight
    other.layers[3].mlp.down_proj.weight = w * 1.001
    with pytest.raises(ContractMismatch) as exc:
        load_checked(saved, other)  # the fingerprint is computed from its weights
    assert exc.value.fields == ("weights_fingerprint",)
    half = variant(engine)
    half.set_dtype(mx.bfloat16)
    with pytest.raises(ContractMismatch) as exc:
        load_checked(saved, half, fingerprint=fingerprint)
    assert exc.value.fields == ("dtype",)


def test_raw_mlx_lm_loads_another_theta_and_decodes_wrong(engine, tokens, saved):
    """Measured: mlx-lm loads the file into a reader with rope_theta 20000 without a word; the decode
    is 8.4 max|dlogit| from that reader's own uncached forward (docs/engines/mlx.md)."""
    reader = variant(engine, rope_theta=20000.0)
    caches = cache_mod.load_prompt_cache(str(saved))
    got = decode(reader, caches, tokens, LENGTH, 1)[0]
    own = full(reader, tokens[: LENGTH + 1])[LENGTH]
    assert float((got - own).abs().max()) > 1.0


def test_sliding_window_round_trip_and_another_window(engine, tokens, tol, tmp_path, fingerprint):
    """Writer: odd layers sliding with window 24 (RotatingKVCache(24), wrapped by the 40-token prompt).
    A reader with the same window decodes like mlx-lm's uncached forward (the float64 check of
    RotatingKVCache is test_parity's); one with window 32 is refused naming the window, while mlx-lm
    itself hands it RotatingKVCache(24) from the file in place of the 32 its model makes."""
    writer = variant(engine, layer_types=SLIDING, sliding_window=24)
    caches = cache_mod.make_prompt_cache(writer)
    full_logits = full(writer, tokens[:42])
    x = mx.array(tokens[:40].numpy().astype("int32"))[None]
    mx.eval(writer(x, cache=caches))
    path = tmp_path / "sliding.safetensors"
    save_checked(path, caches, writer, fingerprint=fingerprint)
    loaded = load_checked(path, writer, fingerprint=fingerprint)
    assert loaded.contract.window == 24 and loaded.contract.window_layers == tuple(range(1, 30, 2))
    got = decode(writer, loaded.caches, tokens, 40, 2)
    assert scaled_error(got, full_logits[40:]) < tol.logits
    wide = variant(engine, layer_types=SLIDING, sliding_window=32)
    with pytest.raises(ContractMismatch) as exc:
        load_checked(path, wide, fingerprint=fingerprint)
    assert exc.value.fields[:2] == ("window", "layers.1.attention") and "reader=32, writer=24" in str(exc.value)
    raw = cache_mod.load_prompt_cache(str(path))
    assert {c.max_size for c in raw if hasattr(c, "max_size")} == {24}
    assert {c.max_size for c in cache_mod.make_prompt_cache(wide) if hasattr(c, "max_size")} == {32}


def test_damaged_files_are_refused(engine, saved, fingerprint, tmp_path):
    data = saved.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])

    def refused(blob: bytes, match: str) -> None:
        p = tmp_path / "bad.safetensors"
        p.write_bytes(blob)
        with pytest.raises(PayloadError, match=match):
            load_checked(p, engine.model, fingerprint=fingerprint)

    refused(data[:-100], "truncated or padded")
    refused(data[:5], "truncated")
    refused(struct.pack("<Q", 1 << 40) + data[8:], "header claims")
    refused(data[:8] + b"{" * header_len + data[8 + header_len :], "not JSON")
    flipped = bytearray(data)
    flipped[-5] ^= 0x01  # one bit of the last layer's values
    refused(bytes(flipped), "checksum mismatch")
    refused(data.replace(b'"1.0":"KVCache"', b'"1.0":"ArraysC"'), "classes disagree")  # mlx-lm would build it
    plain = tmp_path / "plain.safetensors"
    caches = cache_mod.load_prompt_cache(str(saved))
    cache_mod.save_prompt_cache(str(plain), caches, {"note": "no contract"})
    with pytest.raises(PayloadError, match="no ropekv contract"):
        load_checked(plain, engine.model, fingerprint=fingerprint)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not a regular file"):
        load_checked(fifo, engine.model, fingerprint=fingerprint)


def test_save_refuses_bad_input_and_leaves_nothing(engine, saved, fingerprint, tmp_path):
    caches = cache_mod.load_prompt_cache(str(saved))
    with pytest.raises(UsageError, match="without '.'"):
        save_checked(tmp_path / "a.safetensors", caches, engine.model, metadata={"a.b": "x"}, fingerprint=fingerprint)
    with pytest.raises(UsageError, match="safetensors"):
        save_checked(tmp_path / "a.bin", caches, engine.model, fingerprint=fingerprint)
    with pytest.raises(CacheError, match="empty"):
        save_checked(tmp_path / "a.safetensors", cache_mod.make_prompt_cache(engine.model), engine.model)
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_another_theta_with_exit_3(capsys):
    from ropekv.cli.main import main

    code = main(["handoff", "--engine", "mlx", "--mlx-length", "20", "--mlx-reader-rope-theta", "20000"])
    captured = capsys.readouterr()
    assert code == 3
    assert "rope_theta 20000" in captured.out and "load_checked: refused (rope.theta)" in captured.out
    (line,) = captured.err.strip().splitlines()  # one line, no traceback
    assert line.startswith("ropekv: error: ") and "rope.theta: reader=20000.0, writer=100000.0" in line


def test_a_restore_with_its_offset_reset_is_refused(engine, saved, fingerprint, tmp_path):
    """The save/restore bug: keys restored but the offset back at 0 (the next token would be rotated at
    position 0). The file is re-signed as documented (sha256 over the format name, the metadata without
    the checksum, the entries and the data), so only the counters' check can catch it."""
    import hashlib
    import json

    data = bytearray(saved.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__")
    start, end = header["0.2"]["data_offsets"]  # layer 0's offset, an I32 scalar
    assert header["0.2"]["dtype"] == "I32" and struct.unpack("<i", data[8 + n + start : 8 + n + end]) == (LENGTH,)
    data[8 + n + start : 8 + n + end] = struct.pack("<i", 0)
    h = hashlib.sha256(b"ropekv.mlx_prompt_cache")
    covered = {k: v for k, v in meta.items() if k != "0.ropekv_checksum"}
    h.update(json.dumps(covered, sort_keys=True, separators=(",", ":")).encode())
    entries = {k: [e["dtype"], e["shape"], *e["data_offsets"]] for k, e in sorted(header.items())}
    h.update(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode())
    h.update(bytes(data[8 + n :]))
    meta["0.ropekv_checksum"] = "sha256:" + h.hexdigest()
    raw = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data[8 + n :]))
    with pytest.raises(PayloadError, match="layer 0: the file's counters give .*offset=0"):
        load_checked(forged, engine.model, fingerprint=fingerprint)
    assert cache_mod.load_prompt_cache(str(forged))[0].offset == 0  # mlx-lm restores it as written
