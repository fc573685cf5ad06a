"""Every described architecture (ropekv.models.families), on tiny random transformers checkpoints.

For each configuration: the float64 reference decoder's logits against transformers' own forward of
the same saved checkpoint (so every config field is read as the architecture's implementation reads
it); ropekv's engine (cached prefill in chunks, odd block size, ten decode steps; rotated and raw
keys) against the reference; and ``ropekv.check`` on transformers' own cached path (HFEngine) and on
ropekv's engine, plus HFEngine's cross-engine parity. Tolerance 1e-5 scale-aware (``max |a - b| / max(1, max |b|)``): float32
against float64 on unit-scale tiny models measures 1e-7..2e-6, while any misread field (a bias, a
norm offset, a partial rotary, a scale) measured 1e-2..1 when we tried.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import MULTIMODAL, TINY_VISION, build_arch_model

from ropekv import check
from ropekv.adapters.hf import HFEngine
from ropekv.adapters.native import NativeAdapter
from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.errors import ConfigError, UsageError
from ropekv.models import ReferenceDecoder, load_checkpoint
from ropekv.models.families import FAMILIES, REFUSED
from ropekv.parity.cases import Case
from ropekv.parity.cross_engine import cross_engine_parity

TOL = 1e-5
LENGTH, PREFILL, CHUNK, BLOCK = 30, 20, 6, 7
W = 5  # sliding window of the windowed variants: wraps many times in 30 tokens
SW = {"sliding_window": W, "layer_types": ["sliding_attention", "full_attention"]}
PARTIAL = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
MOE = {"num_experts_per_tok": 2}
# Multi-head latent attention: heads of 8 + 8 (position-free + rope part), values of 12, one rope head
# shared by all four; head_dim is the rope part's (what transformers sizes the frequencies by).
MLA = {
    "num_key_value_heads": 4,
    "head_dim": 8,
    "kv_lora_rank": 20,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 4,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    **MOE,
}
YARN_MSCALE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 1e4,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
# llama4: chunks of 8 (30 tokens cross three boundaries), RoPE/NoPE alternating, the temperature rising
# every 4 positions, MoE on layers 1 and 3 (4 experts, top 1, shared expert), dense layers of 80.
# Qwen2-VL's text model: mRoPE sections over the 8 frequency pairs of a 16-wide head (t, h, w streams).
MROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
LLAMA4 = {
    "num_hidden_layers": 4,
    "attention_chunk_size": 8,
    "no_rope_layer_interval": 2,
    "floor_scale": 4,
    "attn_scale": 0.5,
    "num_local_experts": 4,
    "interleave_moe_layer_step": 2,
    "intermediate_size_mlp": 80,
}

# (id, model_type, config overrides)
VARIANTS = [
    ("llama", "llama", {}),
    ("llama-biases", "llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama-partial-ignored", "llama", {"rope_parameters": PARTIAL}),
    ("llama-linear", "llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
    (
        "llama-llama3",
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 1e4,
            }
        },
    ),
    (
        "llama-yarn",
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 1e4,
            }
        },
    ),
    ("llama-dynamic", "llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}),
    (
        "llama-longrope",
        "llama",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "short_factor": [1 + i / 10 for i in range(8)],
                "long_factor": [2 + i / 10 for i in range(8)],
                "original_max_position_embeddings": 16,
                "rope_theta": 1e4,
            }
        },
    ),
    ("mistral-window", "mistral", {"sliding_window": W}),
    ("mistral-attention-bias-ignored", "mistral", {"attention_bias": True}),
    ("ministral", "ministral", SW),
    ("qwen2", "qwen2", {}),
    ("qwen2-partial-ignored", "qwen2", {"rope_parameters": PARTIAL}),
    ("qwen3", "qwen3", {"hidden_size": 48}),
    ("qwen3-partial-ignored", "qwen3", {"rope_parameters": PARTIAL}),
    ("helium", "helium", {}),
    ("seed_oss", "seed_oss", {}),
    ("smollm3-nope", "smollm3", {"no_rope_layers": [1, 0]}),
    ("ernie4_5", "ernie4_5", {"use_bias": True}),
    ("arcee", "arcee", {}),
    (
        "granite",
        "granite",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3, "logits_scaling": 4.0},
    ),
    ("gemma", "gemma", {}),
    ("gemma2", "gemma2", {"sliding_window": W, "query_pre_attn_scalar": 16}),
    (
        "gemma3_text",
        "gemma3_text",
        {
            **SW,
            "query_pre_attn_scalar": 16,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        },
    ),
    ("apertus", "apertus", {}),
    ("olmo", "olmo", {}),
    ("olmo-clip-qkv", "olmo", {"clip_qkv": 0.5, "attention_bias": True}),
    ("olmo2", "olmo2", {}),
    ("olmo3", "olmo3", SW),
    ("exaone4", "exaone4", SW),
    ("cohere", "cohere", {"logit_scale": 0.5}),
    ("cohere-qk-norm", "cohere", {"use_qk_norm": True}),
    ("cohere2-nope", "cohere2", SW),
    ("starcoder2", "starcoder2", {"sliding_window": W}),
    ("stablelm", "stablelm", {"use_qkv_bias": True}),
    ("stablelm-qk-layernorm-parallel", "stablelm", {"qk_layernorm": True, "use_parallel_residual": True}),
    ("nemotron", "nemotron", {}),
    ("glm", "glm", {}),
    ("glm4", "glm4", {}),
    ("hunyuan_v1_dense", "hunyuan_v1_dense", {"attention_bias": True}),
    (
        "hunyuan_v1_dense-ntk-alpha",
        "hunyuan_v1_dense",
        {"rope_parameters": {"rope_type": "dynamic", "alpha": 50.0, "factor": 2.0, "rope_theta": 1e4}},
    ),
    ("phi3", "phi3", {}),
    (
        "phi3-longrope",
        "phi3",
        {
            "original_max_position_embeddings": 16,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.1, 1.2, 1.3],
                "long_factor": [2.0, 2.1, 2.2, 2.3],
            },
        },
    ),
    ("gpt_neox", "gpt_neox", {}),
    (
        "gpt_neox-sequential",
        "gpt_neox",
        {
            "use_parallel_residual": False,
            "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        },
    ),
    ("persimmon", "persimmon", {}),
    ("persimmon-no-qk-layernorm", "persimmon", {"qk_layernorm": False}),
    ("phi", "phi", {}),
    ("phi-qk-layernorm", "phi", {"qk_layernorm": True, "partial_rotary_factor": 0.25}),
    ("gptj", "gptj", {"rotary_dim": 8}),
    ("gptj-whole-head", "gptj", {"rotary_dim": 16, "n_inner": 80}),
    ("falcon", "falcon", {}),
    ("falcon-new-architecture", "falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    (
        "falcon-new-architecture-one-norm",
        "falcon",
        {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1, "bias": True},
    ),
    ("falcon-sequential", "falcon", {"multi_query": False, "parallel_attn": False, "bias": True}),
    ("mixtral", "mixtral", {"num_local_experts": 4, **MOE}),
    (
        "qwen2_moe",
        "qwen2_moe",
        {
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [0],
            **MOE,
        },
    ),
    ("qwen3_moe", "qwen3_moe", {"num_experts": 4, "moe_intermediate_size": 32, "norm_topk_prob": True, **MOE}),
    (
        "granitemoe",
        "granitemoe",
        {"num_local_experts": 4, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, **MOE},
    ),
    # v3: q through q_a_proj / q_a_layernorm / q_b_proj, interleaved rope part, sigmoid routing with the
    # correction bias over 2 groups (1 kept), renormalized, times 2.5 (the class default).
    ("deepseek_v3", "deepseek_v3", {**MLA, "q_lora_rank": 24, "n_group": 2, "topk_group": 1}),
    # v3 with q_proj, rotate_half rope part, attention biases, yarn whose mscale_all_dim changes the softmax scale.
    (
        "deepseek_v3-yarn-neox",
        "deepseek_v3",
        {
            **MLA,
            "q_lora_rank": None,
            "rope_interleave": False,
            "attention_bias": True,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "rope_parameters": YARN_MSCALE,
        },
    ),
    # v2: complex-pair (interleaved) rope part, softmax greedy routing, two shared experts, MLP biases.
    ("deepseek_v2", "deepseek_v2", {**MLA, "q_lora_rank": None, "mlp_bias": True, "routed_scaling_factor": 1.5}),
    (
        "deepseek_v2-group-limited",
        "deepseek_v2",
        {
            **MLA,
            "q_lora_rank": 24,
            "attention_bias": True,
            "topk_method": "group_limited_greedy",
            "n_group": 2,
            "topk_group": 1,
        },
    ),
    # GLM-4.5 MoE: rotate_half partial rotary 0.5 (its default), deepseek_v3's sigmoid grouped routing.
    (
        "glm4_moe",
        "glm4_moe",
        {
            "n_routed_experts": 4,
            "moe_intermediate_size": 32,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 1.5,
            "attention_bias": True,
            **MOE,
        },
    ),
    (
        "glm4_moe-qk-norm",
        "glm4_moe",
        {
            "n_routed_experts": 4,
            "moe_intermediate_size": 32,
            "use_qk_norm": True,
            "norm_topk_prob": False,
            "first_k_dense_replace": 0,
            **MOE,
        },
    ),
    ("llama4_text", "llama4_text", LLAMA4),
    ("qwen2_vl", "qwen2_vl", {"rope_parameters": MROPE}),
    ("qwen2_5_vl", "qwen2_5_vl", {"rope_parameters": MROPE}),
    # Sinks, every-other windows (layer_types left to its config class), yarn without truncation,
    # biased MoE; a small swiglu_limit so the clamp bites on unit-scale weights.
    (
        "gpt_oss",
        "gpt_oss",
        {
            "num_local_experts": 4,
            "sliding_window": W,
            "swiglu_limit": 0.5,
            "swiglu_alpha": 1.3,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 1e4,
            },
            **MOE,
        },
    ),
]

BY_ID = {v[0]: v[1:] for v in VARIANTS}

# Architectures named in the issue (tests/test_architectures.py keeps the list honest).
NAMED_IN_ISSUE = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "phi",
    "gpt_neox",
    "stablelm",
    "persimmon",
    "cohere",
    "cohere2",
    "olmo",
    "olmo2",
    "olmo3",
    "granite",
    "granitemoe",
    "starcoder2",
    "glm",
    "glm4",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "llama4_text",
    "smollm3",
    "ernie4_5",
    "exaone4",
    "nemotron",
    "helium",
    "ministral",
    "seed_oss",
    "hunyuan_v1_dense",
    "arcee",
    "apertus",
    "falcon",
    "gptj",
    "qwen2_vl",
]


def scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / max(1.0, float(b.double().abs().max())))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 96, (LENGTH,), generator=torch.Generator().manual_seed(1))


def cases_for(cfg) -> list[Case]:
    """Short cases: odd blocks, a block boundary, chunked prefill, a prefix-cache hit where the windows
    leave the prefix in the cache, several decode steps. Length-dependent RoPE stays below its switch
    length (16 here): past it no cache matches a full forward beyond layer 0, by design."""
    short = cfg.rope.length_dependent and cfg.rope.scaling.rope_type == "longrope"
    cases = [Case(length=9 if short else 17, block_size=5 if short else 7, decode_steps=3)]
    if cfg.sliding_window is None:
        cases.append(Case(length=10, prefix=3, chunk=4, block_size=3, decode_steps=2))
    else:
        cases.append(Case(length=12 if short else 20, chunk=4, block_size=3, decode_steps=2))
    return cases


# The figures the sweep asserts on, per variant; written as JSON where ROPEKV_ARCH_FIGURES names a file
# (scripts/findings/architecture_table.py renders docs/architectures.md's measured table from it).
_FIGURES: dict[str, dict[str, float]] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_figures():
    yield
    out = os.environ.get("ROPEKV_ARCH_FIGURES")
    if out and _FIGURES:
        Path(out).write_text(json.dumps(_FIGURES, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("arch,overrides", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_reference_engine_and_hf_adapter_match_transformers(
    arch, overrides, make_arch_checkpoint, hf_model, tokens, request
):
    figures = _FIGURES.setdefault(request.node.callspec.id, {"arch": arch})
    path = make_arch_checkpoint(arch, **overrides)
    ckpt = load_checkpoint(path)
    model = hf_model(path)
    with torch.no_grad():
        hf = model(tokens[None]).logits[0]  # [T, vocab] float32, transformers' own forward
    ref = ReferenceDecoder(ckpt).forward(tokens).logits  # [T, vocab] float64
    figures["reference_vs_transformers"] = scaled(hf, ref)
    assert scaled(hf, ref) < TOL, f"reference vs transformers: {scaled(hf, ref):.2e}"

    # Length-dependent RoPE: rotated keys are refused, and chunks that cross LongRoPE's switch length
    # would leave deeper layers' keys computed under the short factors (inherent), so prefill in one
    # chunk there.
    dependent = ckpt.config.rope.length_dependent
    # q/k norm after RoPE (hunyuan): the cached key is norm(R(j) k), "raw" has no meaning (refused there).
    after_rope = ckpt.config.family.block.qk_norm == "head_after_rope"
    for form in ("raw",) if dependent else ("rotated",) if after_rope else ("rotated", "raw"):
        engine = Engine(ckpt, CacheContract.for_model(ckpt.config, key_form=form, block_size=BLOCK))
        assert scaled(engine.forward_full(tokens).logits, ref) < TOL
        engine.prefill("s", tokens[:PREFILL], chunk_size=None if dependent else CHUNK)
        for t in range(PREFILL, LENGTH):
            err = scaled(engine.decode("s", int(tokens[t])).logits[0], ref[t])
            figures["engine_decode_vs_reference"] = max(err, figures.get("engine_decode_vs_reference", 0.0))
            assert err < TOL, f"{form} keys, decode at {t}: {err:.2e}"

    # The same model through the harness: transformers' cached path (HFEngine, attention recorded
    # through its attention interface), its cache-free forward against the reference, and ropekv's
    # engine from the saved checkpoint.
    cases = cases_for(ckpt.config)
    native = NativeAdapter(ckpt, key_form="raw" if dependent else "rotated")
    if FAMILIES[ckpt.config.architecture].hf.attention_inline:  # falcon: nothing to hook, refused by name
        with pytest.raises(UsageError, match="computes attention inline"):
            HFEngine(model)
        report = check(native, cases=cases)
        figures["check_attention_engine"] = max(c.max_attn_error for c in report.cases)
        assert report.passed and max(c.max_attn_error for c in report.cases) < TOL, report.table()
        return
    hf_engine = HFEngine(model)
    for adapter, key in ((hf_engine, "check_attention_hf"), (native, "check_attention_engine")):
        report = check(adapter, cases=cases)
        figures[key] = max(c.max_attn_error for c in report.cases)
        assert report.passed, report.table()
        assert max(c.max_attn_error for c in report.cases) < TOL
        assert max(max(c.logit_errors) for c in report.cases) < TOL
    cross = cross_engine_parity(hf_engine, length=24)
    figures["cross_engine"] = max(max(cross.attn), cross.logits)
    assert cross.passed and max(cross.attn) < TOL and cross.logits < TOL, cross.to_dict()


def test_every_architecture_of_the_issue_is_described_or_refused_by_feature():
    described, refused = set(FAMILIES), set(REFUSED)
    assert not described & refused
    assert set(NAMED_IN_ISSUE) <= described | refused
    assert {v[1] for v in VARIANTS} == described  # every description is swept above


def test_a_refused_architecture_is_refused_naming_its_feature(monkeypatch, tmp_path):
    """Every architecture the issue names is described now (REFUSED is empty); the refusal path stays for
    the next one transformers ships: an entry there is a one-line ConfigError naming the architecture and
    the feature, before any other field is read."""
    import json

    assert REFUSED == {}
    monkeypatch.setitem(REFUSED, "bloom", "ALiBi attention biases instead of RoPE")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bloom", "architectures": [], "vocab_size": 96}))
    with pytest.raises(ConfigError) as info:
        load_checkpoint(tmp_path)
    assert "ALiBi attention biases instead of RoPE" in str(info.value) and "bloom" in str(info.value)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_partial_rotary_is_ignored_where_the_architecture_ignores_it(arch, make_arch_checkpoint):
    cfg = load_checkpoint(make_arch_checkpoint(arch, rope_parameters=PARTIAL)).config
    assert cfg.rope.rotary_dim == cfg.head_dim  # the whole head rotates, as in transformers
    assert any("partial_rotary_factor=0.5 is ignored" in w for w in cfg.warnings)


@pytest.mark.parametrize("arch,rotary", [("phi3", 8), ("glm", 8), ("stablelm", 4), ("nemotron", 8)])
def test_partial_rotary_is_honoured_where_the_architecture_reads_it(arch, rotary, make_arch_checkpoint):
    factor = {"stablelm": 0.25}.get(arch, 0.5)
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": factor}
    cfg = load_checkpoint(make_arch_checkpoint(arch, rope_parameters=rope)).config
    assert cfg.rope.rotary_dim == rotary and cfg.warnings == ()


def test_partial_rotary_with_scaling_on_a_whole_head_architecture_is_refused(make_tiny_checkpoint, tmp_path):
    """transformers' llama computes frequencies for half the head, then cannot broadcast them: no
    implementation runs this config, so ropekv refuses it instead of checking another reading."""
    import json

    config = {
        **json.loads((make_tiny_checkpoint("llama") / "config.json").read_text()),
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="partial_rotary_factor 0.5 with RoPE type 'linear'"):
        load_checkpoint(tmp_path)
    with pytest.raises(RuntimeError):  # the claim about transformers, checked
        model = build_arch_model("llama", {"rope_parameters": config["rope_parameters"]})
        model(torch.arange(4)[None])


def test_mistral_attention_bias_is_ignored_with_a_warning(make_arch_checkpoint):
    cfg = load_checkpoint(make_arch_checkpoint("mistral", attention_bias=True)).config
    assert not cfg.attention_bias and any("attention_bias=True is ignored" in w for w in cfg.warnings)


def test_window_on_a_model_without_sliding_layers_is_a_warning(make_arch_checkpoint):
    cfg = load_checkpoint(make_arch_checkpoint("llama", sliding_window=5)).config
    assert cfg.sliding_window is None and any("sliding_window=5 is ignored" in w for w in cfg.warnings)


def test_per_layer_rope_and_nope_layers_are_read_from_the_config(make_arch_checkpoint):
    gemma3 = load_checkpoint(make_arch_checkpoint("gemma3_text", **BY_ID["gemma3_text"][1])).config
    local, global_ = gemma3.layer_rope(0), gemma3.layer_rope(1)
    assert (local.theta, local.scaling.rope_type) == (1e4, "default")
    assert (global_.theta, global_.scaling.rope_type, global_.scaling.factor) == (1e6, "linear", 4.0)
    cohere2 = load_checkpoint(make_arch_checkpoint("cohere2", **SW)).config
    assert cohere2.layer_rope(0) is not None and cohere2.layer_rope(1) is None  # global layers: NoPE
    assert cohere2.rope.layout == "gptj"
    smol = load_checkpoint(make_arch_checkpoint("smollm3", no_rope_layers=[1, 0])).config
    assert smol.layer_rope(0) is not None and smol.layer_rope(1) is None


def test_default_checkpoint_is_unchanged():
    """The embedded SmolLM2 reads as before: same fingerprint, uniform RoPE, no warnings."""
    ckpt = load_checkpoint(None)
    assert ckpt.fingerprint == "424f8aaf85cf24f0"
    assert ckpt.config.uniform_rope and ckpt.config.warnings == () and ckpt.config.attn_scale == 64**-0.5


def test_switch_length_is_where_the_frequencies_change():
    """LongRoPE switches at original_max_position_embeddings, dynamic NTK at max_position_embeddings."""
    from ropekv.rope import RopeScaling, RopeSpec

    longrope = RopeSpec(
        16,
        16,
        1e4,
        scaling=RopeScaling(
            "longrope", short_factor=(1.0,) * 8, long_factor=(2.0,) * 8, original_max_position_embeddings=16
        ),
        max_position_embeddings=256,
    )
    assert longrope.switch_length == 16
    assert not torch.equal(longrope.inv_freq(16), longrope.inv_freq(17))
    dynamic = RopeSpec(16, 16, 1e4, scaling=RopeScaling("dynamic", factor=2.0), max_position_embeddings=64)
    assert dynamic.switch_length == 64
    assert torch.equal(dynamic.inv_freq(64), dynamic.inv_freq(10)) and not torch.equal(
        dynamic.inv_freq(65), dynamic.inv_freq(64)
    )
    assert RopeSpec(16, 16, 1e4).switch_length is None


# Fields a minimal config.json keeps: sizes and structure; everything else is left to the defaults.
_STRUCTURE = {
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "layer_types",
    "num_local_experts",
    "num_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts_per_tok",
    "original_max_position_embeddings",
    "rms_norm_eps",
    "layer_norm_eps",
    "norm_epsilon",
    "norm_eps",
    "n_embd",
    "n_head",
    "n_layer",
    "n_positions",
    "n_inner",
    "layer_norm_epsilon",
    "rotary_dim",
}
_STRUCTURE_OVERRIDES = {"gptj": {"rotary_dim": 8}}  # its default 64 exceeds the tiny head


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_omitted_fields_read_as_the_architectures_own_defaults(arch):
    """A config.json that omits optional fields (biases, tied embeddings, softcaps, scalars, RoPE theta
    and partial factor, windows) reads as the full config of transformers' own config class."""
    from conftest import arch_kwargs
    from transformers import AutoConfig

    from ropekv.models.hf_config import read_model_config

    kwargs = {
        k: v for k, v in arch_kwargs(arch, _STRUCTURE_OVERRIDES.get(arch, {})).items() if k != "tie_word_embeddings"
    }
    if (
        FAMILIES[arch].reading.attention == "mla"
    ):  # one KV head per query head; head_dim: the config class sets the rope part's
        kwargs.update(num_key_value_heads=kwargs["num_attention_heads"], num_experts_per_tok=2)
        kwargs.pop("head_dim", None)
    if arch in MULTIMODAL:  # the text model's fields under text_config; the mRoPE sections are structure
        sections = {"rope_type": "default", "mrope_section": MROPE["mrope_section"]}  # theta: the class default
        full = AutoConfig.for_model(
            arch, text_config={**kwargs, "rope_parameters": sections}, vision_config=TINY_VISION[arch]
        ).to_dict()
        text = {k: v for k, v in full["text_config"].items() if k in _STRUCTURE}
        minimal = {
            "model_type": arch,
            "architectures": [],
            "text_config": {**text, "rope_parameters": {"mrope_section": MROPE["mrope_section"]}},
        }
    else:
        full = AutoConfig.for_model(arch, **kwargs).to_dict()
        minimal = {k: v for k, v in full.items() if k in _STRUCTURE}
    full["architectures"] = []
    assert read_model_config(minimal) == read_model_config(full)


