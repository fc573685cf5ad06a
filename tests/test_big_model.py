"""The big-model bench's checkpoints are the real models' shapes, written shard by shard.

No big model is written or checked here (that is the bench itself, minutes and gigabytes): the
shapes are checked against the parameter counts Meta publishes for Llama-3.2-1B and -3B
(1,235,814,400 and 3,212,749,824: the models' safetensors headers), the writer on a tiny config.
"""

from __future__ import annotations

import json

import pytest
import torch

from ropekv.bench.big_model import SHAPES, parameter_count, tensor_shapes, write_checkpoint
from ropekv.cli.main import main
from ropekv.models import load_checkpoint
from ropekv.models.hf_config import read_model_config

PUBLISHED = {"1b": 1_235_814_400, "3b": 3_212_749_824}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shapes_are_the_published_models(shape):
    config = SHAPES[shape]
    assert parameter_count(config) == PUBLISHED[shape]
    cfg = read_model_config(config, source=shape)
    assert cfg.expected_shapes() == dict(tensor_shapes(config))  # what ropekv loads is what is written
    assert cfg.tie_word_embeddings and cfg.num_kv_heads == 8 and cfg.vocab_size == 128256
    assert cfg.rope.scaling.rope_type == "llama3" and cfg.rope.theta == 500000.0


def test_writer_shards_and_reuses(tmp_path):
    config = {
        **SHAPES["1b"],
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "head_dim": 4,
        "intermediate_size": 48,
        "vocab_size": 64,
        "max_position_embeddings": 512,
    }
    folder = write_checkpoint(config, tmp_path / "m", shard_bytes=4096)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and sorted(p.name for p in folder.glob("*.safetensors")) == shards
    assert set(index["weight_map"]) == {name for name, _ in tensor_shapes(config)}
    checkpoint = load_checkpoint(folder)
    embed = checkpoint.weights["model.embed_tokens.weight"]
    assert torch.equal(embed, embed.to(torch.bfloat16).float())  # stored in bfloat16
    assert 0.01 < float(embed.std()) < 0.03
    assert torch.equal(checkpoint.weights["model.norm.weight"], torch.ones(32))
    stamp = (folder / shards[0]).stat().st_mtime_ns
    assert write_checkpoint(config, tmp_path / "m", shard_bytes=4096) == folder
    assert (folder / shards[0]).stat().st_mtime_ns == stamp  # complete and the same: not rewritten
    other = load_checkpoint(write_checkpoint(config, tmp_path / "m", seed=1, shard_bytes=4096))
    assert not torch.equal(other.weights["model.embed_tokens.weight"], embed)


def test_bench_flag_refuses_bad_input(capsys):
    assert main(["bench", "--big-models", "2b"]) == 2
    assert "1b, 3b" in capsys.readouterr().err
    assert main(["bench", "--big-models", "1b", "--quick"]) == 2
    assert "--quick does not apply" in capsys.readouterr().err
