"""CLI error paths: each bad input is one line on stderr and an exit code, before any heavy work.

``main([...])`` runs in-process. "Before any heavy work" is proven by replacing the weight loader and the
parity harness (and, where the input can be judged without the model, even the config reader) with
functions that fail the test if called. The happy paths are in tests/test_cli.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ropekv.api
import ropekv.models
from ropekv.cli.main import main
from ropekv.errors import ContractMismatch, PayloadError, TransportError, UsageError


def _forbidden(what: str):
    def call(*args, **kwargs):
        raise AssertionError(f"{what} was called: the bad input was not refused before heavy work")

    return call


@pytest.fixture
def no_weights(monkeypatch):
    """Neither the weights nor the harness may be touched; the config may be read."""
    monkeypatch.setattr(ropekv.models, "load_checkpoint", _forbidden("load_checkpoint"))
    monkeypatch.setattr(ropekv.api, "_check", _forbidden("the parity harness"))


@pytest.fixture
def nothing_read(monkeypatch, no_weights):
    """Not even the model's config may be read."""
    monkeypatch.setattr(ropekv.models, "load_config", _forbidden("load_config"))


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, expected_code: int = 2, *named: str) -> str:
    assert code == expected_code, err
    assert err.startswith("ropekv: error: "), err
    assert err.count("\n") == 1 and err.endswith("\n"), f"not exactly one line: {err!r}"
    assert "Traceback" not in err
    for name in named:
        assert name in err, f"{name!r} not named in {err!r}"
    return err


