"""``ropekv handoff --engine vllm --connector example`` on real vLLM: a producer and a consumer in two
processes through vLLM's ExampleConnector. Three vLLM starts in all (one producer shared by the
module, two consumers): the correct handoff holds, a consumer with another rope_theta is named."""

from __future__ import annotations

import pytest

from ropekv.handoff import vllm_driver as d

LENGTH, STEPS = 70, 2


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-handoff")
    (work / "store").mkdir()
    options = d.Options(lengths=(LENGTH,), decode_steps=STEPS, timeout=900)
    producer = d.produce(options, work / "store", work / "p", d.prompts_for(options, forge=False))
    return work, producer


def _consume(produced, fault, name):
    import shutil

    work, producer = produced
    store = work / f"store-{name}"
    shutil.copytree(work / "store", store)
    options = d.Options(lengths=(LENGTH,), decode_steps=STEPS, timeout=900, fault=fault)
    return d.consume(options, store, work / name, producer)


def test_correct_handoff_holds_with_the_prompt_injected(produced):
    doc = _consume(produced, None, "ok")
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
    doc = _consume(produced, "consumer_rope_theta", "theta")
    assert doc["exit_code"] == 1 and not doc["passed"] and not doc["parity"]["passed"]
    fields = {x["field"]: x for x in doc["contract_differences"]}
    # the checkpoint fingerprint covers the config too, so it differs with the theta
    assert set(fields) == {"rope.theta", "model_fingerprint"}
    assert fields["rope.theta"]["consumer"] == 20000.0 and fields["rope.theta"]["producer"] == 100000.0
    assert {x["field"] for x in doc["vllm_differences"]} == {"theta"}
    assert doc["transfer"]["counters"][0]["injected_tokens"] == 64  # vLLM loaded the foreign KV silently
    assert abs(doc["first_token_logprobs"][0]["change"]) > 1e-2
    assert doc["parity"]["diagnosis"]["kind"] == "frequency_mismatch"
    assert doc["store_entries"][0]["holds"] == 0  # the store itself is right: the consumer reads it wrong
