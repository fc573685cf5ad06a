"""The FlashInfer GPU check judged on CPU: the driver run through the CPU stand-in, recorded, replayed to
``ropekv.check`` against the float64 reference; the GPU script's dry run; and the recordings the H200
produced (docs/engines/flashinfer/), judged again here."""

from __future__ import annotations

import json
import lzma
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ropekv
from ropekv.adapters.flashinfer.angles import angle_errors
from ropekv.adapters.flashinfer.bundle import BundleCase, load_bundle, load_recording, save_bundle, save_recording
from ropekv.adapters.flashinfer.cpu_kernel import CpuPagedKernel
from ropekv.adapters.flashinfer.driver import SETUPS
from ropekv.adapters.flashinfer.pack import as_case, make_bundle, truncated_checkpoint
from ropekv.adapters.flashinfer.record import record
from ropekv.adapters.flashinfer.replay import EXPECTED, FlashInferReplayAdapter
from ropekv.errors import ConfigError, UsageError
from ropekv.parity.bug_class import BugClass
from ropekv.parity.cases import Case
from ropekv.testing.tiny import tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
RECORDINGS = ROOT / "docs" / "engines" / "flashinfer"
CASES = [BundleCase(length=11, block_size=4, decode_steps=2), BundleCase(length=7, block_size=3, decode_steps=2)]


@pytest.fixture(scope="module")
def tiny():
    ckpt = tiny_checkpoint("llama", num_hidden_layers=3)
    return truncated_checkpoint(ckpt, 2, "float16")


@pytest.fixture(scope="module")
def recordings(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("flashinfer")
    save_bundle(make_bundle(tiny, CASES, "float16"), folder / "bundle")
    bundle = load_bundle(folder / "bundle")
    paths = {}
    for name, setup in SETUPS.items():
        tensors, meta = record(CpuPagedKernel(), bundle, "float16", setup)
        paths[name] = folder / f"flashinfer-float16-{name}.safetensors"
        save_recording(paths[name], tensors, meta)
    xz = folder / "flashinfer-float16-rotated-before-append.safetensors.xz"
    xz.write_bytes(lzma.compress(paths["rotated-before-append"].read_bytes()))
    paths["xz"] = xz
    return paths


def _check(tiny, path):
    adapter = FlashInferReplayAdapter(tiny, path)
    return ropekv.check(adapter, cases=[as_case(c) for c in adapter.cases])


def test_truncated_checkpoint_keeps_layers_rounds_weights_and_refuses_other_blocks(tiny):
    full = tiny_checkpoint("llama", num_hidden_layers=3)
    assert tiny.config.num_layers == 2 and len(tiny.config.layer_types) == 2
    assert not any(k.startswith("model.layers.2.") for k in tiny.weights)
    w = full.weight("model.layers.1.self_attn.k_proj.weight")
    assert torch.equal(tiny.weight("model.layers.1.self_attn.k_proj.weight"), w.half().float())
    assert tiny.fingerprint != full.fingerprint
    with pytest.raises(ConfigError, match="biases"):
        truncated_checkpoint(tiny_checkpoint("qwen2"), 1, "float16")
    with pytest.raises(UsageError, match="num_layers"):
        truncated_checkpoint(full, 4, "float16")
    with pytest.raises(UsageError, match="weight dtype"):
        truncated_checkpoint(full, 1, "float32")


def test_bundle_carries_the_checks_token_stream_and_its_embedding_rows(tiny, tmp_path):
    bundle = make_bundle(tiny, CASES, "float16", seed=0)
    save_bundle(bundle, tmp_path)
    back = load_bundle(tmp_path)
    assert back.full_rows == [7, 8, 11, 12]
    assert torch.equal(back.embeddings.float(), tiny.weight("model.embed_tokens.weight")[back.tokens])
    assert back.meta["fingerprint"] == tiny.fingerprint
    with pytest.raises(UsageError, match="block_size"):
        BundleCase(length=4, block_size=0, decode_steps=1)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_each_setup_gets_the_verdict_it_must(tiny, recordings, setup):
    report = _check(tiny, recordings[setup])
    want = EXPECTED[setup]
    assert report.tier == "forensics"
    if want is None:
        assert report.passed, report.table()
        assert max(c.max_attn_error for c in report.judged) < 5e-3  # float16 keys: far inside 6e-2
    else:
        assert not report.passed and report.diagnosis is not None
        assert report.diagnosis.kind == want, report.table()
        assert all(c.first_divergence.layer == 0 and c.first_divergence.step == 0 for c in report.judged)
    notes = " ".join(n for c in report.judged for n in c.notes)
    assert "zero-query calibration" in notes


def test_double_rotation_names_each_key_at_twice_its_position(tiny, recordings):
    report = _check(tiny, recordings["xz"])  # the compressed copy reads the same
    d = report.diagnosis
    assert d.kind == BugClass.DOUBLE_ROTATION
    assert d.keymap.query.agreed() == [11] and d.keymap.keys.agreed() == [2 * j for j in range(12)]
    assert report.engine["contract"]["key_form"] == "raw" and report.engine["contract"]["rotation_index"] == "cache"


def test_replay_refuses_another_model_another_stream_and_an_unrecorded_case(tiny, recordings):
    other = truncated_checkpoint(tiny_checkpoint("llama", num_hidden_layers=3), 1, "float16")
    with pytest.raises(UsageError, match="not this checkpoint"):
        FlashInferReplayAdapter(other, recordings["raw-keys"])
    adapter = FlashInferReplayAdapter(tiny, recordings["raw-keys"])
    with pytest.raises(UsageError, match="token stream"):
        ropekv.check(adapter, cases=[as_case(CASES[0])], seed=1)
    with pytest.raises(UsageError, match="no recording of case"):
        ropekv.check(adapter, cases=[Case(length=5, block_size=4, decode_steps=2)])


def test_recording_reader_refuses_what_is_not_a_recording(tmp_path, recordings):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match="not a readable safetensors"):
        load_recording(junk)
    bad_xz = tmp_path / "junk.safetensors.xz"
    bad_xz.write_bytes(b"\xfd7zXZ\x00garbage")
    with pytest.raises(UsageError, match="xz"):
        load_recording(bad_xz)
    plain = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(plain))
    with pytest.raises(UsageError, match="not a ropekv.flashinfer_recording"):
        load_recording(plain)
    with pytest.raises(UsageError, match="directory"):
        load_recording(tmp_path)
    cut = tmp_path / "cut.safetensors.xz"
    cut.write_bytes(recordings["xz"].read_bytes()[:1000])
    with pytest.raises(UsageError, match="truncated|xz"):
        load_recording(cut)