# ----------------------------------------------------------------------------------- judged without the model


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (flags after ``check MODEL``, strings the error must name); ``tmp_path/a_file`` must exist."""
    return {
        "unknown fault": (
            ["--inject", "quadruple-rotation"],
            ["unknown fault 'quadruple-rotation'", "double-rotation"],
        ),
        "json folder missing": (["--json", str(tmp_path / "no" / "r.json")], ["--json", str(tmp_path / "no")]),
        "json is a directory": (["--json", str(tmp_path)], ["--json", "is a directory"]),
        "json under a file": (["--json", str(tmp_path / "a_file" / "r.json")], ["--json", "is not a directory"]),
        "plot folder missing": (["--plot", str(tmp_path / "no" / "r.png")], ["--plot"]),
        "lengths not numbers": (["--lengths", "1,seventeen"], ["--lengths", "'1,seventeen'"]),
        "lengths float": (["--lengths", "1e3"], ["--lengths"]),
        "lengths empty": (["--lengths", ""], ["--lengths"]),
        "lengths only commas": (["--lengths", ",,"], ["--lengths"]),
        "lengths zero": (["--lengths", "0,5"], ["--lengths", "positive"]),
        "lengths negative": (["--lengths=-3"], ["--lengths"]),
        "block sizes zero": (["--block-sizes", "0"], ["--block-sizes"]),
        "prefix offsets negative": (["--prefix-offsets=4,-1"], ["--prefix-offsets"]),
        "window zero": (["--window", "0"], ["--window"]),
        "chunk not a number": (["--chunk", "many"], ["--chunk"]),
        "decode steps zero": (["--decode-steps", "0"], ["--decode-steps"]),
        "sinks without window": (["--sinks", "2"], ["--sinks needs --window"]),
        "negative sinks": (["--sinks=-1", "--window", "4"], ["--sinks"]),
        "seed too large": (["--seed", str(2**64)], ["--seed", "out of range"]),
        "unknown dtype": (["--dtype", "float8"], ["--dtype", "float8"]),
        "unknown key form": (["--key-form", "sideways"], ["--key-form"]),
        "unknown kv dtype": (["--kv-dtype", "fp4"], ["--kv-dtype", "fp4"]),
        "kv scale without kv dtype": (["--kv-scale", "per_head"], ["--kv-scale", "--kv-dtype fp8"]),
        "fp8 cache with bf16 compute": (["--kv-dtype", "fp8", "--dtype", "bfloat16"], ["--kv-dtype fp8", "float32"]),
        "fp8 cache on another engine": (["--kv-dtype", "fp8", "--engine", "hf"], ["--kv-dtype fp8", "--engine ropekv"]),
        "unknown kv scale": (["--kv-dtype", "fp8", "--kv-scale", "per_row"], ["--kv-scale", "per_row"]),
        "hf engine with a fault": (["--engine", "hf", "--inject", "double-rotation"], ["--engine hf"]),
        "lengths trailing comma": (["--lengths", "17,"], ["--lengths", "'17,'"]),
        "lengths empty entry": (["--lengths", "1,,2"], ["--lengths", "'1,,2'"]),
        "lengths beyond any model": (["--lengths", str(10**30)], ["--lengths", "up to 1048576"]),
        "lengths not ascii digits": (["--lengths", "\u0663"], ["--lengths"]),
        "block sizes beyond the bound": (["--block-sizes", "10000000"], ["--block-sizes", "up to 1024"]),
        "window beyond any model": (["--window", "1e9"], ["--window", "up to 1048576"]),
        "chunk huge": (["--chunk", str(10**18)], ["--chunk", "up to 1048576"]),
        "sinks not an integer": (["--sinks", "1.5", "--window", "4"], ["--sinks"]),
        "seed not an integer": (["--seed", "1_000"], ["--seed", "'1_000'"]),
        "rollback of a double minus": (["--ops", "rollback:--3"], ["--ops", "'rollback:--3'", "integer"]),
        "rollback of a superscript": (["--ops", "rollback:\u00b2"], ["--ops", "integer"]),
        "shift beyond the bound": (["--ops", f"shift:{10**30}"], ["--ops", "at most 8589934592"]),
        "unknown engine": (["--engine", "hff"], ["--engine", "unknown engine 'hff'", "did you mean 'hf'?"]),
        "malformed custom engine": (["--engine", "my engine:Cls"], ["--engine my engine:Cls", "not a module name"]),
        "reference cache is a file": (
            ["--reference-cache", str(tmp_path / "a_file")],
            ["--reference-cache", "a_file", "not a directory"],
        ),
        "reference cache folder missing": (
            ["--reference-cache", str(tmp_path / "no" / "refs")],
            ["--reference-cache", str(tmp_path / "no"), "does not exist"],
        ),
    }


BAD_INPUT_NAMES = list(_bad_inputs(Path("/nonexistent-ropekv-test-dir")))


@pytest.mark.parametrize("name", BAD_INPUT_NAMES)
def test_bad_input_is_refused_before_anything_is_read(name, tiny_llama_dir, tmp_path, capsys, nothing_read):
    (tmp_path / "a_file").write_text("x")
    flags, named = _bad_inputs(tmp_path)[name]
    code, out, err = run_cli(capsys, ["check", str(tiny_llama_dir), *flags])
    assert_one_line_error(code, err, 2, *named)
    assert out == ""


def test_cuda_without_a_device(tiny_llama_dir, capsys, nothing_read, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, wherever this runs
    code, _, err = run_cli(capsys, ["check", str(tiny_llama_dir), "--device", "cuda"])
    assert_one_line_error(code, err, 2, "--device cuda")


# ----------------------------------------------------------------------------------- judged on the config


def test_length_beyond_the_model_positions(tiny_llama_dir, capsys, no_weights):
    code, out, err = run_cli(capsys, ["check", str(tiny_llama_dir), "--lengths", "17,300"])
    assert_one_line_error(code, err, 2, "L=300", "303 positions", "the model has 256")
    code, out, err = run_cli(capsys, ["check", str(tiny_llama_dir), "--lengths", "250", "--prefix-offsets", "5"])
    assert_one_line_error(code, err, 2, "the model has 256")


def test_window_larger_than_the_context(tiny_llama_dir, capsys, no_weights):
    code, out, err = run_cli(capsys, ["check", str(tiny_llama_dir), "--lengths", "10", "--window", "50"])
    assert_one_line_error(code, err, 2, "--window 50", "longest context (13 tokens)")
    code, out, err = run_cli(
        capsys, ["check", str(tiny_llama_dir), "--lengths", "10", "--window", "12", "--sinks", "1"]
    )
    assert_one_line_error(code, err, 2, "--window 12")


def test_run_refuses_bad_prompts_before_loading_weights(tiny_llama_dir, capsys, no_weights):
    cases = [
        (["--token-ids", "5,x"], "--token-ids"),
        (["--token-ids", "5,,6"], "--token-ids"),
        (["--token-ids", "5,96"], "token ids must be in [0, 96)"),
        (["--token-ids=-1"], "token ids must be in [0, 96)"),
        (["--token-ids", "5", "--max-new-tokens", "300"], "256 positions"),
        (["--max-new-tokens", "0", "--token-ids", "5"], "--max-new-tokens"),
        (["--prompt", "hello"], "pass --token-ids"),  # a checkpoint without tokenizer.json
    ]
    for flags, named in cases:
        code, out, err = run_cli(capsys, ["run", str(tiny_llama_dir), *flags])
        assert_one_line_error(code, err, 2, named)


# ----------------------------------------------------------------------------------- models and commands


@pytest.mark.parametrize("command", ["check", "run"])
def test_missing_model_path_is_named(command, tmp_path, capsys, no_weights):
    missing = tmp_path / "models" / "not-here"
    code, out, err = run_cli(
        capsys, [command, str(missing), "--token-ids", "1"] if command == "run" else [command, str(missing)]
    )
    assert_one_line_error(code, err, 2, str(missing), "no such file or directory")


def test_pickled_model_is_refused_by_name(tmp_path, capsys, no_weights):
    bin_file = tmp_path / "pytorch_model.bin"
    bin_file.write_bytes(b"\x80\x04junk")
    code, _, err = run_cli(capsys, ["check", str(bin_file)])
    assert_one_line_error(code, err, 2, str(bin_file), "pickled weights are refused")


def test_broken_config_is_named(tiny_llama_dir, tmp_path, capsys, no_weights):
    ck = shutil.copytree(tiny_llama_dir, tmp_path / "ck")
    (ck / "config.json").write_text('{"model_type": "llama",\n "hidden_size": ')
    code, _, err = run_cli(capsys, ["check", str(ck), "--lengths", "5"])
    assert_one_line_error(code, err, 2, str(ck / "config.json"), "not valid JSON")


@pytest.mark.parametrize(
    "argv,named",
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["check", "--no-such-flag"], "unrecognized argument: --no-such-flag"),
        (["--no-such-flag", "check"], "--no-such-flag"),
        (["check", "--lengths"], "expected one argument"),
    ],
)
def test_unknown_subcommand_or_flag(argv, named, capsys, nothing_read):
    code, out, err = run_cli(capsys, argv)
    assert_one_line_error(code, err, 2, named)


def test_no_subcommand_prints_usage_and_exits_2(capsys):
    code, out, err = run_cli(capsys, [])
    assert code == 2 and "usage:" in err


# ----------------------------------------------------------------------------------- exit codes, --debug


@pytest.mark.parametrize(
    "error,code",
    [
        (ContractMismatch("cache and writer cache contracts differ in 1 field(s): key_form", ("key_form",)), 3),
        (TransportError("prefill worker went silent"), 4),
        (PayloadError("payload checksum mismatch"), 2),
        (UsageError("two\nlines"), 2),
    ],
)
def test_errors_raised_inside_a_command(error, code, tiny_llama_dir, capsys, monkeypatch):
    def raising(*args, **kwargs):
        raise error

    monkeypatch.setattr(ropekv.api, "_check", raising)
    got, out, err = run_cli(capsys, ["check", str(tiny_llama_dir), "--lengths", "3", "--no-progress"])
    # the loading summary line comes first; the error is the last line, alone
    assert got == code
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last == "ropekv: error: " + " ".join(str(error).splitlines())
    assert err.endswith(last + "\n") and err.count("ropekv: error:") == 1


@pytest.mark.parametrize("where", ["first", "after the subcommand", "last"])
def test_debug_prints_a_traceback(where, tiny_llama_dir, capsys, nothing_read):
    argv = ["check", str(tiny_llama_dir), "--inject", "nope"]
    argv = {
        "first": ["--debug", *argv],
        "after the subcommand": ["check", "--debug", *argv[1:]],
        "last": [*argv, "--debug"],
    }[where]
    code, out, err = run_cli(capsys, argv)
    assert code == 2
    assert err.startswith("Traceback (most recent call last)") and "UsageError" in err
    assert err.splitlines()[-1].startswith("ropekv: error: unknown fault 'nope'")


def test_debug_traceback_for_a_usage_error_in_parsing(capsys, nothing_read):
    code, out, err = run_cli(capsys, ["--debug", "check", "--lengths", "x"])
    assert code == 2 and "Traceback" in err and err.splitlines()[-1].startswith("ropekv: error:")


# ----------------------------------------------------------------------------------- one sign, one message


def test_each_bad_value_of_a_flag_gets_the_same_message(tiny_llama_dir, capsys, nothing_read):
    """``--lengths 0`` and ``--lengths -5`` were "positive" and "non-negative": one message per flag."""
    messages = set()
    for value in ("0", "-5", "x", "17,", str(2**64)):
        code, _, err = run_cli(capsys, ["check", str(tiny_llama_dir), f"--lengths={value}"])
        assert_one_line_error(code, err, 2, "--lengths", repr(value))
        messages.add(err.replace(repr(value), "VALUE"))
    assert messages == {
        "ropekv: error: ropekv check: argument --lengths: expected comma-separated positive integers up to "
        "1048576, got VALUE\n"
    }


@pytest.mark.parametrize(
    "argv,expected",
    [
        (
            ["check", "--lenghts", "3"],
            "ropekv: error: ropekv check: unrecognized argument: --lenghts; did you mean '--lengths'?\n",
        ),
        (
            ["check", "--plto=x.png"],
            "ropekv: error: ropekv check: unrecognized argument: --plto=x.png; did you mean '--plot'?\n",
        ),
        (["handoff", "--decode-wrkers", "2"], "did you mean '--decode-workers'?"),
        (
            ["chek"],
            "invalid choice: 'chek' (choose from 'check', 'run', 'handoff', 'bench', 'models', 'replay'); did you mean 'check'?",
        ),
        (["check", "--dtype", "f16"], "did you mean 'float16'?"),
    ],
)
def test_unknown_flags_and_choices_name_the_nearest(argv, expected, capsys, nothing_read):
    code, _, err = run_cli(capsys, argv)
    assert_one_line_error(code, err, 2)
    assert "ropekv: error: ropekv:" not in err  # the prefix once
    assert err == expected if expected.startswith("ropekv: error:") else expected in err


# ----------------------------------------------------------------------------------- every subcommand's numbers


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--seed", "99999999999999999999999"], "--seed"),
        (["--seed", "1.5"], "--seed"),
        (["--timeout", "1e14"], "--timeout"),
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "inf"], "--timeout"),
        (["--timeout", "0"], "--timeout"),
        (["--timeout=-3"], "--timeout"),
        (["--decode-steps", str(10**20)], "--decode-steps"),
        (["--decode-workers", "1000"], "--decode-workers"),
        (["--block-sizes", "10000000"], "--block-sizes"),
        (["--lengths", "17,"], "--lengths"),
        (["--lengths", "0"], "--lengths"),
        (["--decode-rope-theta", "inf"], "--decode-rope-theta"),
        (["--decode-rope-theta", "1e300"], "--decode-rope-theta"),
    ],
)
def test_handoff_numbers_are_bounded_before_any_worker_starts(flags, named, tiny_llama_dir, capsys, monkeypatch):
    import ropekv.handoff.workers

    monkeypatch.setattr(ropekv.handoff.workers, "launch", _forbidden("the handoff launcher"))
    code, out, err = run_cli(capsys, ["handoff", str(tiny_llama_dir), *flags])
    assert_one_line_error(code, err, 2, named)


@pytest.mark.parametrize(
    "argv,named",
    [
        (["run", "--token-ids", "\u0663"], "--token-ids"),
        (["run", "--token-ids", "1_0"], "--token-ids"),
        (["run", "--max-new-tokens", str(10**30)], "--max-new-tokens"),
        (["bench", "--threads", "100000"], "--threads"),
        (["bench", "--contexts", "128,"], "--contexts"),
        (["bench", "--contexts", "0"], "--contexts"),
        (["bench", "--steps", str(10**9)], "--steps"),
        (["bench", "--bandwidth-mib", str(10**9)], "--bandwidth-mib"),
    ],
)
def test_run_and_bench_numbers_are_bounded(argv, named, tiny_llama_dir, capsys, no_weights, monkeypatch):
    import ropekv.bench.run

    monkeypatch.setattr(ropekv.bench.run, "run_bench", _forbidden("the benchmark"))
    code, out, err = run_cli(capsys, [argv[0], str(tiny_llama_dir), *argv[1:]])
    assert_one_line_error(code, err, 2, named)
