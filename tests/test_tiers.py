"""``ropekv.testing.at_tier``: a fault seen through a lower tier is still caught, and no more is claimed."""

from __future__ import annotations

import pytest

from ropekv import check
from ropekv.adapters.native import NativeAdapter
from ropekv.bugs.registry import FAULTS
from ropekv.errors import UsageError
from ropekv.models import load_checkpoint
from ropekv.parity.cases import Case
from ropekv.parity.protocol import Tier
from ropekv.testing.tiers import at_tier

CASES = [Case(length=17, block_size=7, decode_steps=2)]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir)


def test_logits_tier_catches_without_layers_and_attention_tier_localizes_without_naming(llama):
    faulty = FAULTS["double-rotation"].adapter(llama)
    logits = check(at_tier(faulty, Tier.LOGITS), cases=CASES)
    assert not logits.passed and logits.tier == "logits" and logits.diagnosis is None
    assert all(c.max_attn_error is None for c in logits.cases)
    attention = check(at_tier(faulty, Tier.ATTENTION), cases=CASES)
    fd = attention.cases[0].first_divergence
    assert not attention.passed and attention.tier == "attention" and attention.diagnosis is None
    assert fd is not None and fd.layer == 0


def test_a_clean_engine_passes_at_every_tier(llama):
    clean = NativeAdapter(llama)
    for tier in (Tier.LOGITS, Tier.ATTENTION, Tier.FORENSICS):
        assert check(at_tier(clean, tier), cases=CASES).passed


def test_a_tier_above_the_adapters_is_refused(llama):
    low = at_tier(NativeAdapter(llama), Tier.LOGITS)
    with pytest.raises(UsageError, match="not a tier at or below"):
        at_tier(low, Tier.FORENSICS)