def test_gpt_neox_legacy_fields_read_as_its_config_class_reads_them(make_arch_checkpoint, tmp_path):
    """Checkpoints saved before transformers 5 name the RoPE rotary_pct / rotary_emb_base and the head
    embed_out; the config class renames the first two (rotary_pct defaulting to 0.25), the loader the
    third. The fused query_key_value rows are [heads, 3, head_dim]: read as [3, heads, head_dim] the
    reference would not match transformers' forward (tested above)."""
    import json

    from transformers import GPTNeoXConfig

    config = json.loads((make_arch_checkpoint("gpt_neox") / "config.json").read_text())
    del config["rope_parameters"]
    legacy = {**config, "rotary_pct": 0.5, "rotary_emb_base": 500.0}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    from ropekv.models.safetensors_dir import read_dir_config

    rope = read_dir_config(tmp_path).rope
    theirs = GPTNeoXConfig(**{k: v for k, v in legacy.items() if k != "model_type"}).rope_parameters
    assert (rope.rotary_dim, rope.theta) == (16 * theirs["partial_rotary_factor"], theirs["rope_theta"]) == (8, 500.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_dir_config(tmp_path).rope.rotary_dim == 16 * GPTNeoXConfig().rope_parameters["partial_rotary_factor"]


def test_gptj_reads_no_rope_field(make_arch_checkpoint, hf_model, tokens):
    """GPT-J's sin/cos table is theta 10000 over rotary_dim channels whatever the config's RoPE fields
    say: ropekv warns and reads them as it does, and its reference still matches transformers."""
    path = make_arch_checkpoint("gptj", rotary_dim=8, rope_theta=500.0)
    ckpt = load_checkpoint(path)
    assert (ckpt.config.rope.theta, ckpt.config.rope.rotary_dim, ckpt.config.rope.layout) == (1e4, 8, "gptj")
    assert any("rope_theta=500.0 is ignored" in w for w in ckpt.config.warnings)
    with torch.no_grad():
        hf = hf_model(path)(tokens[None]).logits[0]
    assert scaled(hf, ReferenceDecoder(ckpt).forward(tokens).logits) < TOL


@pytest.mark.parametrize(
    "overrides,feature",
    [
        ({"alibi": True}, "refused: alibi"),
        ({"new_decoder_architecture": True, "parallel_attn": False}, "cannot run that layer"),
        ({"parallel_attn": True, "num_ln_in_parallel_attn": 2}, "cannot run that layer"),
    ],
)
def test_falcon_configs_without_rope_or_without_a_runnable_layer_are_refused(
    overrides, feature, make_arch_checkpoint, tmp_path
):
    import json

    config = {**json.loads((make_arch_checkpoint("falcon") / "config.json").read_text()), **overrides}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=feature):
        load_checkpoint(tmp_path)


