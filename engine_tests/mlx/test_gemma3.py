"""Gemma 3 270M (float32) through mlx-lm's gemma3_text: five sliding layers (window 512, RoPE base 1e4)
then one global (base 1e6), three times; mlx-lm's own caches (make_prompt_cache: RotatingKVCache(512)
on sliding layers, KVCache on global ones).

Expected values come from ropekv's float64 reference (run with the embedding factor mlx-lm applies,
measured on its forward and checked here against torch's own bfloat16 rounding of sqrt(640)) and from
the config's layer pattern, never from the adapter under test. About 100 s of CPU on 2 cores
(the default check of five 513-1,100-token cases is most of it).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from ropekv import check
from ropekv.adapters.mlx import MLXEngine, default_cases
from ropekv.errors import ConfigError
from ropekv.faults.mlx import layer_rope_base, window_ignored
from ropekv.models.default import default_checkpoint_dir
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import Case, token_stream, window_matrix

WINDOW = 512
SLIDING, GLOBAL = 0, 5  # layer 0 slides (base 1e4), layer 5 is the first global one (base 1e6)


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    """The float32 transformers folder of Gemma 3 270M (the one place its path is named)."""
    return default_checkpoint_dir("gemma3-270m")


@pytest.fixture(scope="module")
def gemma(gemma_dir) -> MLXEngine:
    return MLXEngine(gemma_dir)


def test_mlx_builds_the_layers_the_config_names(gemma):
    caches = gemma.rt.cache.make_prompt_cache(gemma.model)
    for i, layer in enumerate(gemma.model.layers):
        full = gemma.config.layer_types[i] == "full_attention"
        assert full == ((i + 1) % 6 == 0)
        assert layer.self_attn.rope.base == (1e6 if full else 1e4)
        assert (type(caches[i]).__name__, getattr(caches[i], "max_size", None)) == (
            ("KVCache", None) if full else ("RotatingKVCache", WINDOW)
        )
    # mlx-lm multiplies the embeddings by sqrt(640) rounded to bfloat16 (25.25), not by sqrt(640)
    bf16 = torch.tensor(math.sqrt(640.0), dtype=torch.float32).to(torch.bfloat16).item()
    assert gemma.file_config.embedding_scale == pytest.approx(math.sqrt(640.0))
    assert gemma.config.embedding_scale == bf16 == 25.25
    assert any("25.25" in w for w in gemma.config.warnings)


def test_default_gemma_check_passes(gemma):
    cases = default_cases(argparse.Namespace(model=str(gemma.path)))
    assert cases == window_matrix(WINDOW)  # 513, 600, 1100 chunk 256, prefix 509 + 91, 600 chunk 301
    report = check(gemma, cases=cases, progress="off")
    assert report.passed, report.table()
    assert len(report.judged) == 5


def test_keys_of_a_sliding_and_a_global_layer_match_the_reference_past_the_window(gemma):
    L = WINDOW + 1  # the decode at 513: the ring has wrapped on sliding layers
    tokens = token_stream(gemma.config.vocab_size, L + 1)
    step = gemma.run_case(Case(length=L, decode_steps=1), tokens).steps[0]
    ref = ReferenceDecoder(gemma.checkpoint).forward(tokens[: L + 1], probe_rows=[L], logits_for="probed")
    for layer, first in ((SLIDING, L - WINDOW + 1), (GLOBAL, 0)):
        mine, theirs = step.layers[layer], ref.layers[layer]
        assert sorted(mine.key_positions.tolist()) == list(range(first, L + 1)), layer  # 2..513 / 0..513
        k_ref = theirs.k[mine.key_positions].double()  # the reference's keys at the positions mlx read
        assert float((mine.k.double() - k_ref).abs().max() / k_ref.abs().max()) < 1e-4, layer
        q_err = (mine.q.double() - theirs.q.double()).abs().max() / theirs.q.double().abs().max()
        assert float(q_err) < 1e-4, layer


def test_a_sliding_layer_turned_with_the_global_base_is_named(gemma):
    with layer_rope_base(gemma.model, SLIDING, 1e6):
        report = check(gemma, cases=[Case(length=20, decode_steps=1)], progress="off")  # any length shows it
    assert gemma.model.layers[SLIDING].self_attn.rope.base == 1e4  # restored
    assert not report.passed
    d = report.diagnosis
    assert d.kind == "layer_rope_mismatch", d
    assert d.details["layer"] == SLIDING and d.details["theta"] == 1e6


def test_an_ignored_window_is_named(gemma):
    with window_ignored(gemma.model):
        report = check(gemma, cases=[Case(length=WINDOW + 1, decode_steps=1)], progress="off")
    assert gemma.model.model.window_size == WINDOW  # restored
    assert not report.passed
    d = report.diagnosis
    assert d.kind == "window_mismatch", d
    assert (d.details["layer"], d.details["extra_keys"], d.details["keys_read"]) == (SLIDING, 2, 514)  # 0 and 1


def test_an_mlx_only_base_override_is_refused_at_load(gemma_dir):
    with pytest.raises(ConfigError, match=r"layer 0 RoPE theta 1000000\.0 \(ropekv: 10000\.0\)"):
        MLXEngine(gemma_dir, overrides={"rope_local_base_freq": 1e6})
