"""The reference streams its weights: one layer in float64 at a time, the same logits as transformers.

Independent references: transformers' own float64 forward of the same tiny model (with its two
float32 islands, RMSNorm's upcast and the RoPE angles, computed in float64 as the reference does on
purpose: module docstring of ropekv.models.reference; and the softmax, through sdpa), and the tensor shapes of the checkpoint for
the bytes one layer takes. The memory claim is checked by counting the bytes of every tensor the
reference converts while it is alive (a finalizer per tensor), not by the reference's own accounting.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from ropekv.adapters.native import NativeAdapter
from ropekv.models import ReferenceDecoder, load_checkpoint
from ropekv.models import reference as reference_module
from ropekv.models.config import Checkpoint
from ropekv.models.hf_config import read_model_config
from ropekv.testing.tiny import tiny_model

LAYERS = 6
T = 40


def _tokens(n: int = T, vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(3))


def _checkpoint(model: torch.nn.Module) -> Checkpoint:
    return Checkpoint.from_tensors(read_model_config(model.config.to_dict(), source="tiny"), model.state_dict())


def _hf_float64(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """``model`` in float64 with RMSNorm, the RoPE angles and the softmax computed in float64
    (transformers computes the first two in float32 whatever the model's dtype, and so does its eager
    attention the softmax), and exact float64 inverse frequencies."""
    from transformers.models.llama import modeling_llama

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        freqs = position_ids[..., None].double() * self.inv_freq.double()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", rotary)
    model = model.double()
    model.set_attn_implementation("sdpa")  # eager attention takes its softmax in float32; sdpa stays in float64
    d, theta = model.config.head_dim, model.config.rope_parameters["rope_theta"]
    model.model.rotary_emb.inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    return model


def test_streamed_reference_equals_transformers_float64(monkeypatch):
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    checkpoint = _checkpoint(model)
    tokens = _tokens()
    with torch.no_grad():
        want = _hf_float64(model, monkeypatch)(tokens[None]).logits[0]
    decoder = ReferenceDecoder(checkpoint)
    got = decoder.forward(tokens).logits
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert want.abs().max() > 0.5  # unit-scale weights: logits worth comparing
    assert (got - want).abs().max() < 1e-12
    rows = [0, 17, T - 1]
    probed = decoder.forward(tokens, probe_rows=rows, logits_for="probed")
    assert (probed.logits - want[rows]).abs().max() < 1e-12
    assert len(probed.layers) == LAYERS
    assert decoder._w == {}  # nothing converted is kept between forwards


def _layer_bytes(checkpoint: Checkpoint, layer: int, itemsize: int = 8) -> int:
    prefix = f"model.layers.{layer}."
    return sum(t.numel() * itemsize for n, t in checkpoint.weights.items() if n.startswith(prefix))


def test_float64_weights_held_at_once_are_one_layers(monkeypatch):
    """Every conversion the reference makes is counted while its tensor lives: the most alive at once is
    one layer's float64 weights (the old decoder held every layer, the embedding and the head)."""
    checkpoint = _checkpoint(tiny_model("llama", num_hidden_layers=8, vocab_size=96))
    layer = max(_layer_bytes(checkpoint, i) for i in range(8))
    everything = sum(t.numel() * 8 for t in checkpoint.weights.values())
    alive = {"now": 0, "peak": 0, "total": 0}
    convert = reference_module._convert

    def counted(tensor, dtype):
        out = convert(tensor, dtype)
        n = out.numel() * out.element_size()
        alive["now"] += n
        alive["total"] += n
        alive["peak"] = max(alive["peak"], alive["now"])
        weakref.finalize(out, lambda: alive.__setitem__("now", alive["now"] - n))
        return out

    monkeypatch.setattr(reference_module, "_convert", counted)
    # A head block of 16 vocabulary rows: the head is converted in six blocks, never whole.
    monkeypatch.setattr(reference_module, "HEAD_BLOCK_BYTES", 16 * 64 * 8)
    tokens = _tokens()
    blocked = ReferenceDecoder(checkpoint).forward(tokens).logits
    assert alive["total"] >= everything - 96 * 64 * 8  # every weight went through it (the embedding: T rows)
    assert 0 < alive["peak"] <= layer < everything / 8
    assert alive["now"] == 0  # nothing converted outlives the forward
    monkeypatch.setattr(reference_module, "HEAD_BLOCK_BYTES", 1 << 30)
    whole = ReferenceDecoder(checkpoint).forward(tokens).logits
    assert (blocked - whole).abs().max() < 1e-12


def test_engine_and_checkpoint_hold_the_weights_once(tiny_llama_dir):
    """The engine's fused q/k/v and gate/up take over the checkpoint's tensors: after building the
    engine every checkpoint tensor lies in the engine's storage, with the values loaded."""
    checkpoint = load_checkpoint(tiny_llama_dir)
    fresh = load_checkpoint(tiny_llama_dir)
    engine = NativeAdapter(checkpoint).make_engine(_case())
    w = engine.weights
    storages = {t.untyped_storage().data_ptr() for t in _engine_tensors(w)}
    for name, t in checkpoint.weights.items():
        assert t.untyped_storage().data_ptr() in storages, name
        assert torch.equal(t, fresh.weights[name]), name
    held = sum(t.numel() * t.element_size() for t in fresh.weights.values())
    assert w.nbytes() == held  # the engine holds every weight once, nothing more
    # The reference reads the shared tensors: the same logits as from the untouched checkpoint.
    tokens = _tokens(12)
    assert torch.equal(
        ReferenceDecoder(checkpoint).forward(tokens).logits, ReferenceDecoder(fresh).forward(tokens).logits
    )


def _case():
    from ropekv.parity.cases import Case

    return Case(length=8, block_size=4, decode_steps=1)


def _engine_tensors(weights) -> list[torch.Tensor]:
    out = [weights.embed, weights.lm_head, weights.final_norm.weight]
    for lw in weights.layers:
        for value in vars(lw).values():
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif value is not None and hasattr(value, "weight"):
                out.append(value.weight)
    return out
