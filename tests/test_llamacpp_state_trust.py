"""What a llama.cpp state file cannot make ropekv believe, without llama.cpp: the tokens its header
lists must be the reader's, and a restore under the writer's contract is judged against the writer
bit for bit (a faithful restore decodes exactly the writer's logits)."""

from __future__ import annotations

import types

import pytest

from ropekv.adapters.llamacpp import state
from ropekv.adapters.llamacpp.state_check import StepResult, steps_pass
from ropekv.adapters.llamacpp.state_file import write_state_file
from ropekv.contract import CacheContract
from ropekv.errors import PayloadError
from ropekv.rope import RopeSpec

ROPE = RopeSpec(head_dim=64, rotary_dim=64, theta=100000.0, layout="gptj", max_position_embeddings=8192)
CONTRACT = CacheContract(key_form="rotated", rope=ROPE, num_layers=2, num_kv_heads=1, head_dim=64, block_size=1)
STATE = bytes(range(256)) * 3


@pytest.fixture
def reader(monkeypatch):
    """A reader context as load_state sees it; llama.cpp's set_data recorded instead of called."""
    restored: list[bytes] = []

    def set_seq_state(sc, data):
        restored.append(data)
        return len(data)

    monkeypatch.setattr(state, "set_seq_state", set_seq_state)
    sc = types.SimpleNamespace(contract=CONTRACT, n_ctx=64, positions=lambda: (0, 2), restored=restored)
    return sc


def test_load_state_restores_the_tokens_the_reader_expects(reader, tmp_path):
    path = tmp_path / "seq.state"
    write_state_file(path, CONTRACT, [5, 6, 7], 0, STATE, {"engine": "test"})
    header = state.load_state(reader, path, [5, 6, 7])
    assert header.tokens == (5, 6, 7) and reader.restored == [STATE]


@pytest.mark.parametrize(
    "saved, words",
    [([5, 9, 7], "token 1 is 9, expected 6"), ([5, 6], "holds 2 tokens, 3 were expected")],
)
def test_load_state_refuses_a_file_of_other_tokens_before_touching_the_reader(reader, tmp_path, saved, words):
    path = tmp_path / "seq.state"
    write_state_file(path, CONTRACT, saved, 0, STATE, {"engine": "test"})
    with pytest.raises(PayloadError, match=words):
        state.load_state(reader, path, [5, 6, 7])
    assert reader.restored == [], "nothing reached llama.cpp"


def _step(vs_writer: float) -> StepResult:
    return StepResult(
        position=64, vs_reference=4e-7, vs_self=5e-7, vs_writer=vs_writer, logprob_change=0.0, same_top_token=True
    )


def test_a_restore_under_the_writers_contract_must_decode_the_writers_logits_exactly():
    # 0.083: what 32 flipped key bytes with the sha256 recomputed did to the restored decode, while the
    # float64 and own-forward columns stayed within the tolerance
    assert steps_pass([_step(0.0), _step(0.0)], 5e-3, writer_equal=True)
    assert not steps_pass([_step(0.0), _step(0.083)], 5e-3, writer_equal=True)
    assert not steps_pass([_step(float("nan"))], 5e-3, writer_equal=True)
    # under another contract the writer's logits are another computation: finite is all that is asked
    assert steps_pass([_step(0.083)], 5e-3, writer_equal=False)
    assert not steps_pass([_step(float("inf"))], 5e-3, writer_equal=False)
