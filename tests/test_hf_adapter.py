"""ropekv.adapters.hf: the parity harness on transformers models it was not written for.

Tiny random checkpoints (conftest's ``make_tiny_checkpoint``: hidden 64, 2 layers, 4 heads, 2 kv heads,
head_dim 16) of llama, mistral (its own sliding window 5), qwen2 and qwen3 must pass a short matrix;
a tiny llama whose decode path is patched with each catalogued position fault must fail and be named;
transformers' dynamic NTK RoPE with a cache must be caught where it starts; the model must come back
unchanged. One slow test runs the real SmolLM2-135M.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency (scripts/setup.sh): missing, the suite fails
from transformers.models.llama import modeling_llama

from ropekv import check
from ropekv.adapters.hf import HFEngine
from ropekv.errors import CheckpointError, UsageError
from ropekv.models import load_checkpoint
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import Case, token_stream
from ropekv.parity.cross_engine import cross_engine_parity
from ropekv.parity.protocol import EngineAdapter
from ropekv.rope import RopeSpec

SHORT = [Case(length=1), Case(length=17), Case(length=40, prefix=13, chunk=9)]


def _model(path: Path, attn: str = "sdpa") -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> torch.nn.Module:
    return _model(tiny_llama_dir)


def _failure(report) -> str:
    return report.table()


# ---------------------------------------------------------------------- clean models pass


@pytest.mark.parametrize(
    "arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("mistral", "sdpa"), ("qwen2", "eager"), ("qwen3", "sdpa")]
)
def test_tiny_models_pass_short_matrix(make_tiny_checkpoint: Callable[..., Path], arch: str, attn: str) -> None:
    engine = HFEngine(_model(make_tiny_checkpoint(arch), attn))
    assert isinstance(engine, EngineAdapter)
    report = check(engine, cases=SHORT)
    assert report.passed, _failure(report)
    assert all(c.ignored == ("block_size",) for c in report.cases)
    if arch == "mistral":  # its own window (5) has wrapped: the kernel read only the last 5 keys
        run = engine.run_case(Case(length=17), token_stream(96, 20))
        assert run.steps[-1].layers[0].key_positions.tolist() == [15, 16, 17, 18, 19]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_static_cache_passes(make_tiny_checkpoint: Callable[..., Path], arch: str) -> None:
    engine = HFEngine(_model(make_tiny_checkpoint(arch)), cache="static")
    report = check(engine, cases=[Case(length=17, prefix=4), Case(length=20, chunk=7)])
    assert report.passed, _failure(report)
    assert report.engine["cache"] == "StaticCache"


def test_case_window_and_sinks_run_as_a_custom_mask(llama: torch.nn.Module) -> None:
    report = check(HFEngine(llama), cases=[Case(length=30, prefix=5, window=13, sink_tokens=2, chunk=9)])
    assert report.passed, _failure(report)
    assert "custom 4D attention mask" in report.engine["windows"]


# ---------------------------------------------------------------------- the model is left as it was


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _registered() -> set[str]:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return set(AttentionInterface._global_mapping) | set(AttentionMaskInterface._global_mapping)


def test_model_restored_after_check_and_on_errors(tiny_llama_dir: Path) -> None:
    model = _model(tiny_llama_dir)
    before = (model.config._attn_implementation, _hooks(model), _registered(), model.training)
    engine = HFEngine(model)
    check(engine, cases=[Case(length=5)])
    assert (model.config._attn_implementation, _hooks(model), _registered(), model.training) == before
    with pytest.raises(IndexError):  # a token id past the vocabulary fails inside the model
        engine.run_case(Case(length=3), torch.tensor([1, 2, 10_000, 4, 5, 6]))
    assert (model.config._attn_implementation, _hooks(model), _registered(), model.training) == before
    with engine:  # a context manager keeps the probes in place across calls
        assert model.config._attn_implementation.startswith("ropekv_probe")
        engine.run_case(Case(length=3), token_stream(96, 6))
        assert model.config._attn_implementation.startswith("ropekv_probe")
    assert (model.config._attn_implementation, _hooks(model), _registered(), model.training) == before


def test_dynamic_rope_state_restored(make_tiny_checkpoint: Callable[..., Path]) -> None:
    model = _model(
        make_tiny_checkpoint(
            "llama",
            max_position_embeddings=32,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
        )
    )
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.clone()
    HFEngine(model).run_case(Case(length=40), token_stream(96, 43))
    assert rotary.max_seq_len_cached == 32 and torch.equal(rotary.inv_freq, inv_freq)


# ---------------------------------------------------------------------- checkpoint and loading


def test_checkpoint_built_from_the_object_matches_the_saved_one(tiny_qwen3_dir: Path) -> None:
    engine = HFEngine(_model(tiny_qwen3_dir))
    from_disk = load_checkpoint(tiny_qwen3_dir)
    ckpt = engine.checkpoint
    assert ckpt.config.to_dict() | {"name": ""} == from_disk.config.to_dict() | {"name": ""}
    assert all(torch.equal(ckpt.weights[k], from_disk.weights[k]) for k in from_disk.weights)
    assert ckpt.fingerprint == HFEngine(_model(tiny_qwen3_dir)).checkpoint.fingerprint


def test_model_never_saved_to_disk() -> None:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    report = check(HFEngine(model), cases=[Case(length=9, prefix=4)])
    assert report.passed, _failure(report)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: raw keys come after k_norm
def test_raw_keys_match_the_reference(make_tiny_checkpoint: Callable[..., Path], arch: str) -> None:
    engine = HFEngine(_model(make_tiny_checkpoint(arch)))
    tokens = token_stream(96, 12)
    ref = ReferenceDecoder(engine.checkpoint).forward(tokens, probe_rows=[11])
    for layer, raw in enumerate(engine.raw_keys(tokens)):
        torch.testing.assert_close(raw.double(), ref.layers[layer].k_raw, rtol=1e-4, atol=1e-4)


def test_load(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    engine = HFEngine.load(tiny_mistral_dir, dtype="bfloat16")
    assert engine.dtype == torch.bfloat16 and engine.dtype_name == "bfloat16"
    assert engine.checkpoint.config.sliding_window == 5
    with pytest.raises(CheckpointError, match="transformers directory"):
        HFEngine.load(tmp_path)
    with pytest.raises(UsageError, match="dtype"):
        HFEngine.load(tiny_mistral_dir, dtype="int8")
    with pytest.raises(UsageError, match="cache"):
        HFEngine(engine.model, cache="paged")


# ---------------------------------------------------------------------- injected decode-path faults


class _DecodeFault:
    """Stands in for ``modeling_llama.ALL_ATTENTION_FUNCTIONS``: when one query is decoded, ``fault``
    changes the query and the keys the attention function receives (the cache itself and every
    prefill and full forward stay correct), as a buggy decode kernel or cache reader would."""

    def __init__(self, real, fault):
        self.real, self.fault = real, fault

    def get_interface(self, name, default):
        fn = self.real.get_interface(name, default)

        def faulty(module, query, key, value, mask, **kwargs):
            if query.shape[-2] == 1:
                t = int(kwargs["position_ids"][0, -1])
                query, key = self.fault(query, key, t, torch.arange(key.shape[-2]))
            return fn(module, query, key, value, mask, **kwargs)

        return faulty


def _turn(spec: RopeSpec, x: torch.Tensor, by: torch.Tensor, back: RopeSpec | None = None) -> torch.Tensor:
    """Rotate token ``n`` of ``x [1, heads, N, D]`` by ``by[n]``; with ``back``, first undo ``back``'s rotation."""
    y = x[0].transpose(0, 1).double()  # [N, heads, D]
    if back is not None:
        y = back.unrotate(y, by)
    return spec.rotate(y, by).transpose(0, 1)[None].to(x.dtype)


