"""Two misnamings fixed at their causes: a single stale key after a ring rollback is evidence, and an
eviction's renumbered labels are not a window bug in a case that has no window.

Expected positions are derived by hand from the case geometry (window 13 + 2 sinks, a 3-token draft
at positions 40..42), never from the diagnosis itself.
"""

from __future__ import annotations

import pytest
import torch

from ropekv import check, diagnose_row
from ropekv.bugs.registry import OP_FAULTS
from ropekv.models import load_checkpoint
from ropekv.parity.cases import CacheOp, Case
from ropekv.rope import RopeSpec


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


def test_one_unrestored_ring_slot_names_stale_keys_at_the_newest_overwritten_position(llama):
    # Ring of 13 + 2 sinks = 15 slots; the draft at 40, 41, 42 overwrites the slots of 27, 28, 29. At the
    # query 40 the window shows 28..40 (and sinks 0, 1): 28 and 29 are in view; only 29 (overwritten by
    # the newest draft token, 42) keeps a rejected key.
    case = Case(length=40, block_size=5, window=13, sink_tokens=2, op=CacheOp("rollback", 3))
    report = check(OP_FAULTS["rollback-keeps-newest-slot"].adapter(llama), cases=[case])
    assert not report.passed
    d = report.diagnosis
    assert d.kind == "rollback_stale_keys", report.table()
    assert (
        "1 key(s) at positions 29 are no rotation" in d.evidence and "1 of the 2 such positions in view" in d.evidence
    )


def test_a_stale_key_without_an_operation_to_explain_it_is_still_shown():
    # The general path: every key and the query fit at their positions but one key, another token's.
    spec = RopeSpec(head_dim=16, rotary_dim=16, theta=10000.0, layout="neox")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 16, generator=g, dtype=torch.float64)  # [H, D]
    k = torch.randn(30, 2, 16, generator=g, dtype=torch.float64)  # [N, KVH, D]
    pos = torch.arange(30)
    k_eff = spec.rotate(k, pos)
    k_eff[17] = spec.rotate(torch.randn(1, 2, 16, generator=g, dtype=torch.float64), pos[17:18])[0]
    q_eff = spec.rotate(q[None], torch.tensor([29]))[0]
    d = diagnose_row(
        spec, q_raw=q, q_eff=q_eff, k_raw=k, k_eff=k_eff, query_position=29, key_positions=pos, key_slots=pos.clone()
    )
    assert d.kind == "unknown"
    assert "key 17 are no rotation of any reference row" in d.evidence and "the other 29 keys are right" in d.evidence


@pytest.mark.parametrize("block_size", [7, 16])
def test_compacting_eviction_is_evict_offset_never_a_window_bug(llama, block_size):
    case = Case(length=30, block_size=block_size, op=CacheOp("evict", 4))
    assert case.window is None and llama.config.layer_window(0) is None
    report = check(OP_FAULTS["evict-compacts-positions"].adapter(llama), cases=[case])
    assert not report.passed
    d = report.diagnosis
    assert d.kind == "evict_offset", report.table()
    assert "window" not in d.evidence
    gone = case.evicted_positions
    assert len(gone) == 4 and f"evicted positions {gone}" in d.evidence
    assert "query at 30 - 4 = 26" in d.evidence  # the first decode query, 30, continues from 30 - 4 kept rows
