"""The fingerprint of what a checkpoint computes, whichever RoPE pairing presents its Q/K rows.

A llama GGUF read as llama.cpp runs it (``layout="gptj"``: the Q/K rows as stored, pairs interleaved)
and the same file read as transformers runs it (``"neox"``: the rows unpermuted, halves paired) are
two presentations of one model. Within each head the gptj rows are a fixed permutation of the neox
rows, and the RoPE pairing follows that permutation. So every query-key score, every attention row,
every hidden state and every logit is the same number (up to the order a dot product sums in). The
checkpoints' own fingerprints differ, on purpose: a cache contract compares layouts, and keys written
in one pairing are not keys of the other.

What does not depend on the presentation (the float64 reference's rows: logits, hidden states,
attention logits) is keyed by :func:`computation_fingerprint`: the fingerprint of the neox
presentation. For a neox checkpoint that is its own fingerprint. For a gptj checkpoint it is
computed by permuting the Q/K rows (weights and biases) back and hashing them under the neox config,
the fingerprint ``load_gguf(path, layout="neox")`` gives. Where the equivalence is not this simple,
the checkpoint's own fingerprint is returned, so a reference is shared only where it is provably the
same. That covers a rotary offset, RoPE specs of more than one layout or rotary width, MLA, and
per-channel Q/K norms (their weights would need the permutation too).
"""

from __future__ import annotations

import dataclasses

from ..rope import RopeSpec, layout_permutation
from .config import Checkpoint, fingerprint_of
from .weights import weights_digest

_QK_ROWS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")


def computation_fingerprint(checkpoint: Checkpoint) -> str:
    """The fingerprint of ``checkpoint``'s neox presentation (module doc); its own where the two are
    not one permutation of each other's Q/K rows. Hashes the weights once more for a gptj checkpoint
    (about a second for SmolLM2-135M)."""
    cfg = checkpoint.config
    specs = [cfg.rope, *(s for s in (cfg.layer_ropes or ()) if s is not None)]
    if any(s.layout != "gptj" for s in specs):
        return checkpoint.fingerprint  # neox already, or a mix no single permutation turns
    if cfg.mla is not None or any(s.rotary_offset or s.rotary_dim != cfg.rope.rotary_dim for s in specs):
        return checkpoint.fingerprint
    if any(".q_norm." in name or ".k_norm." in name for name in checkpoint.weights):
        return checkpoint.fingerprint
    perm = layout_permutation(cfg.rope.rotary_dim, cfg.head_dim, "gptj", "neox")  # x_neox = x_gptj[..., perm]
    weights = {}
    for name, tensor in checkpoint.weights.items():
        if name.endswith(_QK_ROWS):
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            # [heads * D, ...] -> each head's rows gathered into the neox order
            tensor = tensor.reshape(heads, cfg.head_dim, *tensor.shape[1:])[:, perm].reshape(tensor.shape)
        weights[name] = tensor
    neox = dataclasses.replace(
        cfg,
        rope=dataclasses.replace(cfg.rope, layout="neox"),
        layer_ropes=None if cfg.layer_ropes is None else tuple(_neox(s) for s in cfg.layer_ropes),
    )
    return fingerprint_of(neox, weights_digest(weights))


def _neox(spec: RopeSpec | None) -> RopeSpec | None:
    return None if spec is None else dataclasses.replace(spec, layout="neox")
