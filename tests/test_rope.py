"""ropekv.rope against transformers' ROPE_INIT_FUNCTIONS, and the algebra of rotations.

transformers computes frequencies in float32, ropekv in float64. Each case is checked twice:

- against transformers' own code run in float64 (its module-level ``torch`` swapped for a proxy whose
  ``float``/``float32`` mean float64, and ``Tensor.float`` meaning ``double``, during the call), to
  1e-10 relative: the same algorithm, exactly;
- against transformers as shipped (float32), to 1e-6 relative, or to twice transformers' own float32
  error where that is larger: yarn's ramp and llama3's smoothing subtract nearly equal float32 numbers
  near a band edge, and transformers' float32 result is then a few 1e-6 off its own float64 result.

Attention factors are plain Python floats on both sides and must agree to 1e-12.
"""

from __future__ import annotations

import math
import types
from typing import Any
from unittest import mock

import pytest
import torch
import transformers  # a test dependency (scripts/setup.sh): missing, the suite fails
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, modeling_rope_utils
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ropekv.errors import ConfigError
from ropekv.models.rope_config import rope_from_hf_config
from ropekv.rope import RopeScaling, RopeSpec, layout_permutation

transformers.logging.set_verbosity_error()  # HF warns about unusual but valid random configs

HF_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REL_TOL = 1e-6

# head_dim x partial_rotary_factor always gives an even rotary_dim, as real models do.
head_dims = st.sampled_from([16, 32, 64, 80, 96, 128])
partials = st.sampled_from([1.0, 1.0, 0.5, 0.25, 0.75])
thetas = st.one_of(st.sampled_from([10000.0, 500000.0, 1000000.0]), st.floats(100.0, 2e6))
max_positions = st.integers(64, 32768)
optional_attention_factor = st.one_of(st.none(), st.floats(0.5, 2.0))


def hf_config(head_dim: int, partial: float, theta: float, max_pos: int, rope: dict[str, Any]) -> LlamaConfig:
    params = {k: v for k, v in {**rope, "rope_theta": theta}.items() if v is not None}
    return LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
        **({"partial_rotary_factor": partial} if partial != 1.0 else {}),
    )


def ours(config: LlamaConfig) -> RopeSpec:
    return rope_from_hf_config(config.to_dict())


class _Float64Torch(types.ModuleType):
    """``torch`` as seen by transformers' RoPE functions, with float32 meaning float64."""

    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def hf_rope(config: LlamaConfig, seq_len: int | None, float64: bool = False) -> tuple[torch.Tensor, float]:
    """transformers' ``(inv_freq, attention_factor)``, optionally with its arithmetic in float64."""
    fn = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]]
    if not float64:
        return fn(config, None, seq_len=seq_len)
    # longrope also calls ``Tensor.float()``; patched only for the duration of this call.
    with (
        mock.patch.object(modeling_rope_utils, "torch", _Float64Torch("torch")),
        mock.patch.object(torch.Tensor, "float", torch.Tensor.double),
    ):
        inv_freq, factor = fn(config, None, seq_len=seq_len)
    assert inv_freq.dtype == torch.float64
    return inv_freq, factor


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs() / b.abs()).max().item()


def assert_freqs_match(spec: RopeSpec, config: LlamaConfig, seq_len: int | None) -> None:
    rope_type = config.rope_parameters["rope_type"]
    theirs32, their_factor = hf_rope(config, seq_len)
    theirs64, their_factor64 = hf_rope(config, seq_len, float64=True)
    mine = spec.inv_freq(seq_len)
    assert mine.dtype == torch.float64
    assert mine.shape == theirs32.shape, (mine.shape, theirs32.shape)
    rel64 = max_rel(mine, theirs64)
    assert rel64 <= 1e-10, f"{rope_type} seq_len={seq_len}: inv_freq rel err {rel64:.2e} vs float64 transformers"
    rel32 = max_rel(mine, theirs32)
    tol32 = max(REL_TOL, 2 * max_rel(theirs64, theirs32))
    assert rel32 <= tol32, f"{rope_type} seq_len={seq_len}: inv_freq rel err {rel32:.2e} vs transformers"
    assert their_factor == their_factor64
    assert spec.attention_factor == pytest.approx(their_factor, rel=1e-12, abs=0)


