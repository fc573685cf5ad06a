"""llama.cpp sequence state moved into a fresh context: parity after the restore, what raw llama.cpp
accepts under another RoPE (as measured), and ropekv's checked pair refusing it before anything is
written (docs/engines/llamacpp.md, "Sequence state")."""

from __future__ import annotations

import pytest

from ropekv.adapters.llamacpp.rope_params import RopeOverrides
from ropekv.adapters.llamacpp.state import (
    StateContext,
    get_seq_state,
    load_seq_file,
    load_state,
    save_seq_file,
    save_state,
    set_seq_state,
    state_bound,
)
from ropekv.adapters.llamacpp.state_check import References, check_transfer
from ropekv.errors import ContractMismatch, PayloadError

N, STEPS = 64, 2
BASE_20K = RopeOverrides(freq_base=20000.0)


@pytest.fixture(scope="module")
def refs(f32_engine, reference) -> References:
    return References(f32_engine, default=reference)


@pytest.fixture(scope="module")
def stream(tokens) -> list[int]:
    return tokens.tolist()[: N + STEPS]


def test_restore_into_a_fresh_context_has_parity_on_the_f32_gguf(f32_engine, refs, stream, tmp_path):
    c = check_transfer(f32_engine, refs, stream, N, STEPS, state_path=tmp_path / "s")
    assert c.passed and c.accepted_bytes == c.state_bytes
    for s in c.steps:
        assert s.vs_writer == 0.0  # the restored cells are the writer's bytes: the same decode, bit for bit
        # measured 4.8e-7 / 5.4e-7 from float64 and 7.1e-7 / 6.2e-7 from its own full forward
        assert s.vs_reference is not None and s.vs_reference < 1e-5 and s.vs_self < 1e-5


def test_restore_on_the_q4_1_file_stays_within_its_noise_floor(q4_engine, refs, stream, tmp_path):
    # refs holds the float64 reference of the float32 GGUF: the Q4_1 file's weights, dequantized exactly
    # (test_f32_gguf.py), so its forward over these tokens is computed once for both files.
    assert q4_engine.checkpoint.fingerprint == refs.engine.checkpoint.fingerprint
    c = check_transfer(q4_engine, refs, stream, N, STEPS, state_path=tmp_path / "s")
    assert c.passed and c.tolerance == q4_engine.tolerance.logits
    assert all(s.vs_writer == 0.0 for s in c.steps)
    # measured 2.0e-2 / 2.8e-2 from float64 (quantization; tolerance 0.15), 0 from its own full forward
    assert all(s.vs_reference is not None and 5e-3 < s.vs_reference < 0.1 for s in c.steps)


def test_the_contract_is_what_the_graph_runs(f32_engine):
    """The probed RoPE of a default context is the model's own spec as ropekv reads the GGUF; a setting
    shows up in the contract as llama.cpp resolved it."""
    assert StateContext(f32_engine).contract.rope == f32_engine.config.rope
    other = StateContext(f32_engine, rope=RopeOverrides(freq_base=20000.0, freq_scale=0.5))
    assert other.contract.rope.theta == 20000.0
    assert other.contract.rope.scaling.rope_type == "linear" and other.contract.rope.scaling.factor == 2.0


@pytest.mark.parametrize(
    "reader, field",
    [
        (BASE_20K, "rope.theta"),
        (RopeOverrides(freq_scale=0.5), "rope.scaling.rope_type"),
        (RopeOverrides(scaling_type="yarn", freq_scale=0.25, yarn_orig_ctx=2048), "rope.scaling.rope_type"),
    ],
    ids=["freq_base", "freq_scale", "yarn"],
)
def test_checked_load_refuses_another_rope_before_writing(f32_engine, stream, tmp_path, reader, field):
    writer = StateContext(f32_engine)
    writer.prefill(stream[:N])
    save_state(writer, tmp_path / "s", stream[:N])
    target = StateContext(f32_engine, rope=reader)
    with pytest.raises(ContractMismatch) as err:
        load_state(target, tmp_path / "s", stream[:N])
    assert field in err.value.fields
    assert "reader context and saved state cache contracts differ" in str(err.value)
    assert "keys and queries would turn at different frequencies" in str(err.value)
    assert target.positions() == (-1, -1)  # nothing was restored


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_state_is_refused_and_the_context_keeps_its_own_sequence(f32_engine, stream, tmp_path, damage):
    writer = StateContext(f32_engine)
    writer.prefill(stream[:N])
    path = tmp_path / "s"
    save_state(writer, path, stream[:N])
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        del data[-100:]
    else:
        data[-100] ^= 0x40
    path.write_bytes(bytes(data))
    target = StateContext(f32_engine)
    target.prefill(stream[:5])  # a sequence of its own, at positions 0..4
    before = get_seq_state(target)
    with pytest.raises(PayloadError, match="truncated" if damage == "truncate" else "sha256"):
        load_state(target, path, stream[:N])
    assert target.positions() == (0, 4) and get_seq_state(target) == before


def test_state_size_is_within_the_bound_read_files_are_held_to(f32_engine, stream):
    writer = StateContext(f32_engine)
    writer.prefill(stream[:N])
    size = len(get_seq_state(writer))
    kv = 2 * f32_engine.config.num_layers * f32_engine.config.num_kv_heads * f32_engine.config.head_dim * 4 * N
    assert kv < size <= state_bound(writer.contract, N)


def test_raw_llama_cpp_restores_under_another_rope_base_without_a_word(f32_engine, stream):
    """What llama.cpp does (measured): llama_state_seq_set_data reads every byte into a context with
    rope_freq_base 20000 (the model's is 100000), and the decode there is off its own full forward."""
    c = check_transfer(f32_engine, None, stream, N, STEPS, reader_rope=BASE_20K, checked=False)
    assert c.accepted_bytes == c.state_bytes  # accepted, all of it
    assert not c.passed
    # measured at N=64: max |dlogit| vs the correct restore 10.4 and 6.1, vs its own full forward 0.29 and
    # 0.20 scale-aware (the control restore: 0 and 7e-7)
    assert all(s.vs_writer > 1.0 for s in c.steps)
    assert all(s.vs_self > 5e-2 for s in c.steps)


def test_raw_session_file_pair_accepts_another_rope_base_too(f32_engine, stream, tmp_path):
    writer = StateContext(f32_engine)
    writer.prefill(stream[:N])
    assert save_seq_file(writer, tmp_path / "seq.bin", stream[:N]) > 0
    target = StateContext(f32_engine, rope=BASE_20K)
    rc, read = load_seq_file(target, tmp_path / "seq.bin", N)
    assert rc > 0 and read == stream[:N] and target.positions() == (0, N - 1)
    # and the same bytes through set_data are refused by nothing either
    assert set_seq_state(StateContext(f32_engine, rope=BASE_20K), get_seq_state(writer)) > 0


def test_cli_refuses_a_restore_into_another_base_with_exit_3(capsys):
    from ropekv.cli.main import main

    code = main(["handoff", "--engine", "llamacpp", "--llamacpp-reader-rope-freq-base", "20000"])
    (line,) = capsys.readouterr().err.strip().splitlines()  # one line, no traceback
    assert code == 3
    assert line.startswith("ropekv: error: ") and "rope.theta: reader context=20000.0, saved state=100000.0" in line
