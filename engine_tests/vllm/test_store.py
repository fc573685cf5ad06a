"""vLLM's ExampleConnector store, decoded and crossed with ropekv's engine, on one real vLLM instance.

One instance (float32, kernel ``vec``, block 32, prefix caching off so a repeated prompt goes through
the connector) with ``ExampleConnector`` as ``kv_both``: a prompt it has not seen is stored (the
producer's path), a prompt whose entry exists is injected (the consumer's path). On it:

- the producer's files: their directory name is ropekv's :func:`entry_key`, they carry no metadata,
  and unpacked by ropekv they are exactly the producer's own post-RoPE keys (hooked on vLLM's
  ``Attention`` module), while the raw rows are not; against the float64 reference they match;
- ropekv's engine as producer: its prefill written as the entry, vLLM injects it (its first forward
  then starts at position 64) and decodes; parity against the float64 reference and vLLM's own full
  prefill;
- vLLM as producer: the entry imported into ropekv's engine under the contract read off vLLM's
  model, decoded there; parity against the float64 reference.

The layout measurement (cell orders of keys and values per ISA, with vLLM's own cache writer and the
connector's extraction rule) needs no engine and runs first.
"""

from __future__ import annotations

import pytest
import torch
from conftest import BLOCK
from safetensors import safe_open

from ropekv.adapters.vllm import kv_layout, store
from ropekv.adapters.vllm.engine import cos_sin_tolerance
from ropekv.adapters.vllm.store_check import check_entry, relative_error
from ropekv.adapters.vllm.store_payload import handoff_of_entry, vllm_cache_contract, write_handoff
from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import token_stream
from ropekv.transfer.importer import export_handoff, import_handoff

N = 70  # prompt tokens: two whole blocks (64) go through the store, 6 are computed by the consumer
STEPS = 3  # greedy decode steps compared
TOP = 20
F32_LOGPROB = 1e-3  # float32 engines sit at 2e-5..4e-5 from the float64 reference (docs/engines/vllm.md)


@pytest.mark.parametrize("isa,dtype", [("vec", torch.float32), ("vec16", torch.float32), ("amx", torch.bfloat16)])
def test_unpack_inverts_vllms_writer_and_the_connectors_extraction(isa, dtype):
    from vllm import _custom_ops as ops

    B, D, H = BLOCK, 64, 3
    cache = torch.zeros(4, H, B, 2 * D, dtype=dtype)  # [num_blocks, KVH, B, 2D], vLLM's CPU layout
    key_cache, value_cache = kv_layout.kernel_views(cache)
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2 * B, H, D, generator=g).to(dtype), torch.randn(2 * B, H, D, generator=g).to(dtype)
    slots = (torch.tensor([2, 0])[:, None] * B + torch.arange(B)).flatten()  # blocks 2 and 0, in that order
    try:
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    except RuntimeError as exc:  # amx where this processor's build has no writer for it
        assert isa == "amx" and "Unsupported CPU attention configuration" in str(exc)
        return
    saved = cache[slots // B, :, slots % B]  # ExampleConnector's extract_kv_from_layer
    k, v = store.unpack(saved, block_size=B, isa=isa)
    assert torch.equal(k, keys) and torch.equal(v, values)
    assert torch.equal(store.pack(keys, values, block_size=B, isa=isa), saved)


_KEEP = []  # vLLM instances stay alive for the process: one collected mid-process tears down vLLM's groups


@pytest.fixture(scope="module")
def connector(request, tmp_path_factory):
    """The vLLM instance, its store, the prompt, what the producer run stored and hooked, and the
    float64 reference over the prompt and vLLM's greedy continuation.

    The worker side of a KV connector is one per process (``ensure_kv_transfer_initialized`` keeps the
    first): while it exists, every other in-process vLLM instance's step asserts on its missing
    connector metadata, and a later connector instance would run this one's. So it is shut down when
    this module's tests are done; the instance itself is kept alive."""
    from conftest import ENGINE_KWARGS
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.inputs import TokensPrompt

    from ropekv.adapters.vllm import VLLMEngine

    root = tmp_path_factory.mktemp("vllm_store")
    config = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config={"shared_storage_path": str(root)}
    )
    kwargs = {**ENGINE_KWARGS, "max_num_batched_tokens": 128}  # the prompt in one forward
    engine = VLLMEngine(None, dtype="float32", enable_prefix_caching=False, kv_transfer_config=config, **kwargs)
    _KEEP.append(engine)
    request.addfinalizer(ensure_kv_transfer_shutdown)
    cfg = engine.checkpoint.config
    prompt = token_stream(cfg.vocab_size, N).tolist()
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=TOP, detokenize=False, ignore_eos=True)

    def generate():
        engine.probes.reset()
        with engine.probes.installed():
            out = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        return out, list(engine.probes.forwards)

    out, forwards = generate()
    assert forwards[0].positions.tolist() == list(range(N))  # a full prefill: nothing came from the store
    tokens = prompt + list(out.outputs[0].token_ids)
    entry = store.find_entry(root, prompt[: store.producer_tokens(N, BLOCK)])
    assert entry is not None
    stored = store.read_entry(
        entry, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=BLOCK, isa=engine.contract.kernel_isa
    )
    reference = ReferenceDecoder(engine.checkpoint).forward(torch.tensor(tokens), probe_rows=[len(tokens) - 1])
    yield dict(
        engine=engine,
        root=root,
        prompt=prompt,
        tokens=tokens,
        generate=generate,
        entry=entry,
        stored=stored,
        hooked=[forwards[0].layers[i].k_rot for i in range(cfg.num_layers)],  # [N, KVH, D] each
        full_prefill=out,
        reference=reference,
    )