# ---------------------------------------------------------------------- against transformers


@HF_SETTINGS
@given(head_dim=head_dims, partial=partials, theta=thetas, max_pos=max_positions)
def test_default_matches_transformers(head_dim, partial, theta, max_pos):
    config = hf_config(head_dim, partial, theta, max_pos, {"rope_type": "default"})
    spec = ours(config)
    if partial == 1.0:
        theirs, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:  # llama's default ignores partial rotary; linear with factor 1 is the base formula with it
        linear = hf_config(head_dim, partial, theta, max_pos, {"rope_type": "linear", "factor": 1.0})
        theirs, factor = ROPE_INIT_FUNCTIONS["linear"](linear, None)
    rel = ((spec.inv_freq() - theirs.double()).abs() / theirs.double()).max().item()
    assert rel <= REL_TOL
    assert spec.rotary_dim == int(head_dim * partial)
    assert spec.attention_factor == factor == 1.0
    assert not spec.length_dependent


@HF_SETTINGS
@given(
    head_dim=head_dims,
    partial=partials,
    theta=thetas,
    max_pos=max_positions,
    factor=st.floats(1.0, 32.0),
    attention_factor=optional_attention_factor,
)
def test_linear_matches_transformers(head_dim, partial, theta, max_pos, factor, attention_factor):
    # An attention_factor on a type that does not use it is ignored by transformers (with a warning).
    rope = {"rope_type": "linear", "factor": factor, "attention_factor": attention_factor}
    config = hf_config(head_dim, partial, theta, max_pos, rope)
    assert_freqs_match(ours(config), config, None)


@HF_SETTINGS
@given(
    head_dim=head_dims,
    partial=partials,
    theta=thetas,
    max_pos=max_positions,
    factor=st.floats(1.0, 16.0),
    extra=st.integers(1, 100000),
)
def test_dynamic_matches_transformers_at_every_length(head_dim, partial, theta, max_pos, factor, extra):
    config = hf_config(head_dim, partial, theta, max_pos, {"rope_type": "dynamic", "factor": factor})
    spec = ours(config)
    assert spec.length_dependent
    for seq_len in (None, 1, max_pos - 1, max_pos, max_pos + 1, max_pos + extra):
        assert_freqs_match(spec, config, seq_len)
    # At or below the original length dynamic NTK is the plain base formula.
    base = spec.replace(scaling=RopeScaling()).inv_freq()
    torch.testing.assert_close(spec.inv_freq(max_pos), base, rtol=1e-12, atol=0)
    assert not torch.allclose(spec.inv_freq(max_pos + extra), base) or factor == 1.0


@HF_SETTINGS
@given(
    head_dim=head_dims,
    partial=partials,
    theta=thetas,
    max_pos=max_positions,
    factor=st.floats(1.0, 40.0),
    orig_frac=st.floats(0.05, 1.0),
    mscale=st.one_of(st.none(), st.floats(0.1, 2.0)),
    mscale_all_dim=st.one_of(st.none(), st.floats(0.1, 2.0)),
    beta_fast=st.one_of(st.none(), st.floats(8.0, 64.0)),
    beta_slow=st.one_of(st.none(), st.floats(0.25, 4.0)),
    truncate=st.one_of(st.none(), st.booleans()),
    attention_factor=optional_attention_factor,
)
def test_yarn_matches_transformers(
    head_dim,
    partial,
    theta,
    max_pos,
    factor,
    orig_frac,
    mscale,
    mscale_all_dim,
    beta_fast,
    beta_slow,
    truncate,
    attention_factor,
):
    rope = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": max(1, int(max_pos * orig_frac)),
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
        "beta_fast": beta_fast,
        "beta_slow": beta_slow,
        "truncate": truncate,
        "attention_factor": attention_factor,
    }
    config = hf_config(head_dim, partial, theta, max_pos, rope)
    spec = ours(config)
    assert_freqs_match(spec, config, None)
    assert_freqs_match(spec, config, 10 * max_pos)  # yarn does not depend on the length
    assert not spec.length_dependent


