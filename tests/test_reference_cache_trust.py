"""What the reference cache believes: a stored entry is checked against the float64 reference on every
read (layer 0 of each row recomputed, every value finite, its figures bounded), so rows planted in the
folder, or written by a process whose reference was changed, are recomputed instead of judging an
engine; a process that loaded adapter code writes no entry unless told to trust it."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ropekv import check, user_code
from ropekv.bugs.registry import FAULTS
from ropekv.cli.custom_engine import CustomEngine
from ropekv.models import load_checkpoint
from ropekv.models.config import Checkpoint
from ropekv.parity import reference_cache as rc
from ropekv.parity.cases import Case
from ropekv.rope import RopeSpec

# Positions up to 241: bfloat16 angles there are off by up to p w 2^-9 rad (ropekv.bugs.low_precision_angles).
CASES = [Case(length=240, block_size=16, decode_steps=2)]
RECOMPUTED = "recomputed (corrupt entry)"


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> Checkpoint:
    return load_checkpoint(tiny_llama_dir)


def _bf16_angles(self, positions, seq_len=None):
    """RoPE angles computed in bfloat16: what an adapter patching ropekv's RoPE would make it compute."""
    inv = self.inv_freq(seq_len).to(torch.bfloat16)
    return (positions.to(torch.bfloat16)[:, None] * inv[None, :]).to(torch.float64)


def _sources(report) -> list[str | None]:
    return [r.reference_source for r in report.cases]


def test_rows_of_a_patched_reference_cannot_pass_the_fault_they_match(llama, tmp_path, monkeypatch, capsys):
    refs = tmp_path / "refs"
    fault = FAULTS["low-precision-angles"]
    assert not check(fault.adapter(llama), cases=CASES).passed  # what a clean reference says
    with monkeypatch.context() as m:
        m.setattr(RopeSpec, "angles", _bf16_angles)
        planted = check(llama, cases=CASES, reference_cache=refs)
    assert _sources(planted) == ["computed"] and list(refs.glob("*.safetensors"))
    capsys.readouterr()
    report = check(fault.adapter(llama), cases=CASES, reference_cache=refs)
    assert _sources(report) == [RECOMPUTED]
    assert not report.passed, report.table()
    assert any("layer 0's attention logits differ" in n for n in report.cases[0].notes), report.cases[0].notes
    assert "reference cache entry of case" in capsys.readouterr().err


def _rewrite(path: Path, change) -> None:
    """Rewrite an entry's tensors and metadata with ``change(tensors, meta)``, its checksum recomputed:
    what anyone who can write the folder can do."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    tensors = load_file(path)
    change(tensors, meta)
    meta["checksum"] = rc._checksum(tensors)
    save_file(tensors, path, metadata=meta)


def _scaled(tensors, meta):
    for name, t in tensors.items():
        if t.is_floating_point():
            tensors[name] = t * 1.5


def _other_model(tensors, meta):
    g = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.startswith("hidden."):
            tensors[name] = torch.randn(t.shape, generator=g, dtype=t.dtype)


def _infinite_logits(tensors, meta):
    tensors["logits"] = tensors["logits"].clone()
    tensors["logits"][0, 3] = float("inf")


def _infinite_attention(tensors, meta):
    a = tensors["attn.0.1"].clone()
    a[0, 0] = float("inf")
    tensors["attn.0.1"] = a


def _huge_seconds(tensors, meta):
    meta["seconds"] = "1e300"


@pytest.mark.parametrize(
    "forge,why",
    [
        (_scaled, "layer 0's input differs"),
        (_other_model, "layer 0's input differs"),
        (_infinite_logits, "logits holds NaN or infinity"),
        (_infinite_attention, "attn.0.1 holds NaN or infinity"),
        (_huge_seconds, "seconds are not a duration"),
    ],
)
def test_a_forged_entry_is_recomputed_and_the_engine_judged_as_without_it(llama, tmp_path, forge, why):
    refs = tmp_path / "refs"
    clean = check(llama, cases=CASES, reference_cache=refs)
    (entry,) = refs.glob("*.safetensors")
    _rewrite(entry, forge)
    report = check(llama, cases=CASES, reference_cache=refs)
    assert _sources(report) == [RECOMPUTED]
    assert any(why in n for n in report.cases[0].notes), report.cases[0].notes
    assert report.passed and report.reference_cache["seconds_saved"] == 0.0
    assert [r.passed for r in report.cases] == [r.passed for r in clean.cases]


def test_entries_are_readable_by_other_users(llama, tmp_path):
    refs = tmp_path / "refs"
    check(llama, cases=CASES[:1], reference_cache=refs)
    (entry,) = refs.glob("*.safetensors")
    assert entry.stat().st_mode & 0o777 == 0o644


def test_an_entry_this_user_cannot_read_is_recomputed(llama, tmp_path, monkeypatch):
    refs = tmp_path / "refs"
    check(llama, cases=CASES, reference_cache=refs)
    (entry,) = refs.glob("*.safetensors")
    real_open = os.open

    def denied(path, *args, **kwargs):
        if Path(path) == entry:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    report = check(llama, cases=CASES, reference_cache=refs)
    assert _sources(report) == [RECOMPUTED] and report.passed
    assert any("Permission denied" in n for n in report.cases[0].notes), report.cases[0].notes


def test_a_process_that_loaded_adapter_code_writes_no_entry_unless_trusted(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(user_code, "_loaded", [])
    engine = tmp_path / "my_engine.py"
    engine.write_text("class Engine:\n    pass\n")
    CustomEngine.parse(f"{engine}:Engine")._import()  # what --engine my_engine.py:Engine runs first
    assert user_code.loaded() == f"{engine}:Engine"
    refs = tmp_path / "refs"
    report = check(llama, cases=CASES, reference_cache=refs)
    assert _sources(report) == ["computed"] and report.passed
    assert not refs.exists() or not list(refs.glob("*.safetensors")), "nothing is stored"
    assert any("loaded adapter code" in n and "--reference-cache-trust-engine" in n for n in report.cases[0].notes)
    trusted = check(llama, cases=CASES, reference_cache=rc.ReferenceStore(refs, trust_engine=True))
    assert _sources(trusted) == ["computed"] and len(list(refs.glob("*.safetensors"))) == 1


def test_ropekv_own_adapter_modules_are_not_user_code(monkeypatch):
    monkeypatch.setattr(user_code, "_loaded", [])
    CustomEngine.parse("ropekv.adapters.native:NativeAdapter")._import()
    assert user_code.loaded() is None
