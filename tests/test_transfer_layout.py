"""The block layout across a transfer: named by the contract, refused when it differs, and when a
sender does not name it (the receiver reads heads-outer blocks as tokens-outer ones) caught and named
``block_layout_mismatch`` with the moved (row, head) cells in the evidence."""

import json

import pytest
import torch

from ropekv import check
from ropekv.bugs.registry import HANDOFF_FAULTS, get_handoff_fault
from ropekv.cache.block_layout import HEADS_OUTER, TOKENS_OUTER, misread_rows, misread_source
from ropekv.cli.main import main
from ropekv.contract import BLOCK_LAYOUTS, CacheContract
from ropekv.engine import Engine
from ropekv.errors import ConfigError, ContractMismatch
from ropekv.handoff.adapter import HandoffAdapter
from ropekv.models import load_checkpoint
from ropekv.parity.cases import Case
from ropekv.parity.protocol import Tier
from ropekv.testing.tiers import at_tier
from ropekv.transfer import read_payload, write_payload
from ropekv.transfer.handshake import decide
from ropekv.transfer.importer import export_handoff, import_handoff

FAULT = "receiver-reads-heads-as-block"


@pytest.fixture(scope="module")
def ckpt(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


def contract(ckpt, layout=TOKENS_OUTER, block_size=4):
    return CacheContract.for_model(ckpt.config, key_form="rotated", block_size=block_size).replace(block_layout=layout)


def prefilled(ckpt, c, n=10):
    engine = Engine(ckpt, c, 16)
    engine.prefill("s", torch.arange(5, 5 + n))
    return engine


# ---------------------------------------------------------------------- the contract names it


def test_layouts_are_the_two_spellings_and_others_are_refused(ckpt):
    assert BLOCK_LAYOUTS == (TOKENS_OUTER, HEADS_OUTER) == ("blocks,2,block,heads,dim", "blocks,2,heads,block,dim")
    with pytest.raises(ConfigError, match="block_layout"):
        contract(ckpt, layout="blocks,heads,2,block,dim")


def test_default_layout_keeps_the_format_and_the_other_travels_in_the_json(ckpt):
    default, heads = contract(ckpt), contract(ckpt, HEADS_OUTER)
    assert "block_layout" not in default.to_dict()  # contracts before the field read and hash the same
    assert CacheContract.from_json(heads.to_json()).block_layout == HEADS_OUTER
    assert CacheContract.from_json(default.to_json()).block_layout == TOKENS_OUTER


@pytest.mark.parametrize("ours, theirs", [(TOKENS_OUTER, HEADS_OUTER), (HEADS_OUTER, TOKENS_OUTER)])
def test_a_layout_mismatch_is_refused_naming_the_field(ckpt, ours, theirs):
    verdict = decide(contract(ckpt, ours), contract(ckpt, theirs), "explicit", rank=1)
    assert not verdict.accepted and verdict.fields == ("block_layout",)
    assert f"decode={ours!r}, prefill={theirs!r}" in verdict.message
    assert "heads and tokens swapped" in verdict.message
    sender = prefilled(ckpt, contract(ckpt, theirs))
    receiver = prefilled(ckpt, contract(ckpt, ours))
    before = receiver.cache.state_digest()
    payload = read_payload(write_payload(export_handoff(sender.cache, "s", torch.arange(5, 15))))
    with pytest.raises(ContractMismatch) as e:
        import_handoff(receiver.cache, payload, seq_id="t")
    assert e.value.fields == ("block_layout",) and receiver.cache.state_digest() == before


# ---------------------------------------------------------------------- the bytes on the wire


def test_payload_lays_keys_out_as_its_contract_says(ckpt):
    """Heads-outer: tensor [blocks, KVH, block, D], 10 rows in 3 blocks of 4 (2 padding rows)."""
    engine = prefilled(ckpt, contract(ckpt, HEADS_OUTER))
    h = export_handoff(engine.cache, "s", torch.arange(5, 15))
    data = write_payload(h)
    from safetensors.torch import load

    wire = load(data)["layers.0.keys"]
    kvh, d = ckpt.config.num_kv_heads, ckpt.config.head_dim
    assert tuple(wire.shape) == (3, kvh, 4, d)
    for row in range(10):  # block row // 4, offset row % 4: by hand
        for head in range(kvh):
            assert torch.equal(wire[row // 4, head, row % 4], h.keys[0][row, head])
    assert torch.count_nonzero(wire[2, :, 2:]) == 0
    back = read_payload(data)
    assert all(torch.equal(a, b) for a, b in zip(back.keys + back.values, h.keys + h.values))


def test_misread_is_the_same_bytes_in_another_shape():
    """4 heads, block 4: reading [heads, block] as [block, heads] transposes each block."""
    rows = torch.arange(8 * 4 * 1, dtype=torch.float32).view(8, 4, 1)  # value = row * 4 + head
    got = misread_rows(rows, HEADS_OUTER, TOKENS_OUTER, 4)
    for row in range(8):
        for head in range(4):
            b, o = divmod(row, 4)
            assert got[row, head, 0] == (b * 4 + head) * 4 + o  # sent (row b*4 + head, head o)
            assert misread_source(row, head, HEADS_OUTER, TOKENS_OUTER, 4, 4) == (b * 4 + head, o)
    assert misread_source(3, 1, HEADS_OUTER, TOKENS_OUTER, 4, 4) == (1, 3)


# ---------------------------------------------------------------------- parity across the handoff


@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
def test_correct_transfer_passes_in_both_layouts(ckpt, layout):
    c = contract(ckpt, layout)
    sender, receiver = prefilled(ckpt, c), Engine(ckpt, c, 16)
    payload = read_payload(write_payload(export_handoff(sender.cache, "s", torch.arange(5, 15))))
    import_handoff(receiver.cache, payload, seq_id="t")
    for layer in range(c.num_layers):
        a, b = sender.cache.view("s", layer), receiver.cache.view("t", layer)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    nxt = torch.tensor([40])
    assert torch.equal(sender.decode("s", nxt).logits, receiver.decode("t", nxt).logits)


def test_correct_handoff_passes_the_parity_check(ckpt):
    assert check(HandoffAdapter(ckpt), cases=[Case(length=16, block_size=2)]).passed


def test_fault_is_catalogued_as_a_handoff_fault():
    fault = get_handoff_fault(FAULT)
    assert FAULT in HANDOFF_FAULTS and fault.kind == "block_layout_mismatch"


def test_fault_is_named_with_the_transposition_in_the_evidence(ckpt):
    """Tiny llama: 2 KV heads; block size 2: each block [heads 2, block 2] is read as [block 2, heads 2],
    a transpose: received (row 0, head 1) holds sent (row 1, head 0), (row 1, head 0) sent (row 0, head 1)."""
    assert ckpt.config.num_kv_heads == 2
    fault = get_handoff_fault(FAULT)
    report = check(HandoffAdapter(ckpt, policy=fault.policy()), cases=[Case(length=16, block_size=2)])
    assert not report.passed
    d = report.diagnosis
    assert d.kind == "block_layout_mismatch", report.table()
    assert "transposed within each block" in d.evidence
    assert "received (row 0, head 1) holds sent (row 1, head 0)" in d.evidence
    assert "received (row 1, head 0) holds sent (row 0, head 1)" in d.evidence
    assert f"layout sent {HEADS_OUTER}, read as {TOKENS_OUTER}" in d.evidence
    assert "16 of 32 handed-off" in d.evidence  # per block, the two off-diagonal cells of 4 move


def test_fault_is_named_at_block_size_16_with_padding(ckpt):
    """17 tokens in blocks of 16: block 0 row 1 head 0 is run 2 of [heads, block] = sent (row 2, head 0);
    the second block holds 1 row, so received (row 16, head 1) reads sent head 0 row 1 of that block,
    which is padding."""
    fault = get_handoff_fault(FAULT)
    report = check(HandoffAdapter(ckpt, policy=fault.policy()), cases=[Case(length=17)])
    d = report.diagnosis
    assert not report.passed and d.kind == "block_layout_mismatch", report.table()
    assert "received (row 0, head 1) holds sent (row 1, head 0)" in d.evidence
    assert "received (row 1, head 0) holds sent (row 2, head 0)" in d.evidence
    assert "cells read the padding" in d.evidence and "each block's bytes read in the other order" in d.evidence


@pytest.mark.parametrize("tier", [Tier.LOGITS, Tier.ATTENTION])
def test_fault_is_caught_at_lower_tiers(ckpt, tier):
    fault = get_handoff_fault(FAULT)
    report = check(at_tier(HandoffAdapter(ckpt, policy=fault.policy()), tier), cases=[Case(length=16, block_size=2)])
    assert not report.passed


def test_cli_catches_and_names_the_fault_across_processes(tiny_llama_dir, tmp_path, capsys):
    """``ropekv handoff --inject``: real ranks, the streamed transfer (not the payload file) misread."""
    report = tmp_path / "report.json"
    args = [str(tiny_llama_dir), "--lengths", "9", "--decode-steps", "2", "--block-sizes", "4", "--timeout", "20"]
    code = main(["handoff", *args, "--inject", FAULT, "--json", str(report)])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert "diagnosis: block_layout_mismatch" in out
    d = json.loads(report.read_text())["runs"][0]["parity"]["diagnosis"]
    # block 4, 2 heads: received (row 0, head 1) is run 1 of [heads, block] = sent (row 1, head 0)
    assert (
        d["kind"] == "block_layout_mismatch" and "received (row 0, head 1) holds sent (row 1, head 0)" in d["evidence"]
    )


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
@pytest.mark.parametrize(
    "case",
    [
        Case(length=20, prefix=5, block_size=7),  # a prefix-cache hit on the prefill side
        Case(length=20, block_size=5, window=7, sink_tokens=2),  # a ring travels as its 9 live rows
    ],
)
def test_fault_is_named_for_both_key_forms_and_a_ring(ckpt, key_form, case):
    fault = get_handoff_fault(FAULT)
    report = check(HandoffAdapter(ckpt, prefill_key_form=key_form, policy=fault.policy()), cases=[case])
    assert not report.passed and report.diagnosis.kind == "block_layout_mismatch", report.table()