@HF_SETTINGS
@given(
    head_dim=head_dims,
    partial=partials,
    theta=thetas,
    max_pos=max_positions,
    factor=st.floats(1.0, 32.0),
    low=st.floats(0.25, 4.0),
    gap=st.floats(0.5, 8.0),
    orig_frac=st.floats(0.05, 1.0),
    attention_factor=optional_attention_factor,
)
def test_llama3_matches_transformers(head_dim, partial, theta, max_pos, factor, low, gap, orig_frac, attention_factor):
    rope = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": low + gap,
        "original_max_position_embeddings": max(1, int(max_pos * orig_frac)),
        "attention_factor": attention_factor,
    }
    config = hf_config(head_dim, partial, theta, max_pos, rope)
    assert_freqs_match(ours(config), config, None)


def test_llama31_reference_values():
    """Llama 3.1's published RoPE (theta 5e5, factor 8, 1/4, 8192) at head_dim 128."""
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = hf_config(128, 1.0, 500000.0, 131072, rope)
    assert_freqs_match(ours(config), config, None)


@HF_SETTINGS
@given(
    head_dim=head_dims,
    partial=partials,
    theta=thetas,
    max_pos=max_positions,
    orig_frac=st.floats(0.05, 1.0),
    data=st.data(),
    with_factor=st.booleans(),
    attention_factor=optional_attention_factor,
)
def test_longrope_matches_transformers_short_and_long(
    head_dim, partial, theta, max_pos, orig_frac, data, with_factor, attention_factor
):
    n = int(head_dim * partial) // 2
    factors = st.lists(st.floats(0.5, 64.0), min_size=n, max_size=n)
    orig = max(1, int(max_pos * orig_frac))
    rope = {
        "rope_type": "longrope",
        "short_factor": data.draw(factors),
        "long_factor": data.draw(factors),
        "original_max_position_embeddings": orig,
        "attention_factor": attention_factor,
        "factor": data.draw(st.floats(1.0, 64.0)) if with_factor else None,
    }
    config = hf_config(head_dim, partial, theta, max_pos, rope)
    spec = ours(config)
    assert spec.length_dependent
    for seq_len in (None, 1, orig, orig + 1, 4 * orig + 3):
        assert_freqs_match(spec, config, seq_len)
    if rope["short_factor"] != rope["long_factor"]:
        assert not torch.equal(spec.inv_freq(orig), spec.inv_freq(orig + 1))


# ---------------------------------------------------------------------- algebra of rotations


def spec_of(rope_type: str, head_dim: int = 32, rotary_dim: int | None = None, layout: str = "neox") -> RopeSpec:
    rotary_dim = rotary_dim or head_dim
    n = rotary_dim // 2
    scaling = {
        "default": {},
        "linear": {"factor": 4.0},
        "dynamic": {"factor": 2.0},
        "yarn": {"factor": 8.0, "original_max_position_embeddings": 64},
        "llama3": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "longrope": {
            "short_factor": [1.0 + 0.1 * i for i in range(n)],
            "long_factor": [2.0 + 0.3 * i for i in range(n)],
            "original_max_position_embeddings": 64,
        },
    }[rope_type]
    return RopeSpec(
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        theta=10000.0,
        layout=layout,
        scaling=RopeScaling(rope_type=rope_type, **scaling),
        attention_factor=1.3 if rope_type in ("yarn", "longrope") else 1.0,
        max_position_embeddings=256,
    )


