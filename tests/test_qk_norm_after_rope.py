"""q/k norm after RoPE (hunyuan_v1_dense): the kernel multiplies ``norm(R(i) q)`` by ``norm(R(j) k)``.

The cached key is ``norm(R(j) k)``: not a rotation of any key, so there is no raw form a kernel could
rotate on read. ropekv caches it rotated (normalized after the turn) and refuses ``key_form="raw"``
with exit 3, naming why; the RoPE (NTK alpha folded into the base, as transformers computes it) is
checked against transformers in tests/test_architectures.py.
"""

from __future__ import annotations

import pytest
import torch
from test_architectures import BY_ID, scaled

from ropekv.cli.main import main
from ropekv.contract import CacheContract
from ropekv.engine import Engine
from ropekv.errors import ContractMismatch
from ropekv.models import ReferenceDecoder, load_checkpoint

NTK_ALPHA = BY_ID["hunyuan_v1_dense-ntk-alpha"][1]


def test_raw_keys_are_refused_naming_why(make_arch_checkpoint):
    ckpt = load_checkpoint(make_arch_checkpoint("hunyuan_v1_dense", attention_bias=True))
    with pytest.raises(
        ContractMismatch, match="'raw' has no meaning for hunyuan_v1_dense: its q/k norm is applied after RoPE"
    ) as info:
        Engine(ckpt, CacheContract.for_model(ckpt.config, key_form="raw"))
    assert info.value.exit_code == 3 and "key_form" in info.value.fields
    Engine(ckpt, CacheContract.for_model(ckpt.config, key_form="rotated"))  # rotated is served


@pytest.mark.parametrize("options", [["--key-form", "raw"], ["--key-form", "raw", "--backend", "rotate_on_read"]])
def test_cli_refuses_raw_keys_with_exit_3(options, make_arch_checkpoint, capsys):
    path = make_arch_checkpoint("hunyuan_v1_dense", attention_bias=True)
    code = main(["check", str(path), "--lengths", "5", "--prefix-offsets", "0", "--no-progress", *options])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and "q/k norm is applied after RoPE" in err, err


def test_cached_keys_are_normalized_after_the_rotation(make_arch_checkpoint):
    """What the cache holds is exactly the reference's norm(R(j) k) (and not R(j) norm(k), which a
    norm-before-RoPE reading would store: measured far apart on random norm weights)."""
    ckpt = load_checkpoint(make_arch_checkpoint("hunyuan_v1_dense", attention_bias=True))
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(5))
    engine = Engine(ckpt, CacheContract.for_model(ckpt.config, key_form="rotated", block_size=5))
    engine.prefill("s", tokens)
    probe = ReferenceDecoder(ckpt).forward(tokens, probe_rows=[11]).layers
    for layer in range(ckpt.config.num_layers):
        cached = engine.cache.view("s", layer).keys
        assert scaled(cached, probe[layer].k) < 1e-5
        rope, weight = ckpt.config.layer_rope(layer), ckpt.weights[f"model.layers.{layer}.self_attn.k_norm.weight"]
        k = probe[layer].k_raw
        before = rope.rotate(
            k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + ckpt.config.rms_norm_eps) * weight, torch.arange(12)
        )
        assert scaled(before, probe[layer].k) > 1e-2


def test_ntk_alpha_is_a_fixed_base_and_dynamic_without_alpha_stays_dynamic(make_arch_checkpoint):
    cfg = load_checkpoint(make_arch_checkpoint("hunyuan_v1_dense", **NTK_ALPHA)).config
    assert cfg.rope.scaling.rope_type == "default" and not cfg.rope.length_dependent
    assert cfg.rope.theta == pytest.approx(1e4 * 50.0 ** (16 / 14), rel=1e-12)
    assert any("rope_parameters.factor ignored" in w for w in cfg.warnings)
    plain = load_checkpoint(
        make_arch_checkpoint(
            "hunyuan_v1_dense", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
        )
    ).config
    assert plain.rope.scaling.rope_type == "dynamic" and plain.rope.length_dependent
    # No key form serves dynamic NTK here: rotated keys would keep stale frequencies, raw ones do not exist.
    ckpt = load_checkpoint(
        make_arch_checkpoint(
            "hunyuan_v1_dense", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
        )
    )
    for form, why in (("rotated", "stale frequencies"), ("raw", "after RoPE")):
        with pytest.raises(ContractMismatch, match=why):
            Engine(ckpt, CacheContract.for_model(ckpt.config, key_form=form))
