"""ropekv's llama.cpp state file and the RoPE arguments of a llama.cpp graph, without llama.cpp.

The file is read believing nothing early: every test below damages one part of a written file and
expects a typed error naming it; the contract check runs before the state bytes are read. The RoPE
arguments are packed here as ggml packs them (``ggml_rope_impl``: int32 words, floats memcpy'd in).
"""

from __future__ import annotations

import json
import math
import struct
import types

import pytest

from ropekv.adapters.llamacpp.rope_params import RopeOverrides, RopeRun
from ropekv.adapters.llamacpp.state_file import MAGIC, read_state_file, write_state_file
from ropekv.contract import CacheContract
from ropekv.errors import ConfigError, ContractMismatch, PayloadError, UsageError
from ropekv.rope import RopeSpec

ROPE = RopeSpec(head_dim=64, rotary_dim=64, theta=100000.0, layout="gptj", max_position_embeddings=8192)
CONTRACT = CacheContract(key_form="rotated", rope=ROPE, num_layers=2, num_kv_heads=1, head_dim=64, block_size=1)
STATE = bytes(range(256)) * 3


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "seq.state"
    write_state_file(path, CONTRACT, [5, 6, 7], 0, STATE, {"engine": "test"})
    return path


def test_round_trip_keeps_contract_tokens_positions_and_bytes(saved):
    header, state = read_state_file(saved)
    assert state == STATE
    assert header.contract == CONTRACT and header.tokens == (5, 6, 7) and header.positions == (0, 2)
    assert saved.stat().st_size == len(MAGIC) + 4 + struct.unpack("<I", saved.read_bytes()[8:12])[0] + len(STATE)


def test_accept_refuses_before_the_state_is_read(saved):
    seen = []

    def accept(header):
        seen.append(header.contract)
        CONTRACT.replace(rope=ROPE.replace(theta=20000.0)).require_compatible(header.contract)

    with pytest.raises(ContractMismatch) as err:
        read_state_file(saved, accept)
    assert err.value.fields == ("rope.theta",) and seen == [CONTRACT]


def _damaged(path, edit):
    data = bytearray(path.read_bytes())
    edit(data)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.__delitem__(slice(len(d) - 1, None)), "truncated"),  # last state byte lost
        (lambda d: d.__delitem__(slice(20, None)), "header of"),  # cut inside the header
        (lambda d: d.__delitem__(slice(6, None)), "shorter than"),
        (lambda d: d.__setitem__(len(d) - 5, d[len(d) - 5] ^ 1), "sha256"),  # one state bit flipped
        (lambda d: d.__setitem__(0, ord("X")), "magic"),
        (lambda d: d.__setitem__(slice(8, 12), struct.pack("<I", 2**31)), "header of"),
        (lambda d: d.extend(b"\0"), "truncated or corrupt"),  # a byte appended
    ],
)
def test_damaged_files_are_payload_errors(saved, edit, words):
    with pytest.raises(PayloadError, match=words):
        read_state_file(_damaged(saved, edit))


def _rewrite_header(path, change):
    data = path.read_bytes()
    n = struct.unpack("<I", data[8:12])[0]
    doc = json.loads(data[12 : 12 + n])
    change(doc)
    blob = json.dumps(doc).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(blob)) + blob + data[12 + n :])
    return path


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: d.pop("writer"), "exactly"),
        (lambda d: d.update(extra=1), "exactly"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(tokens=[]), "tokens"),
        (lambda d: d.update(tokens=[1, -2]), "tokens"),
        (lambda d: d.update(tokens=[1, True]), "tokens"),
        (lambda d: d.update(first_position=-1), "first_position"),
        (lambda d: d.update(state_bytes=10), "declares 10"),
        (lambda d: d.update(state_sha256="00"), "sha256"),
        (lambda d: d["contract"].update(key_form="sideways"), "contract is malformed"),
    ],
)
def test_bad_headers_are_payload_errors(saved, change, words):
    with pytest.raises(PayloadError, match=words):
        read_state_file(_rewrite_header(saved, change))


def test_not_a_regular_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="not a regular file"):
        read_state_file(tmp_path)


def _op_params(n_dims, mode, n_ctx_orig, *floats):
    words = struct.unpack("<6i", struct.pack("<6f", *floats))
    return [0, n_dims, mode, 0, n_ctx_orig, *words, 0, 0, 0, 0, 0]


