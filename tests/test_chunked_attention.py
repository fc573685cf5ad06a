"""Chunked attention (llama4's ``attention_chunk_size``): a query at position ``p`` attends to the keys
at positions ``[floor(p / C) * C, p]``. The contract names each layer's attention kind, the engine and
the reference mask by it, and an engine that reads keys of an earlier chunk fails as ``chunk_mismatch``."""

from __future__ import annotations

import json

import pytest
import torch

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.attention_kind import LayerAttention
from ropekv.bugs.registry import ARCH_FAULTS
from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.engine.attention import visibility
from ropekv.errors import ConfigError, ContractMismatch
from ropekv.models import ReferenceDecoder, load_checkpoint
from ropekv.parity.cases import Case
from ropekv.parity.recorder import visible_keys
from ropekv.rope import RopeSpec

ROPE = RopeSpec(head_dim=8, rotary_dim=8, theta=1e4)
C = 8  # chunk size: 17 + 3 tokens cross two chunk boundaries
CASES = [
    Case(length=17, block_size=7, decode_steps=3),
    Case(length=10, prefix=3, chunk=4, block_size=3, decode_steps=2),
]


def make(**changes) -> CacheContract:
    base = dict(
        key_form="rotated",
        rope=ROPE,
        num_layers=4,
        num_kv_heads=2,
        head_dim=8,
        window=5,
        window_layers=(0,),
        chunk_size=C,
        chunk_layers=(1, 3),
        block_size=4,
    )
    base.update(changes)
    return CacheContract(**base)


# ---------------------------------------------------------------------- the contract


def test_each_layer_has_one_attention_kind():
    c = make()
    assert [str(c.layer_attention(i)) for i in range(4)] == ["sliding(W=5)", "chunked(C=8)", "full", "chunked(C=8)"]
    assert c.layer_attention(1) == LayerAttention("chunked", C) and c.layer_attention(1).chunk == C
    assert c.layer_attention(0).window == 5 and c.layer_attention(2).window is None


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(chunk_layers=(0, 1)), r"layer\(s\) \[0\] are both sliding"),
        (dict(chunk_size=None), "a chunk size needs the layers"),
        (dict(chunk_layers=()), "a chunk size needs the layers"),
        (dict(chunk_size=0), "chunk_size must be an integer >= 1"),
        (dict(chunk_layers=(3, 1)), "chunk_layers must be sorted"),
        (dict(chunk_layers=(4,)), r"not a layer index in \[0, 4\)"),
    ],
)
def test_bad_chunks_raise(changes, match):
    with pytest.raises(ConfigError, match=match):
        make(**changes)


def test_require_compatible_names_the_layer_whose_kind_differs():
    full_on_3 = make(chunk_layers=(1,))
    with pytest.raises(ContractMismatch) as info:
        make().require_compatible(full_on_3)
    assert "layers.3.attention" in info.value.fields and "layers.1.attention" not in info.value.fields
    assert "layers.3.attention: cache='chunked(C=8)', writer='full' (on layer 3:" in str(info.value)
    other_size = make(chunk_size=16)
    fields = {d.field for d in make().diff(other_size)}
    assert fields == {"chunk_size", "layers.1.attention", "layers.3.attention"}


def test_chunked_json_round_trips_and_chunk_free_contracts_leave_chunks_out():
    c = make()
    data = json.loads(c.to_json())
    assert data["version"] == 5 and data["chunk_size"] == C and data["chunk_layers"] == [1, 3]
    assert CacheContract.from_json(c.to_json()) == c
    plain = make(chunk_size=None, chunk_layers=())
    data = json.loads(plain.to_json())
    assert data["version"] == 5 and "chunk_size" not in data and "chunk_layers" not in data
    assert CacheContract.from_json(plain.to_json()) == plain
    bad = json.loads(c.to_json())
    bad["chunk_layers"] = []
    with pytest.raises(ConfigError, match="chunk_layers must be a non-empty list"):
        CacheContract.from_json(json.dumps(bad))


# ---------------------------------------------------------------------- the mask