def test_gpu_script_dry_run_writes_recordings_and_a_summary(tiny, tmp_path):
    save_bundle(make_bundle(tiny, CASES[:1], "float16"), tmp_path / "bundle")
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "flashinfer_gpu.py"),
            "--bundle",
            str(tmp_path / "bundle"),
            "--out",
            str(out),
            "--cpu-standin",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["errors"] == {} and summary["device"] == "cpu"
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(names) == 6 and "flashinfer-float16-raw-keys.safetensors" in names
    tensors, meta = load_recording(out / "flashinfer-angles.safetensors")
    assert meta["kind"] == "angles" and meta["positions"] == [31, 63]
    e = angle_errors(tensors["bfloat16.p63.j0"], 16, meta["rope_theta"], 0, 63, torch.bfloat16)
    assert e.kernel < 1e-5 and abs(e.kernel - e.float32) < 1e-6  # the stand-in turns float32 angles accurately
    report = _check(tiny, out / "flashinfer-bfloat16-rotated-before-append.safetensors")
    assert report.diagnosis.kind == BugClass.DOUBLE_ROTATION


@pytest.fixture(scope="module")
def smollm_truncated():
    from ropekv.models.default import default_checkpoint

    return truncated_checkpoint(default_checkpoint(), 4, "float16")


@pytest.mark.parametrize("setup", ["raw-keys", "rotated-before-append"])
def test_the_h200_recordings_get_their_verdicts_again_on_cpu(smollm_truncated, setup):
    """FlashInfer 0.2.14.post1 on an H200, recorded once (docs/engines/flashinfer.md): judged here again."""
    path = RECORDINGS / f"flashinfer-float16-{setup}.safetensors.xz"
    adapter = FlashInferReplayAdapter(smollm_truncated, path)
    assert adapter.meta["device"] == "NVIDIA H200" and adapter.meta["flashinfer"] == "0.2.14.post1"
    report = ropekv.check(adapter, cases=[as_case(c) for c in adapter.cases])
    if EXPECTED[setup] is None:
        assert report.passed and max(c.max_abs_logit_diff for c in report.judged) < 2e-2
    else:
        assert report.diagnosis.kind == EXPECTED[setup]
        km = report.diagnosis.keymap
        assert km.query.agreed() == [40] and km.keys.agreed()[40] == 80


def test_the_h200_angle_recording_shows_fast_math_phase_errors_growing_with_distance():
    """docs/engines/flashinfer.md's angle table, read again from the recording: FlashInfer's in-kernel
    rotation against the exact relative phase and against transformers' float32 angles."""
    tensors, meta = load_recording(RECORDINGS / "flashinfer-angles.safetensors.xz")
    d, theta = meta["head_dim"], meta["rope_theta"]
    near = angle_errors(tensors["float16.p127.j0"], d, theta, 0, 127, torch.float16)
    far = angle_errors(tensors["float16.p8191.j0"], d, theta, 0, 8191, torch.float16)
    assert near.kernel < 3e-5 and 5e-4 < far.kernel < 1e-3  # 1.7e-5 and 7.6e-4 rad
    assert far.kernel > 4 * far.float32  # five times transformers' float32 angles at 8,191 positions
    bf16 = angle_errors(tensors["bfloat16.p8191.j0"], d, theta, 0, 8191, torch.bfloat16)
    assert abs(bf16.kernel - far.kernel) < 1e-5  # the other module (bfloat16 q/k) turns keys alike
