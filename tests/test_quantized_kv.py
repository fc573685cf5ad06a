"""An 8-bit KV cache (float8_e4m3fn codes, per-layer scales; vLLM's kv_cache_dtype=fp8) and its faults.

Independent references: scales computed by hand (``amax / 56``: 448 with 8x headroom), codes by torch's own ``float8_e4m3fn`` cast, one e4m3 value derived by hand
(0.3 = 1.2 * 2^-2 rounds to 1.25 * 2^-2 with 3 mantissa bits); the engine against the float64
reference decoder; a rejected operation proven harmless by the cache's state digest.
"""

from __future__ import annotations

import pytest
import torch

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.kv_scale_mismatch import APART, layers_apart
from ropekv.bugs.registry import FAULTS
from ropekv.cache.paged import PagedKVCache
from ropekv.cache.quant import FP8_MAX, LayerScales, compute_scale, dequantize, quantize
from ropekv.contract import CacheContract, KvQuant
from ropekv.errors import CacheError, ConfigError, ContractMismatch, UsageError
from ropekv.models import load_checkpoint
from ropekv.parity.bug_class import BugClass
from ropekv.parity.cases import Case, token_stream
from ropekv.parity.compare import kv_tolerance
from ropekv.parity.protocol import Tier
from ropekv.rope import RopeSpec
from ropekv.testing.tiers import at_tier
from ropekv.transfer.importer import export_handoff, import_handoff
from ropekv.transfer.payload import read_payload, write_payload

FP8_FAULTS = sorted(n for n in FAULTS if n.startswith("fp8-"))
CASES = [Case(length=17, block_size=7, decode_steps=2), Case(length=12, prefix=9, block_size=4, decode_steps=2)]
ROPE = RopeSpec(head_dim=8, rotary_dim=8, theta=10000.0, layout="neox")


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_dir):
    return load_checkpoint(tiny_qwen2_dir)


def _contract(scale="per_tensor", key_form="rotated", **kw) -> CacheContract:
    quantized = "after_rope" if key_form == "rotated" else "before_rope"
    return CacheContract(
        key_form=key_form,
        rope=ROPE,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        dtype="float8_e4m3fn",
        kv_quant=KvQuant(scale, quantized),
        **kw,
    )


def _rows(n: int, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 2, 8, generator=g) * scale for _ in range(2)]  # [n, KVH, D] per layer


# ---------------------------------------------------------------------- quantize / dequantize


def test_one_e4m3_value_by_hand():
    # 0.3 = 1.2 * 2^-2; 3 mantissa bits give 1.125 or 1.25 times 2^-2: 0.3125 is nearer
    q = quantize(torch.full((1, 1, 1), 0.3), torch.tensor([1.0]))
    assert q.dtype == torch.float8_e4m3fn and float(dequantize(q, torch.tensor([1.0]))) == 0.3125


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head"])
def test_round_trip_against_torchs_cast_and_hand_scales(granularity):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 3, 16, generator=g) * torch.tensor([1.0, 5.0, 0.2])[None, :, None]  # heads of other sizes
    if granularity == "per_tensor":
        want = torch.tensor([float(x.abs().max()) / 56.0])
        per = want.expand(3)
    else:
        want = torch.tensor([float(x[:, h].abs().max()) / 56.0 for h in range(3)])
        per = want
    scale = compute_scale(x, granularity, 56.0)
    assert scale.dtype == torch.float32
    torch.testing.assert_close(scale, want, rtol=1e-6, atol=0)
    codes = quantize(x, scale)
    by_hand = (x / per[None, :, None]).to(torch.float8_e4m3fn)  # torch's own cast, no clamp needed here
    assert torch.equal(codes.view(torch.uint8), by_hand.view(torch.uint8))
    back = dequantize(codes, scale)
    torch.testing.assert_close(back, by_hand.to(torch.float32) * per[None, :, None], rtol=0, atol=0)
    # e4m3: a relative error of at most 2^-4 (half of its 2^-3 step) for normal values
    normal = (x / per[None, :, None]).abs() >= 2**-6
    assert float(((back - x).abs() / x.abs())[normal].max()) <= 2**-4 + 1e-6


def test_values_beyond_the_range_saturate_instead_of_turning_nan():
    q = quantize(torch.tensor([[[1000.0, -1000.0, 10.0]]]), torch.tensor([1.0]))
    assert dequantize(q, torch.tensor([1.0])).tolist() == [[[FP8_MAX, -FP8_MAX, 10.0]]]


def test_layer_scales_are_validated():
    with pytest.raises(ConfigError):
        LayerScales(torch.tensor([0.0]), torch.tensor([1.0]))
    with pytest.raises(ConfigError):
        LayerScales(torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0]))


# ---------------------------------------------------------------------- the contract