P, B = 13, 7
ROPE = RopeSpec(head_dim=16, rotary_dim=16, theta=10000.0, max_position_embeddings=256)  # conftest TINY_BASE
FOUR_THETA, GPTJ = ROPE.replace(theta=4e4), ROPE.replace(layout="gptj")


def _newest(spec: RopeSpec):
    """The query and the newest key rotated under ``spec`` instead (the decode side's own spec)."""

    def fault(q, k, t, j):
        k = torch.cat([k[:, :, :-1], _turn(spec, k[:, :, -1:], j[-1:], back=ROPE)], dim=2)
        return _turn(spec, q, torch.tensor([t]), back=ROPE), k

    return fault


FAULTS = {
    "double_rotation": (Case(length=17, decode_steps=2), lambda q, k, t, j: (q, _turn(ROPE, k, j))),
    "missing_rotation": (Case(length=17, decode_steps=2), lambda q, k, t, j: (q, _turn(ROPE, k, -j))),
    "ignored_prefix_offset": (
        Case(length=17, prefix=P, decode_steps=2),
        lambda q, k, t, j: (_turn(ROPE, q, torch.tensor([-P])), _turn(ROPE, k, torch.where(j >= P, -P, 0))),
    ),
    "block_local_position": (
        Case(length=17, block_size=B, decode_steps=2),
        lambda q, k, t, j: (q, _turn(ROPE, k, j % B - j)),
    ),
    "query_position_offset": (
        Case(length=17, decode_steps=2),
        lambda q, k, t, j: (_turn(ROPE, q, torch.tensor([1])), k),
    ),
    "frequency_mismatch": (Case(length=17, decode_steps=2), _newest(FOUR_THETA)),
    "layout_mismatch": (
        Case(length=17, decode_steps=2),
        lambda q, k, t, j: (_turn(GPTJ, q, torch.tensor([t]), back=ROPE), _turn(GPTJ, k, j, back=ROPE)),
    ),
}


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_decode_path_faults_are_caught_and_named(
    llama: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    case, fault = FAULTS[kind]
    engine = HFEngine(llama)
    assert engine.checkpoint.config.rope == ROPE
    monkeypatch.setattr(
        modeling_llama, "ALL_ATTENTION_FUNCTIONS", _DecodeFault(modeling_llama.ALL_ATTENTION_FUNCTIONS, fault)
    )
    report = check(engine, cases=[case])
    assert not report.passed
    result = report.cases[0]
    assert result.self_passed is False  # HF's own full forward is untouched, so it disagrees too
    assert report.diagnosis.kind == kind, report.table()
    assert result.first_divergence.query_position == case.decode_positions[0]


# ---------------------------------------------------------------------- dynamic NTK: a real HF behaviour

ORIGINAL = 32  # max_position_embeddings of the dynamic variant; the case decodes positions 28..35


@pytest.fixture(scope="module")
def ntk_report(make_tiny_checkpoint: Callable[..., Path]):
    model = _model(
        make_tiny_checkpoint(
            "llama",
            max_position_embeddings=ORIGINAL,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
        )
    )
    return check(HFEngine(model), cases=[Case(length=28, decode_steps=8)])


def test_dynamic_ntk_cached_decode_diverges_past_the_original_length(ntk_report) -> None:
    assert not ntk_report.passed
    result = ntk_report.cases[0]
    fd = result.first_divergence
    assert fd.query_position == ORIGINAL and fd.against == "reference" and fd.input_matched
    tol = ntk_report.tolerances["reference"]["attn_logits"]
    errors = {t: max(e) for t, e in zip(result.positions, result.attn_errors)}
    assert all(errors[t] < tol / 10 for t in range(28, ORIGINAL))  # exact below the original length
    assert all(errors[t] > 10 * tol for t in range(ORIGINAL, 36))
    assert errors[35] > errors[ORIGINAL]  # and growing with position
    assert not result.self_passed  # HF's full forward disagrees with HF's cached decode


def test_dynamic_ntk_is_named_with_its_start(ntk_report) -> None:
    d = ntk_report.diagnosis
    assert d.kind in {"stale_dynamic_scaling", "frequency_mismatch"}, d.evidence
    assert d.details["query_position"] == ORIGINAL
    if d.kind == "stale_dynamic_scaling":
        assert d.details["first_position"] == ORIGINAL and d.details["key_seq_len"] == ORIGINAL


# ---------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_smollm2_passes_reduced_matrix() -> None:
    engine = HFEngine.load(None)
    report = check(
        engine,
        cases=[
            Case(length=17, decode_steps=2),
            Case(length=20, prefix=13, chunk=7, decode_steps=2),
            Case(length=20, window=13, decode_steps=2),
        ],
    )
    assert report.passed, _failure(report)
    assert report.model["architecture"] == "llama" and report.engine["model_class"] == "LlamaForCausalLM"


# ---------------------------------------------------------------------- cross-engine parity


def test_cross_engine_parity_catches_what_self_parity_cannot(tiny_llama_dir: Path) -> None:
    assert cross_engine_parity(HFEngine(_model(tiny_llama_dir)), length=24).passed
    model = _model(tiny_llama_dir)
    rotary = model.model.rotary_emb  # a model whose RoPE table disagrees with its config, in every path
    rotary.inv_freq.mul_(1.01)
    rotary.original_inv_freq.mul_(1.01)
    engine = HFEngine(model)
    cross = cross_engine_parity(engine, length=24)
    assert not cross.passed and cross.hidden[0] < 1e-5 < cross.attn[0]
    report = check(engine, cases=[Case(length=17)])
    assert report.cases[0].self_passed and not report.cases[0].reference_passed
