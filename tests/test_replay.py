"""``ropekv replay``'s parts that need no engine release: the corpus, the judging, the table, the venv
pins, the model folder, the worker's error path and the adapters' version gates.

The replay itself (every corpus entry on its buggy and fixed release) runs in engine_tests/replay.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ropekv.adapters.hf_legacy import legacy_key_positions
from ropekv.adapters.hf_versions import require_supported as hf_require
from ropekv.adapters.mlx.versions import require_supported as mlx_require
from ropekv.cli.main import main
from ropekv.errors import ConfigError, EngineUnavailable
from ropekv.parity.bug_class import BugClass
from ropekv.replay import worker
from ropekv.replay.corpus import load_corpus, parse_corpus
from ropekv.replay.run import Side, judge
from ropekv.replay.table import format_table
from ropekv.replay.venvs import BASE_PINS, STAMP, VenvStore

ROOT = Path(__file__).resolve().parent.parent


def _entry(**changes):
    entry = {
        "name": "e1",
        "engine": "mlx-lm",
        "buggy": "0.26.3",
        "fixed": "0.26.4",
        "upstream": "ml-explore/mlx-lm PR 390",
        "story": "a story",
        "expect": "window_mismatch",
        "model": {"model_type": "gemma3_text", "sliding_window": 8},
        "case": {"length": 12, "decode_steps": 5},
    }
    entry.update(changes)
    return entry


def _parse(*entries):
    return parse_corpus({"entry": list(entries)}, "test.toml")


# ---------------------------------------------------------------------------------------------- corpus


def test_the_shipped_corpus_reads_and_covers_both_engines():
    corpus = load_corpus()
    assert len(corpus.entries) >= 10 and len({e.engine for e in corpus.entries}) >= 2
    assert {e.engine for e in corpus.entries} == {"transformers", "mlx-lm"}
    assert all(isinstance(e.expect, BugClass) for e in corpus.entries)
    assert len({e.upstream for e in corpus.entries}) == len(corpus.entries)  # ten bugs, not one bug ten times


def test_an_entry_reads_back_as_written():
    e = _parse(_entry(options={}, case={"length": 7})).entries[0]
    assert (e.name, e.engine, e.buggy, e.fixed, e.expect) == (
        "e1",
        "mlx-lm",
        "0.26.3",
        "0.26.4",
        BugClass.WINDOW_MISMATCH,
    )
    assert (e.case.length, e.case.decode_steps, e.case.prefix, e.case.chunk) == (7, 4, 0, None)  # the defaults
    c = _parse(_entry(case={"length": 9, "prefix": 5, "chunk": 4})).entries[0].case
    assert (c.prefix, c.chunk) == (5, 4)
    assert dict(e.model) == {"model_type": "gemma3_text", "sliding_window": 8}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"colour": "red"}, "unknown key(s) colour"),
        ({"engine": "vllm"}, "engine 'vllm' is not one of"),
        ({"buggy": "latest"}, "must be a release number"),
        ({"fixed": "0.26.3"}, "the same release"),
        ({"expect": "cosmic_rays"}, "is not a bug class"),
        ({"name": "a b"}, "must be letters"),
        ({"story": ""}, "story must be a non-empty string"),
        ({"case": {"length": 0}}, "case.length must be an integer in [1, 4096]"),
        ({"case": {"length": True}}, "case.length must be an integer"),
        ({"case": {"window": 3}}, "case: unknown key(s) window"),
        ({"case": {"chunk": 0}}, "case.chunk must be an integer in [1, 4096]"),
        ({"options": {"drive": "generate"}}, "unknown key(s) drive for mlx-lm"),
        ({"model": {"sliding_window": 8}}, "model.model_type must be an architecture name"),
        (
            {"model": {"model_type": "llama", "hidden_size": 1 << 20}},
            "model.hidden_size must be an integer in [1, 1024]",
        ),
        ({"model": {"model_type": "llama", "rope_theta": float("nan")}}, "not a finite number"),
        ({"model": {"model_type": "llama", "a": {"b": {"c": {"d": {"e": 1}}}}}}, "nested too deep"),
    ],
)
def test_a_bad_entry_is_refused_naming_it(changes, message):
    with pytest.raises(ConfigError) as err:
        _parse(_entry(**changes))
    assert message in str(err.value)


def test_transformers_options_are_checked():
    ok = _parse(_entry(engine="transformers", buggy="4.51.3", fixed="4.52.1", options={"drive": "generate"}))
    assert dict(ok.entries[0].options) == {"drive": "generate"}
    with pytest.raises(ConfigError, match="options.drive must be one of forward, generate"):
        _parse(_entry(engine="transformers", buggy="4.51.3", fixed="4.52.1", options={"drive": "fast"}))


def test_two_entries_with_one_name_and_an_empty_corpus_are_refused():
    with pytest.raises(ConfigError, match="two entries named 'e1'"):
        _parse(_entry(), _entry())
    with pytest.raises(ConfigError, match="no \\[\\[entry\\]\\] tables"):
        parse_corpus({"entry": []}, "test.toml")
    with pytest.raises(ConfigError, match="unknown top-level key"):
        parse_corpus({"entry": [_entry()], "title": "x"}, "test.toml")


def test_corpus_files_that_are_not_corpora_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="a directory"):
        load_corpus(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text("[[entry]\nname=")
    with pytest.raises(ConfigError, match="not a TOML file"):
        load_corpus(bad)
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(ConfigError, match="at most 1048576 bytes"):
        load_corpus(big)


def test_select_keeps_the_named_entries_and_refuses_unknown_ones():
    corpus = _parse(_entry(), _entry(name="e2"))
    assert [e.name for e in corpus.select(["e2"]).entries] == ["e2"]
    with pytest.raises(ConfigError, match="no entry named nope"):
        corpus.select(["nope"])


# ---------------------------------------------------------------------------------------------- judging


def _side(version, **kw):
    return Side(version, ran_version=kw.pop("ran_version", version), **kw)


def test_an_entry_replays_when_buggy_fails_with_its_class_and_fixed_passes():
    e = _parse(_entry()).entries[0]
    o = judge(e, _side("0.26.3", passed=False, kind="window_mismatch"), _side("0.26.4", passed=True))
    assert o.replayed and o.problems == ()


@pytest.mark.parametrize(
    "buggy, fixed, problem",
    [
        (_side("0.26.3", passed=True), _side("0.26.4", passed=True), "buggy 0.26.3 PASSES"),
        (
            _side("0.26.3", passed=False, kind="unknown", evidence="why"),
            _side("0.26.4", passed=True),
            "named unknown, expected window_mismatch: why",
        ),
        (
            _side("0.26.3", passed=False, kind="window_mismatch"),
            _side("0.26.4", passed=False, kind="unknown", max_dlogit=0.5, divergence="step 0"),
            "fixed 0.26.4 FAILS",
        ),
        (
            Side("0.26.3", error="installing mlx-lm==0.26.3 failed: no such version"),
            _side("0.26.4", passed=True),
            "failed: no such version",
        ),
        (
            _side("0.26.3", ran_version="0.26.2", passed=False, kind="window_mismatch"),
            _side("0.26.4", passed=True),
            "the venv ran 0.26.2",
        ),
    ],
)
def test_every_other_outcome_is_a_failure_with_its_reason(buggy, fixed, problem):
    o = judge(_parse(_entry()).entries[0], buggy, fixed)
    assert not o.replayed
    assert any(problem in p for p in o.problems), o.problems


def test_the_table_has_a_row_per_entry_and_names_each_problem_and_reading():
    e1, e2 = _parse(_entry(), _entry(name="e2")).entries
    ok = judge(
        e1,
        _side("0.26.3", passed=False, kind="window_mismatch", divergence="step 0 (position 12) layer 1 vs reference"),
        _side("0.26.4", passed=True, reading=("mlx-lm reads X",)),
    )
    bad = judge(e2, _side("0.26.3", passed=True), _side("0.26.4", passed=True))
    text = format_table([ok, bad])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["entry", "engine", "buggy"]
    assert lines[2].split() == [
        "e1",
        "mlx-lm",
        "0.26.3",
        "FAIL",
        "window_mismatch",
        "step",
        "0",
        "(position",
        "12)",
        "layer",
        "1",
        "vs",
        "reference",
        "0.26.4",
        "PASS",
        "yes",
    ]
    assert lines[3].split()[-1] == "NO"
    assert "e2: buggy 0.26.3 PASSES" in text
    assert "e1: fixed 0.26.4 reads the config otherwise: mlx-lm reads X" in text
    assert text.endswith("1 of 2 entries replay (1 engine: mlx-lm)")


# ---------------------------------------------------------------------------------------------- venvs, models, worker


def test_base_pins_are_the_projects_own():
    pinned = {}
    for line in (ROOT / "requirements-ci.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[name.strip()] = version.strip()
    for pin in BASE_PINS:
        name, version = pin.split("==")
        assert pinned[name] == version, f"{pin} differs from requirements-ci.txt ({pinned.get(name)})"


def test_a_stamped_venv_is_reused_without_pip(tmp_path, monkeypatch):
    import ropekv.replay.venvs as venvs

    monkeypatch.setattr(venvs, "_run", lambda *a, **k: pytest.fail("pip was run for a venv already built"))
    for name, pins in (("base", BASE_PINS), ("mlx-lm-0.26.3", venvs.release_pins("mlx-lm", "0.26.3"))):
        (tmp_path / name / "bin").mkdir(parents=True)
        (tmp_path / name / "bin" / "python").write_text("")
        (tmp_path / name / STAMP).write_text("\n".join(pins) + "\n")
    venv = VenvStore(tmp_path).release("mlx-lm", "0.26.3")
    assert venv.seconds == 0.0 and venv.pins == ("mlx==0.32.4", "mlx-cpu==0.32.4", "mlx-lm==0.26.3")
    assert (tmp_path / "src" / "ropekv").resolve() == (ROOT / "ropekv").resolve()


def test_the_model_folder_keeps_the_entrys_spelling_and_is_built_once(tmp_path):
    from ropekv.replay.model import model_dir

    rope = {"type": "linear", "factor": 2.0}
    e = _parse(
        _entry(name="tiny", model={"model_type": "llama", "rope_scaling": rope, "num_hidden_layers": 1})
    ).entries[0]
    path = model_dir(tmp_path, e)
    config = json.loads((path / "config.json").read_text())
    assert config["rope_scaling"] == rope and "rope_parameters" not in config  # the old releases' spelling
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 64  # TINY_BASE fills the rest
    assert sorted(p.name for p in path.iterdir()) == [".ropekv-replay-model", "config.json", "model.safetensors"]
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert model_dir(tmp_path, e) == path and (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_the_worker_writes_a_ropekv_error_as_one_line(tmp_path):
    request, out = tmp_path / "request.json", tmp_path / "out.json"
    request.write_text(
        json.dumps({"engine": "nope", "model_dir": str(tmp_path), "case": {"length": 3, "decode_steps": 1}})
    )
    assert worker.main([str(request), str(out)]) == 0
    assert json.loads(out.read_text()) == {"error": "replay worker: unknown engine 'nope'"}


def test_cli_refuses_a_bad_corpus_in_one_line(tmp_path, capsys):
    bad = tmp_path / "mine.toml"
    bad.write_text('[[entry]]\nname = "x"\nengine = "vllm"\n')
    assert main(["replay", "--corpus", str(bad), "--venvs", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ropekv: error: ") and "engine 'vllm' is not one of" in err[0]
    assert not (tmp_path / "v").exists()  # nothing installed before the corpus was read
    assert main(["replay", "--entries", "nope", "--venvs", str(tmp_path / "v")]) == 2


# ---------------------------------------------------------------------------------------------- version gates


@pytest.mark.parametrize("version", ["4.41.2", "3.5.1"])
def test_hf_adapter_refuses_an_older_transformers_naming_the_range(version):
    with pytest.raises(
        EngineUnavailable,
        match=f"transformers {version} is not supported: the HF adapter drives transformers 4.42 or later",
    ):
        hf_require(version)


def test_hf_versions_pick_each_releases_spellings():
    old, mid, new = hf_require("4.44.2"), hf_require("4.53.3"), hf_require("5.23.0")
    assert (old.attention_interface, mid.attention_interface, new.attention_interface) == (False, False, True)
    assert (old.logits_keyword, mid.logits_keyword, new.logits_keyword) == (None, "logits_to_keep", "logits_to_keep")
    assert hf_require("4.56.0").attention_interface
    assert hf_require("4.45.0").logits_keyword == "num_logits_to_keep"
    assert (old.dtype_keyword, new.dtype_keyword) == ("torch_dtype", "dtype")
    assert hf_require("5.0.0rc1").number == (5, 0, 0)


def test_mlx_adapter_refuses_an_older_mlx_lm_naming_the_range():
    with pytest.raises(
        EngineUnavailable, match="mlx-lm 0.21.5 is not supported: the mlx adapter drives mlx-lm 0.22 or later"
    ):
        mlx_require("0.21.5")
    assert mlx_require("0.22.0") == (0, 22, 0)


def test_legacy_key_positions_follow_the_caches_slots():
    assert legacy_key_positions(5, 4).tolist() == [0, 1, 2, 3, 4]  # a dynamic cache: N = t + 1
    assert legacy_key_positions(16, 4).tolist() == list(range(16))  # a static cache's slots, unwritten ones masked
    assert legacy_key_positions(8, 11).tolist() == list(range(4, 12))  # a full static sliding cache: the last 8


def test_a_one_cell_mask_broadcasts_as_the_kernel_broadcasts_it():
    import torch

    from ropekv.adapters.hf import _visibility

    rows, qpos, kpos = torch.tensor([16]), torch.tensor([16]), torch.arange(17)
    every = _visibility(torch.zeros(1, 1, 1, 1), rows, qpos, kpos, None)  # additive 0: nothing masked
    assert every.shape == (1, 17) and bool(every.all())
    causal = torch.full((1, 1, 17, 17), torch.finfo(torch.float32).min).triu(1)
    assert _visibility(causal, rows, qpos, kpos, None).tolist() == [[True] * 17]


def test_generate_positions_come_from_what_generate_handed_the_model():
    import torch

    from ropekv.adapters.hf_generate import _positions

    # Phi-3's recomputation passes all 17 tokens with the step's one-token cache_position: position_ids win
    kwargs = {"position_ids": torch.arange(17)[None], "cache_position": torch.tensor([16])}
    assert _positions(kwargs, 17).tolist() == list(range(17))
    assert _positions({"cache_position": torch.tensor([9])}, 1).tolist() == [9]
    assert _positions({}, 3).tolist() == [0, 1, 2]
