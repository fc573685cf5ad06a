"""Mixed rotations in one cache: LongRoPE's short or long factors chosen per forward of a chunked prefill.

Independent references: transformers' own forward of the same LongRoPE config (uncached, and its
cache prefilled chunk by chunk, where its ``longrope_frequency_update`` picks the factors per forward);
the float64 reference decoder; row ranges derived by hand from the chunk size and the original length
(a chunk ending at ``e`` turns under the short factors iff ``e <= 64``); synthetic rows rotated in
float64 by :meth:`ropekv.rope.RopeSpec.rotate` under the two factor sets.
"""

from __future__ import annotations

import math

import forensic_rows
import pytest
import torch

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.mixed_rotations import LongRopeFactorPerChunk, longrope_variant
from ropekv.bugs.registry import FAULTS
from ropekv.bugs.stale_dynamic_scaling import StaleDynamicRotation
from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.errors import ContractMismatch
from ropekv.faults.native import OpFault
from ropekv.models import load_checkpoint
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.bug_class import BugClass
from ropekv.parity.cases import Case
from ropekv.parity.protocol import Tier
from ropekv.rope import RopeScaling, RopeSpec
from ropekv.testing.tiers import at_tier

ORIG = 64
SHORT = [1.0 + m / 7 for m in range(8)]  # head_dim 16: 8 pairs
LONG = [1.5 + 14.5 * (m / 7) ** 2 for m in range(8)]
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": SHORT,
    "long_factor": LONG,
    "original_max_position_embeddings": ORIG,
    "rope_theta": 10000.0,
}
A = math.sqrt(1 + math.log(256 / ORIG) / math.log(ORIG))  # transformers' default: factor 256 / 64 = 4 -> sqrt(4/3)
NAME = "longrope-factor-per-chunk"
CASE = Case(length=100, chunk=40, block_size=7)