def test_rope_run_maps_llama_cpp_arguments_to_rope_specs():
    plain = RopeRun.from_op_params(_op_params(64, 0, 8192, 100000.0, 1.0, 0.0, 1.0, 32.0, 1.0))
    assert plain.spec(ROPE) == ROPE  # the model's own RoPE, interleaved pairs
    linear = RopeRun.from_op_params(_op_params(64, 0, 8192, 20000.0, 0.5, 0.0, 1.0, 32.0, 1.0)).spec(ROPE)
    assert linear.theta == 20000.0 and linear.scaling.rope_type == "linear" and linear.scaling.factor == 2.0
    # llama.cpp hands ggml attn_factor / (1 + 0.1 ln s) for YaRN, ggml multiplies it back in (rope_yarn)
    attn = 1.0 / (1.0 + 0.1 * math.log(4.0))
    yarn = RopeRun.from_op_params(_op_params(64, 0, 2048, 100000.0, 0.25, 1.0, attn, 32.0, 1.0)).spec(ROPE)
    assert yarn.scaling.rope_type == "yarn" and yarn.scaling.factor == 4.0
    assert yarn.scaling.original_max_position_embeddings == 2048 and yarn.attention_factor == pytest.approx(1.0)
    assert (
        RopeRun.from_op_params(_op_params(64, 2, 8192, 100000.0, 1.0, 0.0, 1.0, 32.0, 1.0)).spec(ROPE).layout == "neox"
    )
    with pytest.raises(ConfigError, match="ext_factor"):
        RopeRun.from_op_params(_op_params(64, 0, 8192, 100000.0, 0.5, 0.5, 1.0, 32.0, 1.0)).spec(ROPE)
    with pytest.raises(ConfigError, match="rotates 32 channels"):
        RopeRun.from_op_params(_op_params(32, 0, 8192, 100000.0, 1.0, 0.0, 1.0, 32.0, 1.0)).spec(ROPE)


def test_rope_overrides_are_bounded_and_set_only_what_is_given():
    p = types.SimpleNamespace(rope_freq_base=0.0, rope_freq_scale=0.0, rope_scaling_type=-1, yarn_orig_ctx=0)
    RopeOverrides(freq_base=20000.0, scaling_type="yarn").apply(p)
    assert (p.rope_freq_base, p.rope_freq_scale, p.rope_scaling_type, p.yarn_orig_ctx) == (20000.0, 0.0, 2, 0)
    assert RopeOverrides(freq_base=20000.0).label() == "rope_freq_base=20000"
    assert RopeOverrides().label() == "model defaults"
    for bad in ({"freq_base": 0.5}, {"freq_scale": math.inf}, {"yarn_orig_ctx": 0}, {"scaling_type": "ntk"}):
        with pytest.raises(UsageError):
            RopeOverrides(**bad)


def _handoff_parser():
    import argparse

    from ropekv.adapters.llamacpp import handoff

    parser = argparse.ArgumentParser()
    handoff.add_arguments(parser.add_argument_group("llama.cpp handoff"))
    return parser, handoff


def test_handoff_flags_give_each_side_its_rope_settings():
    parser, handoff = _handoff_parser()
    args = parser.parse_args(
        [
            "--llamacpp-reader-rope-freq-base",
            "20000",
            "--llamacpp-writer-rope-scaling",
            "yarn",
            "--llamacpp-writer-rope-freq-scale",
            "0.25",
            "--llamacpp-writer-yarn-orig-ctx",
            "2048",
        ]
    )
    assert handoff.rope_from_args(args, "reader") == RopeOverrides(freq_base=20000.0)
    assert handoff.rope_from_args(args, "writer") == RopeOverrides(
        freq_scale=0.25, scaling_type="yarn", yarn_orig_ctx=2048
    )
    assert args.llamacpp_prompt_tokens == 64 and args.llamacpp_decode_steps == 3 and not args.llamacpp_unchecked


@pytest.mark.parametrize(
    "argv",
    [
        ["--llamacpp-reader-rope-freq-base", "1e30"],
        ["--llamacpp-reader-rope-freq-scale", "nan"],
        ["--llamacpp-writer-rope-scaling", "ntk"],
        ["--llamacpp-prompt-tokens", "0"],
        ["--llamacpp-decode-steps", "100000"],
    ],
)
def test_handoff_flags_are_bounded(argv, capsys):
    parser, _ = _handoff_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