def _contracts(engine):
    """(what the vLLM instance runs, ropekv's engine contract for the same model) as CacheContracts."""
    ckpt = engine.checkpoint
    vllm_side = vllm_cache_contract(ckpt, engine.contract, cos_sin_tolerance=cos_sin_tolerance(engine.dtype))
    ours = CacheContract.for_model(
        ckpt.config, key_form="rotated", block_size=BLOCK, dtype="float32", weights_fingerprint=ckpt.weights_fingerprint
    )
    return vllm_side, ours


def _reference_logprobs(reference, rows):
    return torch.log_softmax(reference.logits[rows].double(), dim=-1)  # [R, vocab]


def _vllm_vs_reference(out, reference, start) -> float:
    """Largest |vLLM logprob - reference logprob| over vLLM's top-k of each decode step."""
    ref = _reference_logprobs(reference, list(range(start, start + STEPS)))
    worst = 0.0
    for s, row in enumerate(out.outputs[0].logprobs[:STEPS]):
        for token, lp in row.items():
            worst = max(worst, abs(lp.logprob - float(ref[s, token])))
    return worst


def test_the_producers_files_are_its_hooked_keys_in_vllms_block_layout(connector):
    entry, stored, hooked = connector["entry"], connector["stored"], connector["hooked"]
    T = store.producer_tokens(N, BLOCK)
    assert [p.name for p in connector["root"].iterdir()] == [store.entry_key(connector["prompt"][:T])]
    assert entry.num_tokens == T == 64 and entry.num_layers == 30
    assert entry.layer_names[7] == "model.layers.7.self_attn.attn"
    with safe_open(str(entry.path(0)), "pt") as f:
        assert f.metadata() is None and list(f.keys()) == ["kv_cache"]
        raw = f.get_tensor("kv_cache")
    assert tuple(raw.shape) == (64, 3, 128) and raw.dtype == torch.float32
    for i in range(entry.num_layers):
        assert torch.equal(stored.keys[i], hooked[i][:T]), f"layer {i}"
    # read as [token, head, key | value] rows, the file is other tokens' channels
    assert relative_error(raw[:, :, :64], hooked[0][:T]) > 0.5
    ref = connector["reference"].layers
    result = check_entry(
        stored,
        token_ids=connector["prompt"],
        contract=_contracts(connector["engine"])[0],
        reference_keys=[p.k for p in ref],
        reference_values=[p.v for p in ref],
    )
    print("\n".join(result.summary()))
    assert result.ok, result.summary()


def test_vllm_decodes_ropekvs_prefill_injected_through_the_store(connector):
    engine, prompt = connector["engine"], connector["prompt"]
    vllm_side, ours = _contracts(engine)
    producer = Engine(engine.checkpoint, ours, num_blocks=8)
    producer.prefill("p", torch.tensor(prompt))
    handoff = export_handoff(producer.cache, "p", torch.tensor(prompt))
    entry = write_handoff(
        connector["root"], handoff, consumer=vllm_side, isa=engine.contract.kernel_isa, overwrite=True
    )
    assert entry.key == connector["entry"].key and entry.num_tokens == store.consumer_tokens(N, BLOCK)
    out, forwards = connector["generate"]()
    assert forwards[0].positions.tolist() == list(range(64, N))  # 64 tokens injected, 6 computed
    assert list(out.outputs[0].token_ids) == connector["tokens"][N:]
    vs_reference = _vllm_vs_reference(out, connector["reference"], N - 1)
    own = connector["full_prefill"].outputs[0].logprobs
    vs_own = max(
        abs(lp.logprob - own[s][t].logprob)
        for s, row in enumerate(out.outputs[0].logprobs[:STEPS])
        for t, lp in row.items()
        if t in own[s]
    )
    full = _vllm_vs_reference(connector["full_prefill"], connector["reference"], N - 1)
    print(
        f"vLLM decoding ropekv's KV: max |dlogprob| {vs_reference:.3g} vs float64 reference, {vs_own:.3g} vs "
        f"vLLM's own full prefill (which is {full:.3g} from the reference)"
    )
    assert vs_reference < F32_LOGPROB and vs_own < F32_LOGPROB


def test_ropekv_decodes_vllms_stored_prefill(connector):
    engine, prompt, tokens = connector["engine"], connector["prompt"], connector["tokens"]
    vllm_side, ours = _contracts(engine)
    stored = connector["stored"]
    decode = Engine(engine.checkpoint, ours, num_blocks=8)
    import_handoff(decode.cache, handoff_of_entry(stored, prompt, vllm_side, seq_id="s"))
    T = stored.num_tokens
    logits = [decode.prefill("s", torch.tensor(tokens[T:N]))]
    for t in tokens[N : N + STEPS - 1]:
        logits.append(decode.decode("s", t).logits[0])
    got = torch.log_softmax(torch.stack(logits).double(), dim=-1)
    want = _reference_logprobs(connector["reference"], list(range(N - 1, N - 1 + STEPS)))
    dlogit = float((torch.stack(logits).double() - connector["reference"].logits[N - 1 : N - 1 + STEPS]).abs().max())
    dlogprob = float((got - want).abs().max())
    print(f"ropekv decoding vLLM's KV: max |dlogit| {dlogit:.3g}, max |dlogprob| {dlogprob:.3g} vs float64 reference")
    assert dlogprob < F32_LOGPROB