def test_apertus_xielu_parameters_are_read_per_layer(make_arch_checkpoint, hf_model, tokens):
    """xIELU's alpha_p / alpha_n are learned per layer: the reference with layer 0's parameters on
    every layer misses transformers, with each layer's own it matches (the sweep above)."""
    path = make_arch_checkpoint("apertus")
    ckpt = load_checkpoint(path)
    with torch.no_grad():
        hf = hf_model(path)(tokens[None]).logits[0]
    weights = dict(ckpt.weights)
    for n in ("alpha_p", "alpha_n"):
        weights[f"model.layers.1.mlp.act_fn.{n}"] = weights[f"model.layers.0.mlp.act_fn.{n}"]
    from ropekv.models.config import Checkpoint

    shared = Checkpoint(ckpt.config, weights, ckpt.source, ckpt.fingerprint)
    assert scaled(hf, ReferenceDecoder(shared).forward(tokens).logits) > 100 * TOL


GPT_OSS_ROPES = [
    ("config-class-default", {"rope_theta": 1e4}),  # no rope_parameters: yarn x32 from 4096, as GptOssConfig sets
    (
        "yarn-truncate-attention-factor",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "truncate": True,
                "attention_factor": 1.3,
                "original_max_position_embeddings": 64,
                "rope_theta": 1e4,
            }
        },
    ),
    (
        "yarn-mscale",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
                "rope_theta": 5e4,
            }
        },
    ),
]