def test_chunked_mask_is_the_query_s_own_chunk():
    keys = torch.arange(20)
    for p in (0, 7, 8, 15, 16, 19):
        expected = (keys <= p) & (keys >= (p // C) * C)  # written out: [floor(p/C)*C, p]
        assert torch.equal(visibility(torch.tensor([p]), keys, None, 0, C)[0], expected)
        assert torch.equal(visible_keys(torch.tensor([p]), keys, None, 0, C)[0], expected)
    assert int(visibility(torch.tensor([16]), keys, None, 0, C).sum()) == 1  # a chunk's first query sees itself


# ---------------------------------------------------------------------- the engine and the reference


@pytest.fixture(scope="module")
def chunked_llama(make_arch_checkpoint):
    """The tiny llama with layer 0 chunked (C=8) and layer 1 full: chunking is data on the config."""
    ckpt = load_checkpoint(make_arch_checkpoint("llama"))
    cfg = ckpt.config.replace(layer_types=("chunked_attention", "full_attention"), attention_chunk_size=C)
    return ckpt.with_config(cfg)


def test_reference_masks_earlier_chunks(chunked_llama):
    """Written-out check: a chunked layer's output at position p depends on no token before its chunk."""
    ref = ReferenceDecoder(chunked_llama)
    tokens = torch.randint(0, chunked_llama.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    changed = tokens.clone()
    changed[:8] = (changed[:8] + 1) % chunked_llama.config.vocab_size  # the first chunk only
    a = ref.forward(tokens, probe_rows=[17]).layers
    b = ref.forward(changed, probe_rows=[17]).layers
    # Layer 1's input at 17 is layer 0's output there, which reads only the keys 16 and 17 (chunk [16, 24)).
    assert torch.allclose(a[1].hidden_in, b[1].hidden_in)
    full = ReferenceDecoder(
        chunked_llama.with_config(
            chunked_llama.config.replace(layer_types=("full_attention", "full_attention"), attention_chunk_size=None)
        )
    )
    assert not torch.allclose(
        full.forward(tokens, probe_rows=[17]).layers[1].hidden_in,
        full.forward(changed, probe_rows=[17]).layers[1].hidden_in,
    )


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_engine_honours_chunked_layers(chunked_llama, key_form):
    contract = CacheContract.for_model(chunked_llama.config, key_form=key_form, block_size=5)
    assert contract.chunk_layers == (0,) and contract.chunk_size == C
    tokens = torch.randint(0, chunked_llama.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    ref = ReferenceDecoder(chunked_llama).forward(tokens).logits
    engine = Engine(chunked_llama, contract)
    engine.prefill("s", tokens[:14], chunk_size=5)  # prefill chunks that do not line up with C
    for t in range(14, 24):
        out = engine.decode("s", int(tokens[t]))
        err = float((out.logits[0].double() - ref[t]).abs().max() / max(1.0, float(ref[t].abs().max())))
        assert err < 1e-5, f"decode at {t}: {err:.2e}"


def test_check_passes_on_chunked_layers_and_the_fault_is_named(chunked_llama):
    report = check(NativeAdapter(chunked_llama), cases=CASES)
    assert report.passed, report.table()
    fault = ARCH_FAULTS["chunked-layers-read-earlier-chunks"]
    report = check(fault.adapter(chunked_llama), cases=CASES)
    assert not report.passed
    assert report.diagnosis.kind == "chunk_mismatch", report.table()
    assert "of earlier chunks (chunk size 8" in report.diagnosis.evidence
    fd = next(c for c in report.cases if not c.passed).first_divergence
    assert fd.layer == 0 and fd.query_position >= C  # nothing to read wrongly inside the first chunk


# ---------------------------------------------------------------------- llama4: chunks from the config

LLAMA4 = {
    "num_hidden_layers": 2,
    "attention_chunk_size": C,
    "no_rope_layer_interval": 2,
    "floor_scale": 4,
    "attn_scale": 0.5,
    "num_local_experts": 4,
    "interleave_moe_layer_step": 2,
    "intermediate_size_mlp": 80,
}


@pytest.fixture(scope="module")
def llama4(make_arch_checkpoint):
    return load_checkpoint(make_arch_checkpoint("llama4_text", **LLAMA4))


def test_llama4_contract_has_its_chunked_layers(llama4):
    cfg = llama4.config
    assert cfg.layer_types == ("chunked_attention", "full_attention") and cfg.attention_chunk_size == C
    contract = CacheContract.for_model(cfg, key_form="rotated")
    assert str(contract.layer_attention(0)) == "chunked(C=8)" and str(contract.layer_attention(1)) == "full"
    assert contract.layer_rope(1) is None  # the full layer is the NoPE one


@pytest.mark.parametrize(
    "fault,kind,layer",
    [
        ("chunked-layers-read-earlier-chunks", "chunk_mismatch", 0),
        ("layout-mismatch", "layout_mismatch", 0),  # llama4 pairs channels 2m, 2m+1 (complex pairs)
    ],
)
def test_llama4_faults_are_named(llama4, fault, kind, layer):
    from ropekv.bugs.registry import get_fault

    report = check(get_fault(fault).adapter(llama4), cases=CASES)
    assert not report.passed and report.diagnosis.kind == kind, report.table()
    assert next(c for c in report.cases if not c.passed).first_divergence.layer == layer


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_llama4_layer_types_follow_no_rope_layers_when_absent(make_arch_checkpoint):
    from ropekv.models.hf_config import read_model_config

    config = _config(make_arch_checkpoint("llama4_text", **LLAMA4))
    del config["layer_types"]
    config["no_rope_layers"] = [0, 1]  # Llama4TextConfig: 1 = the layer rotates (and is chunked)
    cfg = read_model_config(config)
    assert cfg.layer_types == ("full_attention", "chunked_attention")
    assert cfg.layer_rope(0) is None and cfg.layer_rope(1) is not None
    assert cfg.layer_temperature(0) and not cfg.layer_temperature(1)
    assert not cfg.layer_qk_norm(0) and cfg.layer_qk_norm(1)  # the L2 norm only where the layer rotates


def test_l2_qk_norm_with_a_rope_attention_factor_is_refused(make_arch_checkpoint):
    """transformers normalizes after RoPE, dividing yarn's attention factor out again: not modelled."""
    from ropekv.models.hf_config import read_model_config

    config = _config(make_arch_checkpoint("llama4_text", **LLAMA4))
    config["rope_parameters"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 1e4,
    }
    with pytest.raises(ConfigError, match="L2 q/k norm after RoPE with a RoPE attention factor"):
        read_model_config(config)
    config["use_qk_norm"] = False
    assert read_model_config(config).rope.attention_factor > 1.0  # without the norm it is read


def test_chunked_layers_on_an_architecture_without_them_are_refused(make_arch_checkpoint):
    from ropekv.models.hf_config import read_model_config

    config = {
        **_config(make_arch_checkpoint("llama")),
        "layer_types": ["chunked_attention", "full_attention"],
        "attention_chunk_size": 8,
    }
    with pytest.raises(ConfigError, match="transformers' llama has no chunked attention"):
        read_model_config(config)
