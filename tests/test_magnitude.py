"""RoPE magnitude: YaRN's attention factor dropped or applied twice (the angles right, the length not).

Independent references: the attention factor is hand-derived (``0.1 ln(4) + 1`` for YaRN factor 4) and
checked against transformers' own rotary embedding (``attention_scaling``); the engine's outputs are
compared with the float64 reference decoder; the synthetic rows are rotated in float64 by
:meth:`ropekv.rope.RopeSpec.rotate` and scaled by known factors.
"""

from __future__ import annotations

import math

import forensic_rows
import pytest
import torch

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.registry import FAULTS
from ropekv.bugs.rope_magnitude import yarn_variant
from ropekv.contract import CacheContract
from ropekv.errors import ContractMismatch
from ropekv.models import load_checkpoint
from ropekv.parity.bug_class import BugClass
from ropekv.parity.cases import Case
from ropekv.parity.protocol import Tier
from ropekv.rope import RopeScaling, RopeSpec
from ropekv.testing.tiers import at_tier

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
A = 0.1 * math.log(4.0) + 1.0  # transformers' get_mscale(4): 1.1386
FAULT_NAMES = ("yarn-attention-factor-dropped", "yarn-attention-factor-twice")
TIMES = {"yarn-attention-factor-dropped": 0, "yarn-attention-factor-twice": 2}
CASES = [Case(length=17, block_size=7, decode_steps=2)]


@pytest.fixture(scope="module")
def yarn_dir(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama", rope_parameters=YARN)


@pytest.fixture(scope="module")
def yarn(yarn_dir):
    return load_checkpoint(yarn_dir)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


# ---------------------------------------------------------------------- the contract carries the factor


def test_the_yarn_checkpoint_has_transformers_attention_factor_on_every_layer(yarn, yarn_dir, hf_model):
    assert hf_model(yarn_dir).model.rotary_emb.attention_scaling == pytest.approx(A, rel=1e-12)
    contract = CacheContract.for_model(yarn.config, key_form="rotated")
    for i in range(contract.num_layers):
        assert contract.layer_rope(i).attention_factor == pytest.approx(A, rel=1e-12)


def test_contracts_differing_only_in_the_attention_factor_are_refused(yarn):
    ours = CacheContract.for_model(yarn.config, key_form="rotated")
    theirs = ours.replace(rope=ours.rope.replace(attention_factor=1.0))
    with pytest.raises(ContractMismatch) as info:
        ours.require_compatible(theirs, ours="decode", theirs="prefill")
    assert info.value.fields == ("rope.attention_factor",)
    assert "attention factor" in str(info.value) and "1.1386" in str(info.value)
    assert ours.fingerprint() != theirs.fingerprint()


def test_one_layers_attention_factor_is_named_with_its_layer(yarn):
    ours = CacheContract.for_model(yarn.config, key_form="rotated")
    rope = ours.rope
    theirs = ours.replace(layer_ropes=(rope, rope.replace(attention_factor=A * A)))  # layer 1 scaled twice
    with pytest.raises(ContractMismatch) as info:
        ours.require_compatible(theirs)
    assert "layers.1.rope.attention_factor" in info.value.fields
    assert not any(f.startswith("layers.0.") for f in info.value.fields)
    assert "on layer 1: cos/sin would be scaled by another attention factor" in str(info.value)


def test_yarn_variant_gives_default_models_the_attention_factor(llama, yarn):
    variant = yarn_variant(llama).config.rope
    assert variant.scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64)
    assert variant.attention_factor == pytest.approx(A, rel=1e-12)
    # a model that already scales keeps its own RoPE
    assert FAULTS["yarn-attention-factor-dropped"].model(yarn) is yarn


# ---------------------------------------------------------------------- the faults, caught and named


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_a_correct_yarn_engine_passes(yarn, key_form, dtype):
    report = check(NativeAdapter(yarn, key_form=key_form, dtype=dtype), cases=CASES)
    assert report.passed, report.table()


