"""The store check and the cross-engine conversions on a tiny model, without vLLM.

Stored keys come from ropekv's engine (its own prefill, an implementation independent of the float64
reference the check compares with), and each fault is built by hand from them: shifted, unrotated,
rotated twice, block-local, another base, another prompt's keys. The contract check of a vLLM
producer's entry is tested with the contract a vLLM instance with another rope_theta reports.
"""

from __future__ import annotations

import pytest
import torch

from ropekv.adapters.vllm import store
from ropekv.adapters.vllm.contract import VLLMContract
from ropekv.adapters.vllm.store_check import check_entry, reference_kv
from ropekv.adapters.vllm.store_payload import handoff_of_entry, vllm_cache_contract, write_handoff
from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.errors import ContractMismatch
from ropekv.models import load_checkpoint
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.bug_class import BugClass
from ropekv.transfer.importer import export_handoff, import_handoff

B, T = 32, 64
GEN = torch.Generator().manual_seed(5)
PROMPT = torch.randint(0, 96, (70,), generator=GEN)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    ckpt = load_checkpoint(tiny_llama_dir)
    contract = CacheContract.for_model(
        ckpt.config, key_form="rotated", block_size=B, dtype="float32", weights_fingerprint=ckpt.weights_fingerprint
    )
    return ckpt, contract


def _engine(ckpt, contract) -> Engine:
    return Engine(ckpt, contract, num_blocks=8)


def _prefilled(ckpt, contract, tokens):
    engine = _engine(ckpt, contract)
    engine.prefill("p", tokens)
    return export_handoff(engine.cache, "p", tokens)


@pytest.fixture(scope="module")
def ropekv_kv(model):
    ckpt, contract = model
    h = _prefilled(ckpt, contract, PROMPT[:T])
    return h.keys, h.values


def _stored(keys, values) -> store.StoredKV:
    names = tuple(store.DEFAULT_LAYER_NAME.format(i) for i in range(len(keys)))
    return store.StoredKV(names, tuple(keys), tuple(values), keys[0].dtype, keys[0].shape[0])


def _check(model, keys, values):
    ckpt, contract = model
    ref_k, ref_v = reference_kv(ckpt, PROMPT[:T])
    return check_entry(
        _stored(keys, values), token_ids=PROMPT, contract=contract, reference_keys=ref_k, reference_values=ref_v
    )


def test_the_right_keys_match_the_float64_reference(model, ropekv_kv):
    result = _check(model, *ropekv_kv)
    assert result.ok, result.summary()
    assert all(f.error < 1e-4 and f.values_error < 1e-4 for f in result.findings)


def _turned(model, keys, positions):
    rope = model[1].rope
    t = torch.arange(T)
    return [rope.rotate(rope.unrotate(k, t), positions) for k in keys]


@pytest.mark.parametrize(
    "fault,verdict,kind",
    [
        ("shift", "shifted", BugClass.KEY_POSITION_OFFSET),
        ("raw", "raw", BugClass.MISSING_ROTATION),
        ("twice", "double_rotation", BugClass.DOUBLE_ROTATION),
        ("block_local", "block_local", BugClass.BLOCK_LOCAL_POSITION),
        ("theta", "other_frequencies", BugClass.FREQUENCY_MISMATCH),
        ("other_prompt", "other_keys", BugClass.UNKNOWN),
    ],
)
def test_each_wrong_entry_is_named_with_its_figures(model, ropekv_kv, fault, verdict, kind):
    keys, values = ropekv_kv
    t = torch.arange(T)
    rope = model[1].rope
    if fault == "shift":
        keys = _turned(model, keys, t + 7)
    elif fault == "raw":
        keys = [rope.unrotate(k, t) for k in keys]
    elif fault == "twice":
        keys = _turned(model, keys, 2 * t)
    elif fault == "block_local":
        keys = _turned(model, keys, t % B)
    elif fault == "theta":
        other = rope.replace(theta=rope.theta * 3)
        keys = [other.rotate(rope.unrotate(k, t), t) for k in keys]
    elif fault == "other_prompt":
        h = _prefilled(*model, (PROMPT[:T] + 1) % 96)
        keys, values = h.keys, h.values
    result = _check(model, keys, values)
    assert not result.ok
    assert {f.verdict for f in result.findings} == {verdict}, result.summary()
    assert result.bug_classes == (kind,)
    if fault == "shift":
        assert {f.shift for f in result.findings} == {7}
    if fault == "theta":
        assert all(abs(f.theta / (rope.theta * 3) - 1) < 1e-3 for f in result.findings)


