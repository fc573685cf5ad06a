"""The handoff's store check (``ropekv.handoff.vllm_entries``) without vLLM: every row the consumer
injects, keys and values, compared bit for bit with what the producer's hooks saw; a forgery of the
values alone is named a value mismatch, not a RoPE class."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ropekv.adapters.vllm.store import consumer_tokens, write_entry
from ropekv.handoff.vllm_entries import describe, entry_findings, store_diagnosis

B, LAYERS, KVH, D = 16, 2, 2, 8
LENGTH = 35  # the consumer injects 32 rows (two blocks), the producer hooked 35


def _producer(tmp_path: Path, prompts: int = 2) -> tuple[dict, list[tuple[list[torch.Tensor], list[torch.Tensor]]]]:
    g = torch.Generator().manual_seed(0)
    hooked, kv, records = {}, [], []
    for j in range(prompts):
        ids = torch.randint(0, 1000, (LENGTH,), generator=g).tolist()
        keys = [torch.randn(LENGTH, KVH, D, generator=g) for _ in range(LAYERS)]
        keys[0][5, 0, 2] = 3e-9  # a key component near zero, as real keys have
        values = [torch.randn(LENGTH, KVH, D, generator=g) for _ in range(LAYERS)]
        for i in range(LAYERS):
            hooked[f"p{j}.l{i}"], hooked[f"p{j}.v{i}"] = keys[i], values[i]
        kv.append((keys, values))
        records.append({"length": LENGTH, "seed": j, "token_ids": ids, "entries": []})
    save_file(hooked, str(tmp_path / "keys.safetensors"))
    side = {
        "contract": {"kernel_isa": "vec"},
        "cache_contract": {"num_kv_heads": KVH, "head_dim": D},
        "block_size": B,
    }
    return {"side": side, "prompts": records, "keys": str(tmp_path / "keys.safetensors")}, kv


def _store(tmp_path: Path, producer: dict, keys, values) -> Path:
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    n = consumer_tokens(LENGTH, B)
    ids = producer["prompts"][0]["token_ids"][:n]
    write_entry(store, ids, [k[:n] for k in keys], [v[:n] for v in values], isa="vec", block_size=B, overwrite=True)
    return store


def test_a_faithful_entry_holds_its_prompts_keys_and_values(tmp_path):
    producer, kv = _producer(tmp_path)
    (finding,) = entry_findings(_store(tmp_path, producer, *kv[0]), producer, 1)
    assert finding["holds"] == 0 and finding["value_mismatch"] is None
    assert "keys and values of this prompt, bit for bit" in describe(finding)
    assert store_diagnosis([finding]) is None


def _smallest_key_exponent_flipped(keys: list[torch.Tensor]) -> list[torch.Tensor]:
    """Layer 0's smallest-magnitude key element with its lowest exponent bit flipped (x2 or /2): an
    error far below any tolerance relative to the largest key (here 3e-9 against keys of about 1)."""
    k0 = keys[0].clone()
    i = int(k0.abs().argmin())
    bits = k0.view(-1).view(torch.int32)
    bits[i] ^= 1 << 23
    assert k0.view(-1)[i] != keys[0].view(-1)[i]
    return [k0, *keys[1:]]


def test_an_exponent_bit_flipped_in_layer_0_is_not_the_producers_keys(tmp_path):
    producer, kv = _producer(tmp_path)
    keys, values = kv[0]
    (finding,) = entry_findings(_store(tmp_path, producer, _smallest_key_exponent_flipped(keys), values), producer, 1)
    assert finding["holds"] is None and finding["value_mismatch"] is None
    assert "keys and values of no prompt" in describe(finding)


@pytest.mark.parametrize("row", [0, 31])  # the first and the last row the consumer injects
def test_values_forged_alone_are_a_value_mismatch(tmp_path, row):
    producer, kv = _producer(tmp_path)
    keys, values = kv[0]
    forged = [v.clone() for v in values]
    forged[1][row, 1, 3] *= 1.5
    (finding,) = entry_findings(_store(tmp_path, producer, keys, forged), producer, 1)
    assert finding["holds"] is None
    assert finding["value_mismatch"]["layers"] == [1]
    assert finding["value_mismatch"]["max_error"] == pytest.approx(abs(float(values[1][row, 1, 3])) * 0.5)
    text = describe(finding)
    assert "VALUE MISMATCH" in text and "not a RoPE fault" in text
    assert store_diagnosis([finding]).startswith("value_mismatch")


def test_another_prompts_keys_and_values_are_named_as_such(tmp_path):
    producer, kv = _producer(tmp_path)
    (finding,) = entry_findings(_store(tmp_path, producer, *kv[1]), producer, 1)
    assert finding["holds"] == 1 and "ANOTHER prompt" in describe(finding)


def test_an_entry_linked_to_a_copy_outside_the_store_is_named_a_link(tmp_path):
    producer, kv = _producer(tmp_path)
    store = _store(tmp_path, producer, *kv[0])
    (entry,) = [p for p in store.iterdir() if p.is_dir()]
    copy = tmp_path / "copy"
    entry.rename(copy)
    entry.symlink_to(copy)
    (finding,) = entry_findings(store, producer, 1)
    assert finding["holds"] is None and "a symbolic link, not a folder in the store" in finding["error"]
