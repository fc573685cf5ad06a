"""Block seam: a prefix hit that is not block-aligned mixes stored and recomputed rows in one block.

The harness's prefix hit (ropekv.adapters.native_steps) forks from an earlier request that cached the
prefix and 3 tokens of a different continuation; a hit at ``P`` shares the block ``P // B`` with it.
The rows a stored block keeps over the recomputed ones are therefore ``P .. min(P + 2, block end)``:
the numbers below are derived from that by hand, and the float64 reference judges every case.
"""

from __future__ import annotations

import forensic_rows
import pytest
import torch

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.block_seam import SEAM_CASES, SeamRowsFromStore
from ropekv.bugs.registry import FAULTS
from ropekv.cache.policy import CORRECT
from ropekv.models import load_checkpoint
from ropekv.parity.cases import Case
from ropekv.parity.protocol import Tier
from ropekv.testing.tiers import at_tier

BLOCK_SIZES = (2, 3, 5, 7, 16)


def seam_case(b: int) -> Case:
    return Case(length=20, prefix=3 * b + b // 2, block_size=b, decode_steps=2)  # P mod B = B // 2, never 0


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


def test_policy_keeps_the_stored_rows_where_the_store_held_a_token():
    written, stored = torch.zeros(3, 1, 2), torch.ones(3, 1, 2)
    held = torch.tensor([True, False, True])
    assert torch.equal(CORRECT.copied_block_rows(written, stored, held), written)
    assert SeamRowsFromStore().copied_block_rows(written, stored, held)[:, 0, 0].tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_correct_engine_passes_a_non_aligned_hit_at_every_block_size(llama, key_form):
    report = check(NativeAdapter(llama, key_form=key_form), cases=[seam_case(b) for b in BLOCK_SIZES])
    assert report.passed, report.table()


@pytest.mark.parametrize("tier", [Tier.LOGITS, Tier.ATTENTION])
@pytest.mark.parametrize("key_form", ["rotated", "raw"])
def test_seam_caught_at_every_tier(llama, tier, key_form):
    fault = FAULTS["seam-rows-from-store"]
    for b in BLOCK_SIZES:
        report = check(at_tier(fault.adapter(llama, key_form=key_form), tier), cases=[seam_case(b)])
        assert not report.passed, (b, report.table())


@pytest.mark.parametrize("key_form", ["rotated", "raw"])
@pytest.mark.parametrize("b", BLOCK_SIZES)
def test_seam_named_row_by_row(llama, key_form, b):
    case = seam_case(b)
    P = case.prefix
    start, end = P // b * b, P // b * b + b  # the seam block holds start .. end - 1
    wrong = list(range(P, min(P + 3, end)))  # the earlier request's 3 tokens past P, inside the block
    report = check(FAULTS["seam-rows-from-store"].adapter(llama, key_form=key_form), cases=[case])
    d = report.diagnosis
    assert d is not None and d.kind == "block_seam", report.table()
    keys = (
        ", ".join(map(str, wrong)) if len(wrong) == 2 else (f"{wrong[0]}..{wrong[-1]}" if wrong[1:] else f"{wrong[0]}")
    )
    assert f"block {P // b} (positions {start}..{end - 1}) mixes the stored prefix" in d.evidence
    assert f"key(s) {keys} are wrong" in d.evidence, d.evidence
    assert d.details["seam_block"] == P // b and d.details["seam_wrong_keys"] == len(wrong)
    # every other key sits at its own position, the stale ones fit none
    eff = dict(zip(range(len(forensic_rows.key_positions(d))), forensic_rows.key_positions(d)))
    assert [i for i, p in eff.items() if p is None] == wrong
    assert all(p == i for i, p in eff.items() if i not in wrong)


def test_seam_hidden_by_an_aligned_hit(llama):
    # P = 16 = B: the request's rows start in a block of their own, nothing is copied on write.
    report = check(FAULTS["seam-rows-from-store"].adapter(llama), cases=[Case(length=20, prefix=16, block_size=16)])
    assert report.passed, report.table()


def test_catalogued_cases_are_non_aligned():
    assert all(c.prefix % c.block_size for c in SEAM_CASES)