def _vllm_contract(ckpt, **changes) -> VLLMContract:
    """What ``read_contract`` reports for a vLLM instance of this model (theta etc. as vLLM runs them)."""
    spec = ckpt.config.rope
    fields = dict(
        rope_class="RotaryEmbedding",
        rope_type="default",
        theta=float(spec.theta),
        head_dim=spec.head_dim,
        rotary_dim=spec.rotary_dim,
        layout="neox",
        scaling_factor=None,
        max_position_embeddings=spec.max_position_embeddings,
        cos_sin_dtype="float32",
        cos_sin_positions=0,
        cos_sin_max_error=None,
        same_module_all_layers=True,
        block_size=B,
        dtype="float32",
        kv_cache_dtype="auto",
        attention_backend="CPUAttentionBackendImpl",
        kernel_isa="vec",
    )
    fields.update(changes)
    return VLLMContract(**fields)


def _decode_logits(engine, seq, tokens, start):
    """Logits of the rows ``start .. len(tokens) - 1`` after an imported prefix of ``start`` tokens."""
    engine.prefill(seq, tokens[start:-1])
    return torch.stack([engine.decode(seq, tokens[-1]).logits[0]])


def test_a_vllm_entry_imports_into_ropekvs_engine_and_decodes_at_parity(model, ropekv_kv, tmp_path):
    ckpt, contract = model
    keys, values = ropekv_kv
    producer = vllm_cache_contract(ckpt, _vllm_contract(ckpt), cos_sin_tolerance=1e-3)
    assert producer == contract  # what a vLLM instance of this model runs is ropekv's contract
    entry = store.write_entry(tmp_path, PROMPT[:T], keys, values, isa="vec", block_size=B)
    stored = store.read_entry(entry, num_kv_heads=2, head_dim=16, block_size=B, isa="vec")
    engine = _engine(ckpt, contract)
    import_handoff(engine.cache, handoff_of_entry(stored, PROMPT, producer, seq_id="s"))
    logits = _decode_logits(engine, "s", PROMPT, T)
    want = ReferenceDecoder(ckpt).forward(PROMPT).logits[-1]
    assert (logits[0].double() - want).abs().max() < 1e-4


def test_a_vllm_entry_of_another_rope_theta_is_refused_at_import(model, ropekv_kv, tmp_path):
    ckpt, contract = model
    keys, values = ropekv_kv
    producer = vllm_cache_contract(ckpt, _vllm_contract(ckpt, theta=20000.0), cos_sin_tolerance=1e-3)
    stored = _stored(keys, values)
    engine = _engine(ckpt, contract)
    with pytest.raises(ContractMismatch, match="theta") as info:
        import_handoff(engine.cache, handoff_of_entry(stored, PROMPT, producer, seq_id="s"))
    assert "rope.theta" in info.value.fields
    assert not engine.cache.has("s")


def test_a_ropekv_handoff_is_written_only_for_a_consumer_of_the_same_contract(model, tmp_path):
    ckpt, contract = model
    h = _prefilled(ckpt, contract, PROMPT)  # 70 tokens: the first two blocks are written
    other = vllm_cache_contract(ckpt, _vllm_contract(ckpt, theta=20000.0), cos_sin_tolerance=1e-3)
    with pytest.raises(ContractMismatch, match="theta"):
        write_handoff(tmp_path, h, consumer=other, isa="vec")
    assert list(tmp_path.iterdir()) == []
    consumer = vllm_cache_contract(ckpt, _vllm_contract(ckpt), cos_sin_tolerance=1e-3)
    entry = write_handoff(tmp_path, h, consumer=consumer, isa="vec")
    assert entry.num_tokens == T and entry == store.find_entry(tmp_path, PROMPT[: store.consumer_tokens(70, B)])
    stored = store.read_entry(entry, num_kv_heads=2, head_dim=16, block_size=B, isa="vec")
    assert all(torch.equal(a, b[:T]) for a, b in zip(stored.keys, h.keys))


def test_a_vllm_rotation_ropekv_cannot_state_is_refused(model):
    ckpt, _ = model
    with pytest.raises(ContractMismatch, match="cannot state"):
        vllm_cache_contract(
            ckpt, _vllm_contract(ckpt, rope_type=None, rope_class="MRotaryEmbedding"), cos_sin_tolerance=1e-3
        )
    bad_table = torch.zeros(8, ckpt.config.rope.rotary_dim)
    with pytest.raises(ContractMismatch, match="cos/sin table"):
        vllm_cache_contract(ckpt, _vllm_contract(ckpt, cos_sin_table=bad_table), cos_sin_tolerance=1e-3)
