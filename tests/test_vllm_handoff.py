"""``ropekv handoff --engine vllm`` without vLLM: flags, refusal files, store directories, timeouts.

The vLLM runs themselves are in engine_tests/vllm/test_handoff.py (the engine venv).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ropekv.bugs.registry import VLLM_TRANSFER_FAULTS, get_transfer_fault
from ropekv.cli.main import main
from ropekv.contract import CacheContract
from ropekv.errors import ContractMismatch, EngineUnavailable, TransportError, UsageError
from ropekv.handoff import vllm_driver
from ropekv.handoff.refusals import REFUSALS_FILE, read_refusals, refusal_error
from ropekv.rope import RopeSpec


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["handoff", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--connector", "example", "--lengths", "20"], "exceed one block"),
        (["--lengths", "70,70"], "distinct"),
        (["--inject", "rotate-on-transfer"], "not a vLLM transfer fault"),
        (["--decode-workers", "2"], "--decode-workers: not taken by --engine vllm"),
        (["--key-form-decode", "raw"], "--key-form-decode: not taken"),
    ],
)
def test_vllm_flags_are_validated_before_anything_starts(capsys, argv, message):
    code, out, err = _cli(capsys, "--engine", "vllm", *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1
    assert out == ""


def test_a_vllm_fault_is_refused_on_ropekv_engine(capsys):
    code, _, err = _cli(capsys, "--inject", "consumer_rope_theta")
    assert code == 2 and "use it with --engine vllm" in err


def test_unknown_connector_is_one_line_exit_2(capsys):
    code, _, err = _cli(capsys, "--engine", "vllm", "--connector", "nixl")
    assert code == 2 and "invalid choice: 'nixl'" in err


def test_list_faults_lists_every_transfer_fault(capsys):
    code, out, _ = _cli(capsys, "--engine", "vllm", "--list-faults")
    assert code == 0
    names = [line.split()[0] for line in out.strip().splitlines()]
    assert names == list(VLLM_TRANSFER_FAULTS)
    assert {
        "consumer_rope_theta",
        "consumer_linear_scaling",
        "consumer_yarn_scaling",
        "consumer_other_weights",
        "consumer_bfloat16",
        "inject_position_shift",
        "forged_store_entry",
    } == set(names)


def test_without_vllm_the_run_is_engine_unavailable(monkeypatch):
    monkeypatch.setattr(vllm_driver.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineUnavailable, match="not importable"):
        vllm_driver.run(vllm_driver.Options())


@pytest.mark.parametrize(
    "kwargs",
    [dict(decode_steps=0), dict(timeout=0.5), dict(connector="nixl"), dict(fault="nope"), dict(lengths=())],
)
def test_options_are_bounded(kwargs):
    with pytest.raises(UsageError):
        vllm_driver.Options(**kwargs)


# ---------------------------------------------------------------------- refusals


def test_refusals_become_one_contract_mismatch_naming_every_field(tmp_path):
    lines = [
        {"request_id": "r1", "key": "abc", "fields": ["rope.theta"], "message": "rope.theta differs", "policy": "fail"},
        {"request_id": "r2", "key": "abc", "fields": ["rope.theta", "dtype"], "message": "m", "policy": "fail"},
    ]
    (tmp_path / REFUSALS_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))
    refusals = read_refusals(tmp_path, None)
    assert [r.request_id for r in refusals] == ["r1", "r2"]
    error = refusal_error(refusals)
    assert isinstance(error, ContractMismatch) and error.exit_code == 3
    assert error.fields == ("rope.theta", "dtype")
    assert "request r1" in str(error) and "policy fail" in str(error) and "1 more" in str(error)


def test_no_refusal_file_means_no_refusal(tmp_path):
    assert read_refusals(tmp_path, None) == [] and refusal_error([]) is None


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        json.dumps({"request_id": "r"}),
        json.dumps({"request_id": "r", "key": "k", "fields": "rope.theta", "message": "m", "policy": "fail"}),
    ],
)
def test_a_broken_refusal_line_is_a_transport_error(tmp_path, line):
    (tmp_path / REFUSALS_FILE).write_text(line + "\n")
    with pytest.raises(TransportError, match=f"{REFUSALS_FILE}:1: not a refusal record"):
        read_refusals(tmp_path, None)


def test_a_line_nested_100000_deep_is_a_transport_error(tmp_path):
    (tmp_path / REFUSALS_FILE).write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(TransportError, match=f"{REFUSALS_FILE}:1: .*not a refusal record"):
        read_refusals(tmp_path, None)
    (tmp_path / REFUSALS_FILE).write_text("[" * 20_000 + "]" * 20_000 + "\n")  # under the line bound: the parser's
    with pytest.raises(TransportError, match=f"{REFUSALS_FILE}:1: not a refusal record"):
        read_refusals(tmp_path, None)


def test_a_refusal_log_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    path = tmp_path / REFUSALS_FILE
    os.mkfifo(path)
    outcome: list[BaseException | object] = []
    reader = threading.Thread(target=lambda: outcome.append(_catch(lambda: read_refusals(tmp_path, None))))
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # let the blocked reader go: a writer opens and closes the FIFO
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join()
    assert len(outcome) == 1 and isinstance(outcome[0], TransportError), outcome
    assert "not a regular file (a FIFO)" in str(outcome[0])


def _catch(call):
    try:
        return call()
    except Exception as exc:
        return exc


def test_only_this_runs_refusals_count(tmp_path):
    stale = {"request_id": "r0", "key": "k", "fields": ["rope.theta"], "message": "m", "policy": "fail", "run": "old"}
    unmarked = {"request_id": "r1", "key": "k", "fields": ["dtype"], "message": "m", "policy": "fail"}
    (tmp_path / REFUSALS_FILE).write_text(json.dumps(stale) + "\n" + json.dumps(unmarked) + "\n")
    assert read_refusals(tmp_path, "new") == [] and refusal_error(read_refusals(tmp_path, "new")) is None
    ours = dict(stale, request_id="r2", run="new", fields=["dtype"])
    with (tmp_path / REFUSALS_FILE).open("a") as f:
        f.write(json.dumps(ours) + "\n")
    assert [(r.request_id, r.run) for r in read_refusals(tmp_path, "new")] == [("r2", "new")]
    assert [r.request_id for r in read_refusals(tmp_path, None)] == ["r0", "r1", "r2"]


# ---------------------------------------------------------------------- the store directory


def test_store_missing_is_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such directory"):
        vllm_driver.check_store(tmp_path / "nope", 1)


def test_store_not_a_directory_is_usage_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        vllm_driver.check_store(tmp_path / "f", 1)


def test_store_unreadable_is_usage_error_for_any_user(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_driver.os, "access", lambda path, mode: False)
    with pytest.raises(UsageError, match="not readable and writable"):
        vllm_driver.check_store(tmp_path, 1)


def test_store_full_is_usage_error(tmp_path):
    free = vllm_driver.shutil.disk_usage(tmp_path).free
    with pytest.raises(UsageError, match="full"):
        vllm_driver.check_store(tmp_path, free + 2**40)


def test_entry_size_counts_every_layer_key_and_value(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 30, "num_key_value_heads": 3, "hidden_size": 576, "num_attention_heads": 9})
    )
    # SmolLM2-135M: 30 layers x 70 tokens x 3 heads x (64 key + 64 value) channels x 4 bytes
    assert vllm_driver.entry_bytes(tmp_path, 70) == 30 * 70 * 3 * 128 * 4


def test_a_store_full_during_the_transfer_is_a_transport_error():
    outcome = vllm_driver.RoleOutcome(
        "producer", 1, {"status": "crash", "error": "OSError: [Errno 28] No space left on device"}, "", 1.0
    )
    error = vllm_driver._outcome_error(outcome)
    assert isinstance(error, TransportError) and "store is full" in str(error)


# ---------------------------------------------------------------------- the sides' processes


def test_a_hung_side_is_killed_with_its_group_within_the_timeout(tmp_path):
    # The "side" starts a grandchild that would outlive it; both must be gone after the timeout.
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    started = time.monotonic()
    with pytest.raises(TransportError, match="vLLM producer did not finish within 2 s and was killed"):
        vllm_driver.run_role(
            "producer", [sys.executable, "-c", code], timeout=2, result=tmp_path / "r.json", log=tmp_path / "log"
        )
    assert time.monotonic() - started < 10
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(grandchild):
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for this purpose
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def test_a_killed_side_is_a_transport_error_naming_the_signal(tmp_path):
    outcome = vllm_driver.run_role(
        "producer",
        [sys.executable, "-c", f"import os; print('dying'); os.kill(os.getpid(), {int(signal.SIGKILL)})"],
        timeout=30,
        result=tmp_path / "r.json",
        log=tmp_path / "log",
    )
    error = vllm_driver._outcome_error(outcome)
    assert isinstance(error, TransportError)
    assert "killed by signal 9" in str(error) and "dying" in str(error)


def test_a_side_error_comes_back_as_its_class(tmp_path):
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"status": "error", "error_class": "CheckpointError", "error": "bad dir"}))
    outcome = vllm_driver.run_role(
        "consumer", [sys.executable, "-c", "pass"], timeout=30, result=result, log=tmp_path / "log"
    )
    error = vllm_driver._outcome_error(outcome)
    assert type(error).__name__ == "CheckpointError" and "vLLM consumer: bad dir" in str(error)


# ---------------------------------------------------------------------- naming the differences


def _side(theta: float, dtype: str = "float32", fingerprint: str = "fp-a") -> dict:
    rope = RopeSpec(head_dim=64, rotary_dim=64, theta=theta)
    contract = CacheContract(
        key_form="rotated",
        rope=rope,
        block_size=32,
        dtype=dtype,
        num_layers=2,
        num_kv_heads=3,
        head_dim=64,
        weights_fingerprint=fingerprint,
    )
    return {"cache_contract": contract.to_dict(), "contract": {"theta": theta, "dtype": dtype, "kernel_isa": "vec"}}


def test_the_sides_differences_are_named_with_their_consequence():
    contract, runs = vllm_driver.compare_sides(_side(100000.0), _side(20000.0, "bfloat16", "fp-b"))
    fields = [d.diff.field for d in contract]
    assert fields == ["rope.theta", "dtype", "weights_fingerprint"] or set(fields) == {
        "rope.theta",
        "dtype",
        "weights_fingerprint",
    }
    theta = next(d for d in contract if d.diff.field == "rope.theta")
    assert theta.diff.ours == 20000.0 and theta.diff.theirs == 100000.0
    assert "frequenc" in theta.consequence
    assert {d.field for d in runs} == {"theta", "dtype"}


def test_agreeing_sides_have_no_difference():
    assert vllm_driver.compare_sides(_side(100000.0), _side(100000.0)) == ([], [])


def test_fault_model_copies_change_only_what_they_say(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"rope_theta": 100000.0, "hidden_size": 8}))
    (src / "model.safetensors").write_bytes(b"weights")
    dest = get_transfer_fault("consumer_rope_theta").consumer_model_dir(src, tmp_path / "dest")
    config = json.loads((dest / "config.json").read_text())
    assert config["rope_theta"] == 20000.0 and config["hidden_size"] == 8
    assert (dest / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "config.json").read_text())["rope_theta"] == 100000.0  # the source is untouched


def test_model_config_type_is_what_faults_edit():
    # the edited keys are ones ropekv's config reader takes (a typo would silently change nothing)
    for name in ("consumer_rope_theta", "consumer_linear_scaling", "consumer_yarn_scaling"):
        changes = get_transfer_fault(name).consumer_config
        assert changes and set(changes) <= {"rope_theta", "rope_parameters", "rope_scaling"}


def test_subprocess_of_this_python_imports_this_tree():
    out = subprocess.run(
        [sys.executable, "-c", "import ropekv.handoff.vllm_role as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert Path(out.strip()).resolve().is_relative_to(Path(vllm_driver.__file__).resolve().parents[2])
