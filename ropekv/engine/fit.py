"""Whether a cache contract fits a model: the engine refuses a contract that does not, at construction."""

from __future__ import annotations

from ..contract import CacheContract, rope_diffs
from ..errors import ContractMismatch
from ..models.config import Checkpoint
from ..rope import RopeSpec


def check_contract_fits_model(checkpoint: Checkpoint, contract: CacheContract) -> None:
    """Raise :class:`ContractMismatch` (naming every field) unless ``contract`` describes the cache
    ``checkpoint``'s model needs: its shapes, RoPE per layer, MLA form, key form and fingerprint."""
    cfg, c = checkpoint.config, contract
    problems = []
    for field, ours, theirs in (
        ("num_layers", c.num_layers, cfg.num_layers),
        ("num_kv_heads", c.num_kv_heads, cfg.num_kv_heads),
        ("head_dim", c.head_dim, cfg.head_dim),
    ):
        if ours != theirs:
            problems.append((field, f"{field}: contract {ours}, model {theirs}"))
    if cfg.mla is not None and (c.mla is None or c.mla.cached != "expanded"):
        problems.append(
            (
                "mla.cached",
                f"mla.cached: contract {None if c.mla is None else c.mla.cached!r}, "
                "ropekv's engine caches MLA keys 'expanded' (per-head keys and values, "
                "the rope part last)",
            )
        )
    elif c.mla is not None and cfg.mla is None:
        problems.append(("mla", "mla: the contract describes multi-head latent attention, the model has none"))
    # By what the specs compute (rope_diffs): a max_position_embeddings that changes no key is no misfit.
    differs = rope_diffs(c.rope, cfg.rope)
    per_layer = not differs and (c.layer_ropes is not None or cfg.layer_ropes is not None)
    layers = range(min(c.num_layers, cfg.num_layers)) if per_layer else range(0)  # other counts: named above
    bad = [i for i in layers if _turns_otherwise(c.layer_rope(i), cfg.layer_rope(i))]
    if differs:
        problems.append(
            (
                "rope",
                f"rope: contract {c.rope.fingerprint()}, model {cfg.rope.fingerprint()}, differing in "
                f"{', '.join(d.field for d in differs)} "
                "(keys and queries would turn differently from what the model was trained with)",
            )
        )
    elif bad:
        problems.append(
            (
                "layer_ropes",
                f"layer_ropes: layer(s) {bad[:8]} turn with another RoPE (or none) in the contract than in the model",
            )
        )
    if c.key_form == "raw" and cfg.qk_norm and cfg.family.block.qk_norm == "head_after_rope":
        problems.append(
            (
                "key_form",
                f"key_form: 'raw' has no meaning for {cfg.architecture}: its q/k norm is "
                "applied after RoPE, so the key the kernel reads is norm(R(j) k), not a "
                "rotation of any key a cache could hold raw; use key_form 'rotated' "
                "(with a length-dependent RoPE, dynamic NTK without alpha, no key form can "
                "serve it: rotated keys keep stale frequencies)",
            )
        )
    if c.weights_fingerprint and c.weights_fingerprint != checkpoint.weights_fingerprint:
        problems.append(
            (
                "weights_fingerprint",
                f"weights_fingerprint: contract {c.weights_fingerprint}, model "
                f"{checkpoint.weights_fingerprint} (keys would come from another model: other weights)",
            )
        )
    if c.config_fingerprint and c.config_fingerprint != checkpoint.config_fingerprint:
        problems.append(
            (
                "config_fingerprint",
                f"config_fingerprint: contract {c.config_fingerprint}, model {checkpoint.config_fingerprint} "
                "(the model's configuration outside RoPE and the cache layout differs: it would compute "
                "other keys and values)",
            )
        )
    if problems:
        raise ContractMismatch(
            "the cache contract does not fit the model: " + "; ".join(p for _, p in problems),
            fields=tuple(f for f, _ in problems),
        )


def _turns_otherwise(ours: RopeSpec | None, theirs: RopeSpec | None) -> bool:
    """A layer turns otherwise: RoPE on one side only (NoPE), or specs that compute another rotation."""
    if ours is None or theirs is None:
        return (ours is None) != (theirs is None)
    return bool(rope_diffs(ours, theirs))