def test_the_contract_carries_granularity_and_quantization_point():
    c = _contract("per_head")
    assert c.to_dict()["kv_quant"] == {"scale": "per_head", "quantized": "after_rope"}
    assert CacheContract.from_json(c.to_json()) == c
    assert c.compute_dtype == torch.float32 and c.torch_dtype == torch.float8_e4m3fn
    plain = CacheContract(key_form="rotated", rope=ROPE, num_layers=2, num_kv_heads=2, head_dim=8)
    assert "kv_quant" not in plain.to_dict()  # unquantized contracts keep their fingerprints


def test_fp8_needs_its_quantization_and_only_fp8_has_one():
    with pytest.raises(ConfigError, match="kv_quant"):
        CacheContract(key_form="rotated", rope=ROPE, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float8_e4m3fn")
    with pytest.raises(ConfigError, match="kv_quant"):
        CacheContract(
            key_form="rotated",
            rope=ROPE,
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
            kv_quant=KvQuant("per_tensor", "after_rope"),
        )
    with pytest.raises(ConfigError, match="rotated keys are quantized after RoPE"):
        _contract().replace(kv_quant=KvQuant("per_tensor", "before_rope"))
    with pytest.raises(ConfigError, match="scale"):
        KvQuant("per_channel", "after_rope")  # type: ignore[arg-type]


def test_a_reader_with_another_granularity_is_refused_by_name():
    with pytest.raises(ContractMismatch) as info:
        _contract("per_tensor").require_compatible(_contract("per_head"))
    assert info.value.fields == ("kv_quant.scale",)
    assert "per_tensor" in str(info.value) and "another head's" in str(info.value)


def test_a_reader_with_another_quantization_point_is_refused_by_name():
    with pytest.raises(ContractMismatch) as info:
        _contract(key_form="rotated").require_compatible(_contract(key_form="raw"))
    assert set(info.value.fields) == {"key_form", "kv_quant.quantized"}
    assert "quantized before RoPE on one side and after it on the other" in str(info.value)


def test_an_unquantized_reader_is_refused():
    plain = CacheContract(key_form="rotated", rope=ROPE, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(ContractMismatch) as info:
        plain.require_compatible(_contract())
    assert set(info.value.fields) == {"dtype", "kv_quant"}


# ---------------------------------------------------------------------- the cache


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head"])
def test_scales_are_set_once_at_the_first_write_and_reads_dequantize(granularity):
    cache = PagedKVCache(_contract(granularity), num_blocks=8)
    cache.create("a")
    k, v = _rows(5, 1), _rows(5, 2)
    cache.append("a", torch.arange(5), k, v, key_form="rotated")
    for layer in range(2):
        s = cache.scales[layer]
        assert s is not None
        dims = (0, 2) if granularity == "per_head" else (0, 1, 2)
        torch.testing.assert_close(s.k, (k[layer].abs().amax(dim=dims) / 56.0).reshape(-1), rtol=1e-6, atol=0)
        torch.testing.assert_close(s.v, (v[layer].abs().amax(dim=dims) / 56.0).reshape(-1), rtol=1e-6, atol=0)
        view = cache.view("a", layer)
        assert view.keys.dtype == torch.float32
        per = s.k if granularity == "per_head" else s.k.expand(2)
        want = (k[layer] / per[None, :, None]).to(torch.float8_e4m3fn).to(torch.float32) * per[None, :, None]
        assert torch.equal(view.keys, want)
    first = [cache.scales[i].k.clone() for i in range(2)]
    cache.append("a", torch.tensor([5]), _rows(1, 3, 3.0), _rows(1, 4, 3.0), key_form="rotated")  # larger rows
    assert all(torch.equal(cache.scales[i].k, first[i]) for i in range(2))  # static: kept


def test_a_rejected_append_sets_no_scales():
    cache = PagedKVCache(_contract(), num_blocks=8)
    cache.create("a")
    before = cache.state_digest()
    bad = _rows(3, 1)
    bad[1][0, 0, 0] = float("nan")
    with pytest.raises(CacheError):
        cache.append("a", torch.arange(3), bad, _rows(3, 2), key_form="rotated")
    assert cache.state_digest() == before and cache.scales == [None, None]


def test_a_prefix_fork_reads_the_parents_codes_under_the_same_scales():
    cache = PagedKVCache(_contract(), num_blocks=8)
    cache.create("a")
    cache.append("a", torch.arange(6), _rows(6, 1), _rows(6, 2), key_form="rotated")
    cache.fork("b", "a", 5)
    cache.append("b", torch.tensor([5]), _rows(1, 5), _rows(1, 6), key_form="rotated")
    for layer in range(2):
        assert torch.equal(cache.view("b", layer).keys[:5], cache.view("a", layer).keys[:5])


def test_export_and_import_carry_codes_and_scales_bit_for_bit():
    src = PagedKVCache(_contract("per_head"), num_blocks=8)
    src.create("a")
    src.append("a", torch.arange(7), _rows(7, 1), _rows(7, 2), key_form="rotated")
    handoff = read_payload(write_payload(export_handoff(src, "a", torch.arange(7))))
    assert handoff.scales is not None and handoff.keys[0].dtype == torch.float8_e4m3fn
    dst = PagedKVCache(_contract("per_head"), num_blocks=8)
    import_handoff(dst, handoff)
    for layer in range(2):
        assert dst.scales[layer].same(src.scales[layer])
        for a, b in zip(dst.codes("a", layer), src.codes("a", layer)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_rejected_import_leaves_the_cache_unchanged():
    src = PagedKVCache(_contract("per_head"), num_blocks=8)
    src.create("a")
    src.append("a", torch.arange(7), _rows(7, 1), _rows(7, 2), key_form="rotated")
    handoff = export_handoff(src, "a", torch.arange(7))
    dst = PagedKVCache(_contract("per_tensor"), num_blocks=8)
    dst.create("x")
    dst.append("x", torch.arange(3), _rows(3, 9), _rows(3, 8), key_form="rotated")
    before = dst.state_digest()
    with pytest.raises(ContractMismatch) as info:
        import_handoff(dst, handoff)
    assert "kv_quant.scale" in info.value.fields
    assert dst.state_digest() == before and dst.seq_ids() == ["x"]


def test_a_stream_of_an_8bit_cache_is_refused_before_sending():
    from ropekv.transfer.stream import send_sequence

    cache = PagedKVCache(_contract(), num_blocks=8)
    cache.create("a")
    cache.append("a", torch.arange(3), _rows(3, 1), _rows(3, 2), key_form="rotated")
    with pytest.raises(UsageError, match="scales"):
        send_sequence(None, 1, cache, "a", torch.arange(3))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the engine against float64


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head"])
@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_the_correct_fp8_engine_passes_at_its_tolerance(llama, qwen2, key_form, granularity):
    for ckpt in (llama, qwen2):
        report = check(ckpt, kv_dtype="fp8", kv_scale=granularity, key_form=key_form, cases=CASES)
        assert report.passed, report.table()
        # ... and it is not float32: the cache really is 8-bit (above float32's tolerance)
        assert max(c.max_attn_error for c in report.cases) > 2e-3


def test_an_fp8_cache_needs_float32_compute(llama):
    with pytest.raises(UsageError, match="float32"):
        NativeAdapter(llama, kv_dtype="fp8", dtype="bfloat16")
    with pytest.raises(UsageError, match="kv_dtype"):
        NativeAdapter(llama, kv_dtype="fp4")  # type: ignore[arg-type]


def test_layers_apart_is_the_same_function(llama):
    # odd layers' keys and values 4x larger, queries and outputs 4x smaller: the same logits
    apart = layers_apart(llama)
    w, w0 = apart.weights, llama.weights
    assert torch.equal(
        w["model.layers.1.self_attn.k_proj.weight"], w0["model.layers.1.self_attn.k_proj.weight"] * APART
    )
    assert torch.equal(w["model.layers.0.self_attn.k_proj.weight"], w0["model.layers.0.self_attn.k_proj.weight"])
    tokens = torch.arange(9) % llama.config.vocab_size
    a = NativeAdapter(llama).make_engine(Case(length=9)).forward_full(tokens).logits
    b = NativeAdapter(apart).make_engine(Case(length=9)).forward_full(tokens).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- the faults, caught and named


@pytest.mark.parametrize("name", FP8_FAULTS)
def test_each_fault_fails_at_the_logits_and_attention_tiers(llama, name):
    fault = FAULTS[name]
    faulty = fault.adapter(llama)
    tol = kv_tolerance("fp8")  # judged at the fp8 tolerance, which the correct engine passes
    logits = check(at_tier(faulty, Tier.LOGITS), cases=list(fault.exposing), tolerance=tol)
    assert not logits.passed and logits.diagnosis is None
    attention = check(at_tier(faulty, Tier.ATTENTION), cases=list(fault.exposing), tolerance=tol)
    fd = attention.cases[0].first_divergence
    assert not attention.passed and fd is not None and fd.layer == 0


def test_scales_dropped_on_a_prefix_hit_are_named_with_the_rows_of_the_hit(llama):
    fault = FAULTS["fp8-scales-dropped-on-prefix-hit"]
    report = check(fault.adapter(llama), cases=list(fault.exposing), tolerance=kv_tolerance("fp8"))
    d = report.diagnosis
    assert d is not None and d.kind == BugClass.KV_SCALE_MISMATCH, report.table()
    assert "exactly the 9 rows reused from the prefix-cache hit" in d.evidence
    assert "dequantized with scale 1, their scale dropped" in d.evidence
    # the factor is 1 / s: the reciprocal of the layer-0 key scale a correct cache takes from the
    # earlier request (the 9 prefix tokens and 3 others: ropekv.adapters.native_steps.prefill_case)
    case, vocab = fault.exposing[0], llama.config.vocab_size
    tokens = token_stream(vocab, case.total, 0)
    engine = NativeAdapter(llama, kv_dtype="fp8").make_engine(case)
    engine.prefill("e", torch.cat([tokens[:9], (tokens[:3] + 1) % vocab]))
    assert d.details["key_factors"][0][0] == pytest.approx(1 / float(engine.cache.scales[0].k), rel=0.1)


def test_the_first_request_of_a_dropped_scale_cache_is_right(llama):
    # SGLang's symptom: the request that wrote the prefix is right, only the later ones that hit it are not
    report = check(
        FAULTS["fp8-scales-dropped-on-prefix-hit"].adapter(llama), cases=CASES[:1], tolerance=kv_tolerance("fp8")
    )
    assert report.passed, report.table()


def test_scales_of_another_layer_are_named_with_the_factor_between_the_layers(llama):
    fault = FAULTS["fp8-scales-of-another-layer"]
    report = check(fault.adapter(llama), cases=list(fault.exposing), tolerance=kv_tolerance("fp8"))
    d = report.diagnosis
    assert d is not None and d.kind == BugClass.KV_SCALE_MISMATCH, report.table()
    assert "1 key right (positions 17)" in d.evidence  # the step's own fresh key is never quantized
    assert "scale dropped" not in d.evidence
    assert d.details["key_factors"][0][0] == pytest.approx(APART, rel=0.25)  # layer 1's keys: 4x layer 0's


@pytest.mark.parametrize(
    ("name", "kind"),
    [("fp8-quantized-after-rope", "double_rotation"), ("fp8-quantized-before-rope", "missing_rotation")],
)
def test_the_quantization_point_faults_are_named_by_where_the_keys_sit(llama, name, kind):
    fault = FAULTS[name]
    report = check(fault.adapter(llama), cases=list(fault.exposing), tolerance=kv_tolerance("fp8"))
    assert report.diagnosis is not None and report.diagnosis.kind == kind == fault.kind, report.table()


@pytest.mark.parametrize("name", ["yarn-attention-factor-dropped", "yarn-attention-factor-twice"])
def test_yarn_faults_are_never_named_kv_scale_mismatch(llama, name):
    # queries and keys scaled alike by the attention factor: not the cache's scales, on a float32 cache
    # (rope_magnitude) or an 8-bit one. Judged at float32's tolerance: YaRN factor 4's 1.1386 moves the
    # tiny model's scores by less than the fp8 tolerance (docs/faults.md).
    fault = FAULTS[name]
    plain = check(fault.adapter(llama), cases=list(fault.exposing)[:1])
    assert plain.diagnosis is not None and plain.diagnosis.kind == BugClass.ROPE_MAGNITUDE, plain.table()
    fp8 = check(fault.adapter(llama, kv_dtype="fp8"), cases=list(fault.exposing)[:1])
    assert fp8.diagnosis is not None and fp8.diagnosis.kind != BugClass.KV_SCALE_MISMATCH, fp8.table()


# ---------------------------------------------------------------------- the command line


def test_the_cli_checks_an_fp8_cache_and_names_a_dropped_scale(tiny_llama_dir, capsys):
    from ropekv.cli.main import main

    ok = main(
        ["check", str(tiny_llama_dir), "--kv-dtype", "fp8", "--lengths", "17", "--block-sizes", "7", "--no-progress"]
    )
    out = capsys.readouterr().out
    assert ok == 0, out
    assert "fp8 KV cache (per_tensor scales)" in out and "tolerance 0.3" in out
    code = main(
        [
            "check",
            str(tiny_llama_dir),
            "--inject",
            "fp8-scales-dropped-on-prefix-hit",
            "--no-progress",
            "--lengths",
            "12",
        ]
        + ["--prefix-offsets", "9", "--block-sizes", "4"]
    )
    out = capsys.readouterr().out
    assert code == 1 and "kv_scale_mismatch" in out, out


@pytest.mark.parametrize("name", ["fp8-scales-dropped-on-prefix-hit", "fp8-scales-of-another-layer"])
def test_per_head_scales_are_named_with_one_factor_per_head(llama, name):
    fault = FAULTS[name]
    report = check(fault.adapter(llama, kv_scale="per_head"), cases=list(fault.exposing), tolerance=kv_tolerance("fp8"))
    d = report.diagnosis
    assert d is not None and d.kind == BugClass.KV_SCALE_MISMATCH, report.table()
    assert "per head x" in d.evidence and len(d.details["key_factors"][0]) == llama.config.num_kv_heads