@pytest.fixture(scope="module")
def longrope_dir(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama", rope_parameters=LONGROPE)


@pytest.fixture(scope="module")
def longrope(longrope_dir):
    return load_checkpoint(longrope_dir)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


def tokens_of(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- the model, against transformers


def test_longrope_variant_is_the_rope_transformers_config_gives(llama, longrope, longrope_dir, hf_model):
    variant = longrope_variant(llama).config.rope
    assert variant == longrope.config.rope  # the same spec as the config.json transformers wrote
    assert variant.attention_factor == pytest.approx(A, rel=1e-12) == pytest.approx(1.1547005, rel=1e-7)
    assert hf_model(longrope_dir).model.rotary_emb.attention_scaling == pytest.approx(A, rel=1e-12)
    assert variant.switch_length == ORIG


@pytest.mark.parametrize("n", [40, ORIG, ORIG + 1, 101])
def test_engine_and_reference_agree_with_transformers_uncached_forward(longrope, longrope_dir, hf_model, n):
    tokens = tokens_of(n)
    with torch.no_grad():
        want = hf_model(longrope_dir)(tokens[None]).logits[0].double()  # [n, vocab]
    ref = ReferenceDecoder(longrope).forward(tokens).logits
    engine = Engine(longrope, CacheContract.for_model(longrope.config, key_form="raw"), 64)
    full = engine.forward_full(tokens).logits.double()
    assert (ref - want).abs().max() < 1e-4 and (full - want).abs().max() < 1e-4
    assert want.abs().max() > 0.5


def _hf_chunked_decode(model, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """transformers' cached path: the prompt ``tokens[:-1]`` in chunks, then the last token alone."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        for start in range(0, tokens.numel() - 1, chunk):
            piece = tokens[start : min(start + chunk, tokens.numel() - 1)]
            model(piece[None], past_key_values=cache, use_cache=True)
        return model(tokens[-1:][None], past_key_values=cache, use_cache=True).logits[0, -1].double()


def test_the_fault_is_what_transformers_cached_chunks_do(longrope, longrope_dir, hf_model):
    """transformers picks the factors per forward, so its own chunked cache mixes rotations: its decode
    after chunks of 40 differs from its uncached forward, and the fault reproduces it; the correct
    engine reproduces the uncached forward."""
    model, tokens = hf_model(longrope_dir), tokens_of(101)
    with torch.no_grad():
        uncached = model(tokens[None]).logits[0, -1].double()
    chunked = _hf_chunked_decode(model, tokens, 40)
    assert (chunked - uncached).abs().max() > 0.05  # transformers' own cache holds two rotations

    def decode(key_form, rotation):
        engine = Engine(longrope, CacheContract.for_model(longrope.config, key_form=key_form), 64, rotation=rotation)
        engine.prefill("s", tokens[:100], chunk_size=40)
        return engine.decode("s", tokens[100]).logits[0].double()

    assert (decode("raw", None) - uncached).abs().max() < 1e-4
    assert (decode("rotated", LongRopeFactorPerChunk()) - chunked).abs().max() < 1e-4


def test_rotated_keys_under_longrope_are_still_refused(longrope):
    with pytest.raises(ContractMismatch, match="longrope"):
        Engine(longrope, CacheContract.for_model(longrope.config, key_form="rotated"), 8)


# ---------------------------------------------------------------------- the correct engine, the fault


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [CASE, Case(length=100, block_size=7)], ids=["chunked", "one-forward"])
def test_a_correct_longrope_engine_passes(longrope, case, dtype):
    report = check(NativeAdapter(longrope, key_form="raw", dtype=dtype), cases=[case])
    assert report.passed, report.table()


def test_the_fault_is_caught_at_the_logits_and_attention_tiers(llama):
    faulty = FAULTS[NAME].adapter(llama)
    logits = check(at_tier(faulty, Tier.LOGITS), cases=[CASE])
    assert not logits.passed and logits.diagnosis is None
    attention = check(at_tier(faulty, Tier.ATTENTION), cases=[CASE])
    fd = attention.cases[0].first_divergence
    assert not attention.passed and fd is not None and fd.layer == 0 and fd.query_position == 100


# Hand-derived: chunks end at 40, 80, 100 (chunk 40) or 16, 32, 48, 64, 80, 96, 100 (chunk 16); a chunk
# ending at e <= 64 turns short, the others long; the first decode (position 100, length 101) is long.
RANGES = {40: [[0, 39, "short"], [40, 100, "long"]], 16: [[0, 63, "short"], [64, 100, "long"]]}


@pytest.mark.parametrize("chunk", sorted(RANGES))
def test_the_fault_is_named_mixed_rotations_with_the_row_ranges(llama, longrope, chunk):
    for ckpt in (llama, longrope):  # through longrope_variant, and a LongRoPE model of its own
        report = check(FAULTS[NAME].adapter(ckpt), cases=[Case(length=100, chunk=chunk, block_size=7)])
        d = report.diagnosis
        assert not report.passed and d is not None and d.kind == BugClass.MIXED_ROTATIONS, report.table()
        (lo_s, hi_s, _), (lo_l, hi_l, _) = RANGES[chunk]
        assert d.details["runs"] == RANGES[chunk]
        assert d.details["layer"] == 0 and d.details["query_position"] == 100
        assert d.details["contract_factors"] == "long" and d.details["query_factors"] == "long"
        assert d.evidence.startswith(
            f"keys at positions {lo_s}..{hi_s} rotated under LongRoPE's short factors, {lo_l}..{hi_l} under its "
            "long factors; the contract says long for all (sequence length 101 > original_max_position_embeddings 64)"
        )


def test_one_unchunked_prefill_holds_one_rotation(llama):
    assert check(FAULTS[NAME].adapter(llama), cases=[Case(length=100, block_size=7)]).passed


def test_rotated_longrope_keys_across_the_switch_at_decode_are_mixed(longrope):
    """llama.cpp's rule (factors by the length reached, cached keys not turned again): a prompt of 60,
    decodes from 60 on. Hand-derived: the keys at 0..63 were written at lengths <= 64 (short), the key
    at 64 at length 65 (long), where the first divergence is."""
    adapter = NativeAdapter(longrope, key_form="rotated", rotation=StaleDynamicRotation())
    d = check(adapter, cases=[Case(length=60, decode_steps=8, block_size=7)]).diagnosis
    assert d is not None and d.kind == BugClass.MIXED_ROTATIONS, d
    assert d.details["runs"] == [[0, 63, "short"], [64, 64, "long"]] and d.details["query_position"] == 64


def test_stale_dynamic_scaling_keeps_its_name_on_a_longrope_model(llama, longrope):
    cases = [Case(length=60, decode_steps=8)]
    for ckpt in (llama, longrope):  # the fault runs dynamic NTK on both
        d = check(FAULTS["stale-dynamic-scaling"].adapter(ckpt), cases=cases).diagnosis
        assert d is not None and d.kind == BugClass.STALE_DYNAMIC_SCALING, d


def test_no_other_fault_is_named_mixed_rotations_on_a_longrope_model(llama):
    """Every other fault of ropekv's engine that can run on a LongRoPE model (rotated keys are refused
    there, so in raw keys where the fault allows it) on the exposing case: none is named mixed."""
    ckpt = longrope_variant(llama)
    refused = set()
    for name, fault in FAULTS.items():
        if name == NAME or isinstance(fault, OpFault):
            continue
        try:
            adapter = fault.adapter(ckpt, key_form="raw")
        except ContractMismatch:  # a fault whose contract needs rotated keys, which LongRoPE refuses
            refused.add(name)
            continue
        report = check(adapter, cases=[CASE])
        if report.diagnosis is not None:
            assert report.diagnosis.kind != BugClass.MIXED_ROTATIONS, (name, report.diagnosis)
    # Only the fault that quantizes raw keys under a rotated-key contract cannot run here.
    assert refused == {"fp8-quantized-before-rope"}


# ---------------------------------------------------------------------- forensics on synthetic rows


def _spec(layout: str = "neox", rotary_dim: int = 64) -> RopeSpec:
    n = rotary_dim // 2
    return RopeSpec(
        head_dim=64,
        rotary_dim=rotary_dim,
        theta=10000.0,
        layout=layout,
        scaling=RopeScaling(
            "longrope",
            short_factor=tuple(1.0 + m / (n - 1) for m in range(n)),
            long_factor=tuple(1.5 + 14.5 * (m / (n - 1)) ** 2 for m in range(n)),
            original_max_position_embeddings=ORIG,
        ),
        attention_factor=A,
        max_position_embeddings=256,
    )


SPECS = {"neox": _spec(), "partial-gptj": _spec("gptj", 32)}
SHORT_LEN, LONG_LEN = ORIG, ORIG + 1  # lengths whose frequencies are the short and the long factors'


def _row(spec: RopeSpec, t: int, short_rows: range | list[int], *, query_len: int | None = None, seed: int = 0):
    """A decode row at ``t`` over keys 0..t: every key rotated in float64 under the long factors but
    ``short_rows``, under the short ones; the query under the factors of ``query_len`` (``t + 1``)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, spec.head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(t + 1, 2, spec.head_dim, generator=g, dtype=torch.float64)
    pos = torch.arange(t + 1)
    k_eff = spec.rotate(k, pos, LONG_LEN)
    rows = torch.tensor(list(short_rows), dtype=torch.int64)
    if rows.numel():
        k_eff[rows] = spec.rotate(k[rows], rows, SHORT_LEN)
    q_eff = spec.rotate(q[None], torch.tensor([t]), query_len or t + 1)[0]
    return q, q_eff, k, k_eff, pos


def _inp(spec, q, q_eff, k, k_eff, pos, t, bf16=False):
    if bf16:
        q_eff, k_eff = q_eff.to(torch.bfloat16).double(), k_eff.to(torch.bfloat16).double()
    return dict(
        spec=spec, q=q, q_eff=q_eff, k=k, k_eff=k_eff, t=t, positions=pos, dtype="bfloat16" if bf16 else "float32"
    )


def diagnose_mixed(inp: dict):
    """The diagnosis of the row where it names mixed rotations, else None."""
    d = forensic_rows.diagnose(**inp)
    return d if d.kind == BugClass.MIXED_ROTATIONS else None


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("bf16", [False, True])
def test_two_ranges_under_the_two_factor_sets_are_named_with_their_rows(name, bf16):
    spec, t = SPECS[name], 100
    d = diagnose_mixed(_inp(spec, *_row(spec, t, range(40)), t, bf16=bf16))
    assert d is not None and d.kind == BugClass.MIXED_ROTATIONS
    assert d.details["runs"] == [[0, 39, "short"], [40, 100, "long"]]
    assert d.details["short_keys"] == 40 and d.details["long_keys"] == 61 and d.details["misfit_keys"] == 0
    assert (
        "keys at positions 0..39 rotated under LongRoPE's short factors, 40..100 under its long factors" in d.evidence
    )
    assert "the contract says long for all" in d.evidence and "the query at 100 under the long factors" in d.evidence
    assert forensic_rows.query_position(d) == t and forensic_rows.key_positions(d) == tuple(range(t + 1))


def test_ranges_flipping_back_and_forth_under_concurrency_are_each_named():
    spec, t = SPECS["neox"], 120
    d = diagnose_mixed(_inp(spec, *_row(spec, t, list(range(30)) + list(range(70, 90))), t))
    assert d is not None
    assert d.details["runs"] == [[0, 29, "short"], [30, 69, "long"], [70, 89, "short"], [90, 120, "long"]]


def test_a_short_contract_with_long_newest_keys_is_named_too():
    # a decode at 50 (length 51 <= 64: the contract says short) whose newest keys turned long
    spec, t = SPECS["neox"], 50
    d = diagnose_mixed(_inp(spec, *_row(spec, t, range(45), query_len=ORIG), t))
    assert d is not None and d.details["runs"] == [[0, 44, "short"], [45, 50, "long"]]
    assert "the contract says short for all (sequence length 51 <= original_max_position_embeddings 64)" in d.evidence


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("bf16", [False, True])
def test_one_rotation_throughout_is_not_mixed(name, bf16):
    spec = SPECS[name]
    assert diagnose_mixed(_inp(spec, *_row(spec, 100, []), 100, bf16=bf16)) is None  # every row long
    q, _, k, _, pos = _row(spec, 50, [])
    short = spec.rotate(k, pos, SHORT_LEN), spec.rotate(q[None], torch.tensor([50]), SHORT_LEN)[0]
    assert diagnose_mixed(_inp(spec, q, short[1], k, short[0], pos, 50, bf16=bf16)) is None  # every row short


def test_other_rotation_errors_on_a_longrope_contract_are_not_mixed():
    spec, t = SPECS["neox"], 100
    q, q_eff, k, k_eff, pos = _row(spec, t, range(40))
    doubled = spec.rotate(k, 2 * pos, LONG_LEN)  # keys at 2j: they fit neither factor set at j
    assert diagnose_mixed(_inp(spec, q, q_eff, k, doubled, pos, t)) is None
    other = spec.replace(theta=40000.0)
    q_other = other.rotate(q[None], torch.tensor([t]), t + 1)[0]  # a query under another theta
    assert diagnose_mixed(_inp(spec, q, q_other, k, k_eff, pos, t)) is None


def test_a_dynamic_ntk_cache_is_stale_not_mixed():
    """The stale_dynamic_scaling row of tests/test_forensics.py: prompt keys under the frequencies of
    length 70, each decode key under its own step's; dynamic NTK is never examined as mixed."""
    spec = RopeSpec(64, 64, 10000.0, scaling=RopeScaling("dynamic", factor=2.0), max_position_embeddings=64)
    t, prompt = 89, 70
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 64, generator=g, dtype=torch.float64)
    k = torch.randn(t + 1, 2, 64, generator=g, dtype=torch.float64)
    pos = torch.arange(t + 1)
    k_eff = torch.cat(
        [spec.rotate(k[:prompt], pos[:prompt], seq_len=prompt)]
        + [spec.rotate(k[j : j + 1], pos[j : j + 1], seq_len=j + 1) for j in range(prompt, t + 1)]
    )
    q_eff = spec.rotate(q[None], torch.tensor([t]), seq_len=t + 1)[0]
    inp = dict(spec=spec, q=q, q_eff=q_eff, k=k, k_eff=k_eff, t=t, positions=pos)
    assert diagnose_mixed(inp) is None
    assert forensic_rows.diagnose(**inp).kind == BugClass.STALE_DYNAMIC_SCALING