ALL_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rand(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("rope_type", ALL_TYPES)
def test_unrotate_inverts_rotate(rope_type, layout):
    spec = spec_of(rope_type, rotary_dim=24, layout=layout)
    x = rand(2, 7, 3, 32)  # [batch, T, H, D]
    positions = torch.tensor([0, 1, 5, 63, 64, 300, 9999])
    for seq_len in (None, 10, 1000):
        back = spec.unrotate(spec.rotate(x, positions, seq_len), positions, seq_len)
        torch.testing.assert_close(back, x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_rotations_compose(rope_type, layout):
    spec = spec_of(rope_type, layout=layout)
    x = rand(6, 2, 32)
    a = torch.tensor([0, 1, 2, 17, 100, 4000])
    b = torch.tensor([5, 0, 31, 17, 1, 123])
    torch.testing.assert_close(spec.rotate(spec.rotate(x, a), b), spec.rotate(x, a + b), rtol=0, atol=1e-10)
    torch.testing.assert_close(spec.rotate(x, torch.zeros(6, dtype=torch.long)), x, rtol=0, atol=0)


@pytest.mark.parametrize("rotary_dim", [8, 32])
@pytest.mark.parametrize("rope_type", ALL_TYPES)
def test_neox_and_gptj_agree_after_layout_permutation(rope_type, rotary_dim):
    neox, gptj = spec_of(rope_type, rotary_dim=rotary_dim), spec_of(rope_type, rotary_dim=rotary_dim, layout="gptj")
    perm = layout_permutation(rotary_dim, 32, "neox", "gptj")  # x_gptj = x_neox[..., perm]
    assert sorted(perm.tolist()) == list(range(32))
    x = rand(5, 4, 32)
    positions = torch.tensor([3, 0, 77, 1000, 12])
    torch.testing.assert_close(
        gptj.rotate(x[..., perm], positions, 500), neox.rotate(x, positions, 500)[..., perm], rtol=0, atol=1e-12
    )
    back = layout_permutation(rotary_dim, 32, "gptj", "neox")
    torch.testing.assert_close(x[..., perm][..., back], x, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_partial_rotary_leaves_tail_untouched(layout):
    spec = spec_of("default", head_dim=32, rotary_dim=8, layout=layout)
    x = rand(4, 2, 32, dtype=torch.float32)
    y = spec.rotate(x, torch.tensor([1, 2, 3, 500]))
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert not torch.allclose(y[..., :8], x[..., :8])


def test_bfloat16_input_rotates_with_float64_angles():
    """At position 8000 a bf16 angle is off by radians; a float64 one matches to bf16 rounding."""
    spec = spec_of("default", head_dim=64)
    x = rand(1, 4, 64, dtype=torch.bfloat16, seed=3)
    positions = torch.tensor([8000])
    got = spec.rotate(x, positions)
    assert got.dtype == torch.bfloat16
    want = spec.rotate(x.double(), positions).to(torch.bfloat16)
    torch.testing.assert_close(got, want)  # bf16 tolerances
    # The angle bf16 would give is visibly wrong: the test above can tell.
    bf16_angles = (positions.to(torch.bfloat16)[:, None] * spec.inv_freq().to(torch.bfloat16)[None]).double()
    assert (bf16_angles - spec.angles(positions)).abs().max() > 1.0


def test_float32_input_at_large_positions_matches_float64():
    """float32 angles at position 1e5 are ~1e-2 rad off; ropekv's float64 angles are not."""
    spec = spec_of("default", head_dim=64)
    x = rand(3, 4, 64, seed=5)
    positions = torch.tensor([8000, 65535, 100000])
    torch.testing.assert_close(spec.rotate(x.float(), positions), spec.rotate(x, positions).float(), rtol=0, atol=2e-5)


def test_rotation_scales_by_attention_factor():
    spec = spec_of("yarn")
    x = rand(3, 2, 32)
    y = spec.rotate(x, torch.tensor([0, 5, 900]))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1) * spec.attention_factor, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------- parsing configs

BASE = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 4096}


def test_legacy_rope_theta_and_rope_scaling():
    spec = rope_from_hf_config({**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4}})
    assert (spec.theta, spec.scaling.rope_type, spec.scaling.factor) == (500000.0, "linear", 4.0)
    spec = rope_from_hf_config(
        {
            **BASE,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        }
    )
    assert spec.scaling.rope_type == "llama3" and spec.scaling.original_max_position_embeddings == 1024
    spec = rope_from_hf_config({**BASE, "rope_scaling": None, "partial_rotary_factor": 0.5})
    assert (spec.theta, spec.rotary_dim, spec.scaling.rope_type) == (10000.0, 8, "default")
    # yarn without original_max_position_embeddings falls back to max_position_embeddings
    spec = rope_from_hf_config({**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert spec.scaling.original_max_position_embeddings == 4096


def test_legacy_and_new_forms_agree():
    legacy = rope_from_hf_config({**BASE, "rope_theta": 1e6, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    new = rope_from_hf_config({**BASE, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}})
    assert legacy == new and legacy.fingerprint() == new.fingerprint()


def test_nested_per_layer_type_rope_parameters():
    nested = {
        **BASE,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    full = rope_from_hf_config(nested, layer_type="full_attention")
    sliding = rope_from_hf_config(nested, layer_type="sliding_attention")
    assert (full.scaling.rope_type, full.theta) == ("linear", 1e6)
    assert (sliding.scaling.rope_type, sliding.theta) == ("default", 1e4)
    with pytest.raises(ConfigError, match="layer type"):
        rope_from_hf_config(nested)
    with pytest.raises(ConfigError, match="chunked_attention"):
        rope_from_hf_config(nested, layer_type="chunked_attention")
    same = {
        **BASE,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    assert rope_from_hf_config(same).theta == 1e4


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "ntk-by-parts", "factor": 2.0},
        {"type": "su", "short_factor": [1.0]},
    ],
)
def test_unknown_type_names_it(rope):
    name = rope.get("rope_type", rope.get("type"))
    with pytest.raises(ConfigError, match=name):
        rope_from_hf_config({**BASE, "rope_parameters": rope})


@pytest.mark.parametrize(
    "rope,missing",
    [
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "dynamic"}, "factor"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
        ({"rope_type": "longrope", "long_factor": [1.0] * 8}, "short_factor"),
    ],
)
def test_missing_parameter_names_it(rope, missing):
    with pytest.raises(ConfigError, match=missing):
        rope_from_hf_config({**BASE, "rope_parameters": rope})


def test_bad_values_raise_config_error():
    with pytest.raises(ConfigError, match="short_factor"):
        rope_from_hf_config(
            {**BASE, "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}}
        )
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        rope_from_hf_config({"hidden_size": 64, "num_attention_heads": 4})
    with pytest.raises(ConfigError, match="factor"):
        rope_from_hf_config({**BASE, "rope_parameters": {"rope_type": "linear", "factor": -1.0}})
    with pytest.raises(ConfigError, match="layout"):
        rope_from_hf_config(BASE, layout="interleaved")
    with pytest.raises(ConfigError, match="bogus"):
        rope_from_hf_config({**BASE, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "bogus": 1}})


def test_fingerprint_stable_and_sensitive():
    spec = spec_of("yarn")
    assert spec.fingerprint() == spec_of("yarn").fingerprint()
    assert RopeSpec.from_dict(spec.to_dict()) == spec
    assert RopeSpec.from_dict(spec.to_dict()).fingerprint() == spec.fingerprint()
    variants = [
        spec.replace(theta=20000.0),
        spec.replace(layout="gptj"),
        spec.replace(scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64)),
        spec.replace(scaling=RopeScaling("yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=16.0)),
        spec.replace(attention_factor=1.0),
        spec.replace(rotary_dim=16),
        spec_of("linear"),
    ]
    prints = {spec.fingerprint()} | {v.fingerprint() for v in variants}
    assert len(prints) == len(variants) + 1
    assert all(len(p) == 16 for p in prints)


def test_attention_factor_defaults_follow_transformers():
    yarn = rope_from_hf_config(
        {**BASE, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    )
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
