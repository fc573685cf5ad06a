"""ropekv's ContractConnector on real vLLM: a producer and two consumers, each in its own process.

The producer stores one 70-token prompt (64 tokens: whole blocks) and its decode is the plain run
every consumer's output is compared with (vLLM's own uncached path). The consumer with the producer's
model and ``kv_load_failure_policy="recompute"`` injects the entry when the contract matches, and
refuses each forged sidecar naming the field, computing the prompt itself; the consumer started with
another rope_theta (``hf_overrides``, ``"fail"``) refuses the producer's real entry and vLLM fails the
request. The three processes start together (a vLLM start costs 15-60 s on two cores).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from connector_tools import Instance

from ropekv.adapters.vllm.sidecar import REFUSALS, SIDECAR, Sidecar, write_sidecar
from ropekv.rope import RopeScaling

PROMPT = [1000 + 7 * i % 4000 for i in range(70)]
STORED = 64  # whole blocks of 32 below the last prompt token
THETA_20000 = {"rope_theta": 20000, "rope_parameters": {"rope_type": "default", "rope_theta": 20000}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """``(store, entry, pristine copy of the entry, the producer's plain run, {"recompute", "fail"})``;
    module-scoped: the consumers exit when this file's tests are done, not at the end of the session."""
    base = tmp_path_factory.mktemp("connector")
    store = base / "store"
    store.mkdir()
    spec = {"connector": "ContractConnector", "store": str(store)}
    producer = Instance("producer", {**spec, "role": "kv_producer"}, base)
    consumers = {
        "recompute": Instance("consumer-recompute", {**spec, "role": "kv_consumer", "policy": "recompute"}, base),
        "fail": Instance(
            "consumer-theta-20000",
            {**spec, "role": "kv_consumer", "policy": "fail", "hf_overrides": THETA_20000},
            base,
        ),
    }
    try:
        plain = producer.request(PROMPT)
        producer.close()
        (entry,) = [p for p in store.iterdir() if p.is_dir()]
        pristine = base / "pristine"
        shutil.copytree(entry, pristine)
        yield store, entry, pristine, plain, consumers
    finally:
        for instance in (producer, *consumers.values()):
            instance.close()


def restore(entry: Path, pristine: Path) -> None:
    shutil.rmtree(entry)
    shutil.copytree(pristine, entry)


INJECTED = "ropekv contract connector: inject 64 checked tokens"


def refusals(store: Path) -> list[dict]:
    path = store / REFUSALS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_producer_writes_the_contract_beside_the_kv(world):
    store, entry, _, plain, _ = world
    sidecar = Sidecar.from_json((entry / SIDECAR).read_text())
    assert plain["finish_reason"] == "length" and plain["num_cached_tokens"] == 0
    assert sidecar.num_tokens == STORED and sidecar.position_start == 0
    assert sidecar.engine.contract.rope.theta == 100000.0  # SmolLM2's config.json
    assert sidecar.engine.contract.key_form == "rotated" and sidecar.engine.kernel_isa == "vec"
    assert [f.name for f in sidecar.layers] == [f"model.layers.{i}.self_attn.attn.safetensors" for i in range(30)]


def test_matching_contract_injects_and_decodes_as_the_plain_run(world):
    store, entry, pristine, plain, consumers = world
    restore(entry, pristine)
    before, injected = len(refusals(store)), consumers["recompute"].log_text().count(INJECTED)
    out = consumers["recompute"].request(PROMPT)
    assert consumers["recompute"].log_text().count(INJECTED) == injected + 1
    assert out["num_cached_tokens"] == STORED  # vLLM's own counter: 64 tokens came through the connector
    assert out["token_ids"] == plain["token_ids"]
    assert out["logprobs"] == plain["logprobs"]  # bit for bit: the same float32 keys and values
    assert len(refusals(store)) == before


def _forge(**engine_changes):
    def forge(entry: Path) -> None:
        sidecar = Sidecar.from_json((entry / SIDECAR).read_text())
        contract_changes = engine_changes.get("contract")
        engine = sidecar.engine
        if contract_changes is not None:
            engine = dataclasses.replace(engine, contract=contract_changes(engine.contract))
        write_sidecar(entry, dataclasses.replace(sidecar, engine=engine, **engine_changes.get("entry", {})))

    return forge


def _rope(**changes):
    return lambda c: c.replace(rope=c.rope.replace(**changes))


def _corrupt(entry: Path) -> None:
    path = entry / "model.layers.7.self_attn.attn.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # one bit of one value
    path.write_bytes(bytes(data))


def _truncate(entry: Path) -> None:
    path = entry / "model.layers.29.self_attn.attn.safetensors"
    path.write_bytes(path.read_bytes()[:-4096])


FORGERIES = {
    "rope_theta": (_forge(contract=_rope(theta=20000.0)), "rope.theta"),
    "rope_scaling": (
        _forge(contract=_rope(scaling=RopeScaling(rope_type="linear", factor=2.0))),
        "rope.scaling.rope_type",
    ),
    "fingerprint": (
        _forge(contract=lambda c: c.replace(weights_fingerprint="0123456789abcdef")),
        "weights_fingerprint",
    ),
    "dtype": (_forge(contract=lambda c: c.replace(dtype="bfloat16")), "dtype"),
    "positions": (_forge(entry={"position_start": 32}), "positions"),
    "checksum": (_corrupt, "checksum.layers.7"),
    "truncated": (_truncate, "checksum.layers.29"),
    "missing_sidecar": (lambda entry: (entry / SIDECAR).unlink(), "sidecar"),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_entry_is_refused_and_recomputed(world, name):
    store, entry, pristine, plain, consumers = world
    forge, field = FORGERIES[name]
    restore(entry, pristine)
    forge(entry)
    before, injected = refusals(store), consumers["recompute"].log_text().count(INJECTED)
    out = consumers["recompute"].request(PROMPT)
    (record,) = refusals(store)[len(before) :]
    assert consumers["recompute"].log_text().count(INJECTED) == injected
    assert field in record["fields"], record
    assert record["policy"] == "recompute" and record["key"] == entry.name
    assert record["message"].startswith("consumer and producer cache contracts differ")
    assert out["num_cached_tokens"] == 0  # nothing came through the connector
    assert out["token_ids"] == plain["token_ids"]
    assert out["logprobs"] == plain["logprobs"]  # bit for bit: the same float32 keys and values


FAILED = {"token_ids": [], "logprobs": [], "num_cached_tokens": 0, "finish_reason": "error"}


@pytest.mark.parametrize(
    "forge, fields, values",
    [
        (None, ["rope.theta"], "rope.theta: consumer=20000.0, producer=100000.0"),
        (FORGERIES["missing_sidecar"][0], ["sidecar"], "sidecar: consumer='a contract sidecar', producer='none'"),
    ],
    ids=["real_rope_theta_20000", "missing_sidecar"],
)
def test_fail_policy_fails_the_request_and_injects_nothing(world, forge, fields, values):
    """The consumer started with rope_theta 20000 against the producer's real entry (100000), and the
    same consumer facing an entry without sidecar: each refused, and vLLM fails the request."""
    store, entry, pristine, _, consumers = world
    restore(entry, pristine)
    if forge is not None:
        forge(entry)
    before, failed = refusals(store), consumers["fail"].log_text().count("Failing 1 request(s)")
    out = consumers["fail"].request(PROMPT)
    (record,) = refusals(store)[len(before) :]
    assert record["fields"] == fields and record["policy"] == "fail", record
    assert values in record["message"]
    assert out == FAILED  # no token: vLLM finished the request with an error
    log = consumers["fail"].log_text()
    assert (
        log.count("Failing 1 request(s) due to KV load failure (failure_policy=fail, 64 tokens affected)") == failed + 1
    )
    assert INJECTED not in log
