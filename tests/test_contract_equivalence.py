"""A sample of scripts/contract_equivalence.py: pairs of RoPE variants over a few architectures, each
judged by its float64 rotation (the ground truth) and by the cache contract; none may disagree."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "contract_equivalence.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("contract_equivalence", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


# Variants whose pairs hold every kind of case: max_position_embeddings alone (equal under default,
# llama3 and YaRN, not under dynamic NTK), theta spelled twice, factor-1 scalings, real differences.
SAMPLE = (
    "as configured",
    "max_position_embeddings x2",
    "theta as int",
    "theta x2",
    "linear 1",
    "llama3 8 (1, 4)",
    "llama3 8 (2, 8)",
    "llama3 8 (1, 4), max_position_embeddings x2",
    "dynamic 2",
    "dynamic 2, max_position_embeddings x2",
    "longrope 64",
    "longrope 64, max_position_embeddings x2",
    "layout swapped",
)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "deepseek_v3", "phi"])
def test_the_contract_accepts_exactly_the_pairs_that_compute_the_same(sweep, arch):
    counts = sweep.sweep((arch,), SAMPLE)
    assert counts.wrong == []
    assert counts.equal_accepted == counts.equal > 0
    assert counts.different_refused == counts.different > 0
    assert counts.controls_refused == counts.controls == 8


def test_the_sample_holds_equal_pairs_of_every_kind(sweep):
    """The ground truth sees what the contract must accept: max_position_embeddings alone under llama3,
    and refuse: the same under dynamic NTK."""
    config = sweep.arch_config("llama")
    contracts = {
        name: sweep.CacheContract.for_model(sweep.variant_config(config, name), key_form="rotated") for name in SAMPLE
    }
    x = sweep.torch.randn(1, 1, config.head_dim, dtype=sweep.torch.float64)

    def same(a, b):
        return sweep.same_computation(sweep.computation(contracts[a], x), sweep.computation(contracts[b], x))

    assert same("llama3 8 (1, 4)", "llama3 8 (1, 4), max_position_embeddings x2")
    assert same("as configured", "theta as int") and same("as configured", "linear 1")
    assert not same("dynamic 2", "dynamic 2, max_position_embeddings x2")
    assert not same("longrope 64", "as configured")