@pytest.mark.parametrize("name", FAULT_NAMES)
def test_each_fault_is_caught_at_the_logits_and_attention_tiers(llama, name):
    faulty = FAULTS[name].adapter(llama)
    logits = check(at_tier(faulty, Tier.LOGITS), cases=CASES)
    assert not logits.passed and logits.diagnosis is None
    attention = check(at_tier(faulty, Tier.ATTENTION), cases=CASES)
    fd = attention.cases[0].first_divergence
    assert not attention.passed and fd is not None and fd.layer == 0
    assert fd.query_position == 17  # the first decode step: prefill alone is right


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
@pytest.mark.parametrize("name", FAULT_NAMES)
def test_each_fault_is_named_rope_magnitude_with_the_factor(llama, yarn, name, key_form):
    for ckpt in (llama, yarn):  # through yarn_variant, and a model of its own with YaRN
        report = check(FAULTS[name].adapter(ckpt, key_form=key_form), cases=CASES)
        d = report.diagnosis
        assert not report.passed and d is not None and d.kind == BugClass.ROPE_MAGNITUDE, report.table()
        assert "1.1386" in d.evidence and f"applied {TIMES[name]} times instead of once" in d.evidence
        assert forensic_rows.query_position(d) == 17
        expected = A ** (TIMES[name] - 1)  # relative to the contract's A: 1 / A or A
        assert d.details["query_scale"] == pytest.approx(expected, rel=1e-4)
        if key_form == "raw":  # every key is rotated (and scaled) on read at decode
            assert d.details["key_scales"] == [pytest.approx(expected, rel=1e-4)]
        else:  # the prefill's keys are right, the key the decode step wrote is scaled
            assert d.details["key_scales"] == [1.0, pytest.approx(expected, rel=1e-4)]
            assert d.details["scaled_keys"] == 1


def test_an_angle_error_on_a_yarn_model_is_still_a_frequency_mismatch(yarn):
    # L=40: at 17 on head_dim 16 (8 pairs, most interpolated) theta x 4 happens to fit an integer query position
    report = check(FAULTS["scaling-mismatch"].adapter(yarn), cases=[Case(length=40, block_size=16, decode_steps=2)])
    assert not report.passed and report.diagnosis.kind == BugClass.FREQUENCY_MISMATCH, report.diagnosis


@pytest.mark.parametrize("name", ["double-rotation", "decode-position-off-by-one"])
def test_position_faults_on_a_yarn_model_keep_their_names(yarn, name):
    report = check(FAULTS[name].adapter(yarn), cases=CASES)
    assert report.diagnosis.kind == FAULTS[name].kind, report.diagnosis


# ---------------------------------------------------------------------- forensics on synthetic rows

SPEC = RopeSpec(
    head_dim=64,
    rotary_dim=64,
    theta=10000.0,
    scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64),
    attention_factor=A,
    max_position_embeddings=256,
)
PARTIAL = RopeSpec(head_dim=64, rotary_dim=32, theta=100000.0, layout="gptj", attention_factor=A)


