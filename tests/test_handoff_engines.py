"""``ropekv handoff --engine mlx|llamacpp``: the dispatch to the adapters' transfer checks, in .venv.

The checks themselves run in the engines' venvs (engine_tests/mlx/test_prompt_cache.py,
engine_tests/llamacpp/test_state.py); here: each engine's flags are refused one-line under another
engine, the flags an adapter check does not take are refused, and an engine that is not installed
is one line, exit 2.
"""

from __future__ import annotations

import importlib.util

import pytest

from ropekv.cli.main import main


def _run(argv, capsys):
    code = main(["handoff", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ropekv: error: "), err  # one line, never a traceback
    return code, err[0]


@pytest.mark.parametrize(
    ("argv", "flag", "owner"),
    [
        (["--mlx-length", "20"], "--mlx-length", "mlx"),
        (["--engine", "vllm", "--llamacpp-unchecked"], "--llamacpp-unchecked", "llamacpp"),
        (["--engine", "mlx", "--gguf", "x.gguf"], "--gguf", "llamacpp"),
        (["--engine", "llamacpp", "--mlx-reader-rope-theta", "20000"], "--mlx-reader-rope-theta", "mlx"),
    ],
)
def test_an_engines_flags_are_refused_under_another_engine(argv, flag, owner, capsys):
    code, line = _run(argv, capsys)
    assert code == 2 and f"{flag}: only taken by --engine {owner}" in line


@pytest.mark.parametrize(
    ("engine", "argv", "flag"),
    [
        ("mlx", ["--lengths", "5"], "--lengths"),
        ("mlx", ["--json", "out.json"], "--json"),
        ("llamacpp", ["--connector", "ropekv"], "--connector"),
        ("llamacpp", ["--inject", "forged_store_entry"], "--inject"),
        ("llamacpp", ["--decode-workers", "2"], "--decode-workers"),
    ],
)
def test_flags_an_adapter_check_does_not_take_are_refused(engine, argv, flag, capsys):
    code, line = _run(["--engine", engine, *argv], capsys)
    assert code == 2 and line.startswith(f"ropekv: error: {flag}") and f"not taken by --engine {engine}" in line


@pytest.mark.parametrize(("engine", "module"), [("mlx", "mlx"), ("llamacpp", "llama_cpp")])
def test_an_engine_not_installed_here_is_one_line(engine, module, capsys):
    assert importlib.util.find_spec(module) is None  # .venv has no engines; their venvs run the checks
    code, line = _run(["--engine", engine], capsys)
    assert code == 2 and ("not available in this environment" in line or "not installed here" in line)
