"""``ropekv handoff --engine vllm`` on real vLLM: a producer and a consumer in two processes, through
vLLM's ExampleConnector and through ropekv's ContractConnector. Five vLLM starts in all: one producer
shared by the module, of the contract connector (its store is the ExampleConnector's files plus a
sidecar per entry, so it serves both consumers), and four consumers: through the bare connector the
correct handoff holds and a consumer with another rope_theta is named; through the contract connector
the correct handoff holds and that consumer is refused (exit 3) naming rope.theta."""

from __future__ import annotations

import shutil

import pytest

from ropekv.adapters.vllm.sidecar import REFUSALS, SIDECAR
from ropekv.errors import ContractMismatch
from ropekv.handoff import vllm_driver as d

LENGTH, STEPS = 70, 2


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-handoff")
    (work / "store").mkdir()
    options = d.Options(lengths=(LENGTH,), decode_steps=STEPS, timeout=900, connector="ropekv")
    producer = d.produce(options, work / "store", work / "p", d.prompts_for(options, forge=False))
    return work, producer


def _consume(produced, fault, name, connector="example"):
    work, producer = produced
    store = work / f"store-{name}"
    shutil.copytree(work / "store", store)
    options = d.Options(lengths=(LENGTH,), decode_steps=STEPS, timeout=900, fault=fault, connector=connector)
    return d.consume(options, store, work / name, producer), store


def test_correct_handoff_holds_with_the_prompt_injected(produced):
    doc, _ = _consume(produced, None, "ok")
    assert doc["exit_code"] == 0 and doc["passed"] and doc["parity"]["passed"]
    (n,) = doc["transfer"]["counters"]
    # whole blocks of the prompt but its last token: 64 of 70 from the store, by vLLM's own counter
    assert n["injected_tokens"] == 64 and n["num_cached_tokens"] == 64 and n["recomputed_tokens"] == 6
    assert doc["contract_differences"] == [] and not doc["transfer"]["store_changed_by_consumer"]
    # the first token over injected KV is the producer's own (computed by its full prefill)
    assert abs(doc["first_token_logprobs"][0]["change"]) < 1e-4
    assert doc["parity"]["cases"][0]["max_self_attn_error"] < 1e-4
    # the entry, decoded for the producer's kernel ISA, is exactly the producer's hooked post-RoPE keys
    assert doc["store_entries"][0]["holds"] == 0 and doc["store_entries"][0]["errors"][0] == 0.0


def test_consumer_with_another_rope_theta_is_named(produced):
    doc, _ = _consume(produced, "consumer_rope_theta", "theta")
    assert doc["exit_code"] == 1 and not doc["passed"] and not doc["parity"]["passed"]
    fields = {x["field"]: x for x in doc["contract_differences"]}
    # the same weights under another theta: the RoPE field is named, the weights are not
    assert set(fields) == {"rope.theta"}
    assert fields["rope.theta"]["consumer"] == 20000.0 and fields["rope.theta"]["producer"] == 100000.0
    assert {x["field"] for x in doc["vllm_differences"]} == {"theta"}
    assert doc["transfer"]["counters"][0]["injected_tokens"] == 64  # vLLM loaded the foreign KV silently
    assert abs(doc["first_token_logprobs"][0]["change"]) > 1e-2
    assert doc["parity"]["diagnosis"]["kind"] == "frequency_mismatch"
    assert doc["store_entries"][0]["holds"] == 0  # the store itself is right: the consumer reads it wrong


def test_contract_connector_holds_and_refuses_another_rope_theta(produced):
    doc, store = _consume(produced, None, "ropekv-ok", connector="ropekv")
    assert doc["exit_code"] == 0 and doc["passed"] and doc["parity"]["passed"]
    (n,) = doc["transfer"]["counters"]
    assert n["injected_tokens"] == 64 and n["num_cached_tokens"] == 64 and n["recomputed_tokens"] == 6
    assert not (store / REFUSALS).exists()  # checked, read back unchanged before attention, injected
    assert doc["store_entries"][0]["holds"] == 0 and doc["store_entries"][0]["errors"][0] == 0.0
    (entry,) = doc["transfer"]["prompts"][0]["entries"]
    assert (store / entry / SIDECAR).is_file()

    with pytest.raises(ContractMismatch) as info:
        _consume(produced, "consumer_rope_theta", "ropekv-theta", connector="ropekv")
    error = info.value
    assert error.exit_code == 3 and "rope.theta" in error.fields
    # the consumer's value and the producer's, with the handshake's consequence wording
    assert "20000" in str(error) and "100000" in str(error) and "policy fail" in str(error)