@pytest.mark.parametrize("overrides", [r[1] for r in GPT_OSS_ROPES], ids=[r[0] for r in GPT_OSS_ROPES])
def test_gpt_oss_yarn_is_read_as_transformers_reads_it(overrides, make_arch_checkpoint, hf_model, tokens):
    """Yarn's truncate flag, attention factor and mscales on gpt_oss: reference logits against transformers'."""
    base = {k: v for k, v in BY_ID["gpt_oss"][1].items() if k != "rope_parameters"}
    path = make_arch_checkpoint("gpt_oss", **base, **overrides)
    with torch.no_grad():
        hf = hf_model(path)(tokens[None]).logits[0]
    ref = ReferenceDecoder(load_checkpoint(path)).forward(tokens).logits
    assert scaled(hf, ref) < TOL, f"reference vs transformers: {scaled(hf, ref):.2e}"


def test_gpt_oss_without_rope_parameters_reads_its_config_class_yarn():
    """A config.json with a legacy rope_theta and no scaling is yarn x32 on gpt_oss (GptOssConfig's
    default), not plain RoPE at that theta."""
    from conftest import ARCH_BASE
    from transformers import AutoConfig

    from ropekv.models.hf_config import read_model_config

    full = AutoConfig.for_model("gpt_oss", **ARCH_BASE, rope_theta=1e4).to_dict()
    legacy = {k: v for k, v in full.items() if k != "rope_parameters"}
    cfg = read_model_config({**legacy, "rope_theta": 1e4})
    assert cfg == read_model_config(full)
    assert (cfg.rope.theta, cfg.rope.scaling.rope_type, cfg.rope.scaling.factor, cfg.rope.scaling.truncate) == (
        1e4,
        "yarn",
        32.0,
        False,
    )


def test_a_prefix_hit_on_a_model_with_its_own_window_is_checked(make_arch_checkpoint):
    """The default matrix's prefix-cache hit (P=13) on mistral with its own window 5: the earlier request
    must not run past the prefix (its ring would overwrite slots the hit still needs, and the fork is
    refused); before, `ropekv check DIR` stopped there with exit 2."""
    ckpt = load_checkpoint(make_arch_checkpoint("mistral", sliding_window=W))
    report = check(NativeAdapter(ckpt), cases=[Case(length=30, prefix=13, block_size=7)])
    assert report.passed and report.cases[0].max_attn_error < TOL, report.table()