def _row(spec: RopeSpec, t: int, *, query: float, new_keys: float, old_keys: float = 1.0, new: int = 1, seed=0):
    """A decode row at ``t`` over keys 0..t: raw vectors rotated in float64 to their positions under
    ``spec``, the query scaled by ``query``, the ``new`` newest keys by ``new_keys``, the rest by ``old_keys``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, spec.head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(t + 1, 2, spec.head_dim, generator=g, dtype=torch.float64)
    pos = torch.arange(t + 1)
    k_eff = spec.rotate(k, pos)
    q_eff = spec.rotate(q[None], torch.tensor([t]))[0]
    rot = slice(spec.rotary_offset, spec.rotary_offset + spec.rotary_dim)  # A only scales the rotated channels
    q_eff[..., rot] *= query
    k_eff[: t + 1 - new, :, rot] *= old_keys
    k_eff[t + 1 - new :, :, rot] *= new_keys
    return q, q_eff, k, k_eff, pos


def _inp(spec, q, q_eff, k, k_eff, pos, t, bf16=False):
    if bf16:
        q_eff, k_eff = q_eff.to(torch.bfloat16).double(), k_eff.to(torch.bfloat16).double()
    return dict(
        spec=spec,
        q=q,
        q_eff=q_eff,
        k=k,
        k_eff=k_eff,
        t=t,
        positions=pos,
        slots=pos.clone(),
        dtype="bfloat16" if bf16 else "float32",
    )


def diagnose(inp: dict):
    return forensic_rows.diagnose(**inp)


@pytest.mark.parametrize("spec", [SPEC, PARTIAL], ids=["yarn-neox", "partial-gptj"])
@pytest.mark.parametrize("bf16", [False, True])
def test_a_dropped_factor_on_the_decode_side_is_named_with_its_figures(spec, bf16):
    t = 40
    row = _row(spec, t, query=1 / A, new_keys=1 / A)  # the decode step built cos/sin without A
    d = diagnose(_inp(spec, *row, t, bf16=bf16))
    assert d.kind == BugClass.ROPE_MAGNITUDE, d.evidence
    assert forensic_rows.query_position(d) == t and forensic_rows.key_positions(d) == tuple(range(t + 1))
    # hand-computed: 1 / 1.1386 = 0.8783; scores 0.8783 against the old keys, 0.8783^2 = 0.7713 the new one
    assert d.details["query_scale"] == pytest.approx(0.87826, abs=2e-3)
    assert d.details["key_scales"] == [1.0, pytest.approx(0.87826, abs=2e-3)]
    assert "x0.87" in d.evidence and "x0.77" in d.evidence and "applied 0 times instead of once" in d.evidence
    assert "40 keys right (positions 0..39)" in d.evidence and "1 key x0.87" in d.evidence


def test_a_factor_applied_twice_everywhere_scales_scores_by_a_squared():
    t = 40
    row = _row(SPEC, t, query=A, new_keys=A, old_keys=A)
    d = diagnose(_inp(SPEC, *row, t))
    assert d.kind == BugClass.ROPE_MAGNITUDE, d.evidence
    assert d.details["query_scale"] == pytest.approx(A, rel=1e-9)
    assert d.details["key_scales"] == [pytest.approx(A, rel=1e-9)]
    # hand-computed: |c| / |r| = A^2 = 1.2965, scores A^2 = 1.2965 beyond the contract's A^2
    assert "|c|/|r| 1.2965" in d.evidence and "scores x1.2965 (A^2)" in d.evidence
    assert "applied 2 times instead of once" in d.evidence


def test_a_scaling_without_a_yarn_factor_is_named_with_its_size():
    spec, t = SPEC.replace(scaling=RopeScaling(), attention_factor=1.0), 30
    row = _row(spec, t, query=1.25, new_keys=1.0)  # a query scaled by 1.25 on a model with no attention factor
    d = diagnose(_inp(spec, *row, t))
    assert d.kind == BugClass.ROPE_MAGNITUDE and "a factor 1.2500 beyond the attention factor 1.0000" in d.evidence


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("spec", [SPEC, PARTIAL], ids=["yarn-neox", "partial-gptj"])
def test_a_correct_yarn_row_is_not_a_magnitude_error(spec, bf16):
    t = 40
    d = diagnose(_inp(spec, *_row(spec, t, query=1.0, new_keys=1.0), t, bf16=bf16))
    assert d.kind == BugClass.UNKNOWN and "sit exactly where the contract puts them" in d.evidence, d.evidence


def test_drifted_hidden_states_are_not_a_magnitude_error():
    # Noise in every direction (5% of each vector) moves lengths a little and directions as much:
    # the residual after the best scale stays comparable to the scale's deviation, so nothing is named.
    t = 40
    q, q_eff, k, k_eff, pos = _row(SPEC, t, query=1.0, new_keys=1.0)
    g = torch.Generator().manual_seed(99)
    q_eff = q_eff + 0.05 * q_eff.norm(dim=-1, keepdim=True) / 8 * torch.randn(
        q_eff.shape, generator=g, dtype=torch.float64
    )
    k_eff = k_eff + 0.05 * k_eff.norm(dim=-1, keepdim=True) / 8 * torch.randn(
        k_eff.shape, generator=g, dtype=torch.float64
    )
    d = diagnose(_inp(SPEC, q, q_eff, k, k_eff, pos, t))
    assert d.kind == BugClass.UNKNOWN and "sit right with a residual" in d.evidence, d.evidence  # lengths examined


def test_an_angle_error_with_the_right_lengths_is_a_frequency_mismatch():
    t, prompt = 120, 110
    q, _, k, k_eff, pos = _row(SPEC, t, query=1.0, new_keys=1.0)
    wrong = SPEC.replace(theta=SPEC.theta * 4)  # the decode side's query and keys at theta x 4, A kept
    k_eff[prompt:] = wrong.rotate(k[prompt:], torch.arange(prompt, t + 1))
    q_eff = wrong.rotate(q[None], torch.tensor([t]))[0]
    d = diagnose(_inp(SPEC, q, q_eff, k, k_eff, pos, t))
    assert d.kind == BugClass.FREQUENCY_MISMATCH, d.evidence


def test_double_rotation_with_a_dropped_factor_is_still_double_rotation():
    t = 40
    q, q_eff, k, _, pos = _row(SPEC, t, query=1.0, new_keys=1.0)
    k_eff = SPEC.replace(attention_factor=1.0).rotate(k, 2 * pos)  # the position bug comes first
    d = diagnose(_inp(SPEC, q, q_eff, k, k_eff, pos, t))
    assert d.kind == BugClass.DOUBLE_ROTATION, d.evidence
