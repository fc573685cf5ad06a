"""Does the cache contract accept exactly the pairs that compute the same keys?

For every architecture ropekv describes (tiny transformers configs, no weights), RoPE variants of its
spec (another ``max_position_embeddings``, theta spelled twice, scaling types whose factor 1 is the
identity, real rescalings, another layout, rotary width or attention factor) are turned into cache
contracts with :meth:`CacheContract.for_model`, and every pair of variants of one architecture is
compared twice:

- the ground truth, outside the contract code: each side's RoPE turns a fixed random head vector at a
  set of (position, sequence length) pairs, every layer with its own spec, in float64
  (:meth:`RopeSpec.rotate`, the rotation the engine applies); the two computations are the same when
  every rotated vector agrees within ``TRUTH_RTOL`` of its size;
- the contract: :meth:`CacheContract.diff` between the two.

A pair is right when computation-equal pairs are accepted, and computation-different pairs are refused
naming only fields that differ between the two specs. Controls (another key form, window, dtype, block
layout, weights or configuration) are refused by construction and checked to name their field.

    python scripts/contract_equivalence.py            # every architecture; prints the counts
    python scripts/contract_equivalence.py llama qwen2
Exit status 0 when no pair is wrong, 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ropekv.contract import CacheContract, KvQuant
from ropekv.errors import ConfigError
from ropekv.models.config import ARCHITECTURES, ModelConfig
from ropekv.models.hf_config import read_model_config
from ropekv.rope import RopeScaling, RopeSpec
from ropekv.testing.tiny import TINY_BASE

TRUTH_RTOL = 1e-9  # float64 rounding of equal computations stays many orders below this at these lengths
# Sequence lengths around every switch the variants use (max_position_embeddings 128/256/512, original
# maxima 64 and 256), and positions in each: the first, the second, the middle and the last.
LENGTHS = (1, 2, 17, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 300, 511, 512, 513, 1000, 4096, 8193, 16385)
_MLA = {
    "num_key_value_heads": 4,
    "head_dim": 8,
    "kv_lora_rank": 20,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 4,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "num_experts_per_tok": 2,
}
_SW = {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]}
# What an architecture needs besides ropekv's tiny sizes to be a valid ropekv config with its RoPE features.
OVERRIDES: dict[str, dict[str, Any]] = {
    "gptj": {"rotary_dim": 8},
    "deepseek_v2": {**_MLA, "q_lora_rank": None},
    "deepseek_v3": {**_MLA, "q_lora_rank": 24, "n_group": 2, "topk_group": 1},
    "qwen2_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}},
    "qwen2_5_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}},
    "gemma3_text": {
        **_SW,
        "query_pre_attn_scalar": 16,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        },
    },
    "cohere2": _SW,
    "smollm3": {"no_rope_layers": [1, 0]},
}


def arch_config(arch: str) -> ModelConfig:
    """ropekv's config of a tiny ``arch`` (transformers builds the config; no weights)."""
    import transformers

    kwargs = {**TINY_BASE, **OVERRIDES.get(arch, {})}
    if isinstance(getattr(transformers.CONFIG_MAPPING[arch], "head_dim", None), property):
        kwargs.pop("head_dim")
    return read_model_config(transformers.AutoConfig.for_model(arch, **kwargs).to_dict(), source=arch)


# ---------------------------------------------------------------------- the variants

SpecChange = Callable[[RopeSpec], RopeSpec]


def _scaling(scaling: RopeScaling) -> SpecChange:
    return lambda s: s.replace(scaling=scaling)


def _llama3(factor: float, low: float, high: float) -> RopeScaling:
    return RopeScaling(
        "llama3", factor=factor, low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=64
    )


def _longrope(s: RopeSpec, long: float, original: int) -> RopeSpec:
    n = s.rotary_dim // 2
    short, longer = tuple(1.0 for _ in range(n)), tuple(long + i / 10 for i in range(n))
    return s.replace(
        scaling=RopeScaling(
            "longrope", short_factor=short, long_factor=longer, original_max_position_embeddings=original
        )
    )


# name -> (what it does to each RoPE spec of the model, what it does to the config's max_position_embeddings)
VARIANTS: dict[str, tuple[SpecChange, Callable[[int], int]]] = {
    "as configured": (lambda s: s, lambda m: m),
    "max_position_embeddings x2": (
        lambda s: s.replace(max_position_embeddings=2 * s.max_position_embeddings),
        lambda m: 2 * m,
    ),
    "max_position_embeddings /2": (
        lambda s: s.replace(max_position_embeddings=s.max_position_embeddings // 2),
        lambda m: m // 2,
    ),
    "theta as int": (lambda s: s.replace(theta=int(s.theta)), lambda m: m),
    "theta x (1 + 1e-15)": (lambda s: s.replace(theta=s.theta * (1 + 1e-15)), lambda m: m),
    "theta x2": (lambda s: s.replace(theta=2 * s.theta), lambda m: m),
    "default": (_scaling(RopeScaling()), lambda m: m),
    "default, max_position_embeddings x2": (
        lambda s: s.replace(scaling=RopeScaling(), max_position_embeddings=2 * s.max_position_embeddings),
        lambda m: 2 * m,
    ),
    "linear 1": (_scaling(RopeScaling("linear", factor=1.0)), lambda m: m),
    "linear 2": (_scaling(RopeScaling("linear", factor=2.0)), lambda m: m),
    "yarn 1": (_scaling(RopeScaling("yarn", factor=1.0, original_max_position_embeddings=64)), lambda m: m),
    "yarn 4": (_scaling(RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64)), lambda m: m),
    "llama3 1": (_scaling(_llama3(1.0, 1.0, 4.0)), lambda m: m),
    "llama3 8 (1, 4)": (_scaling(_llama3(8.0, 1.0, 4.0)), lambda m: m),
    "llama3 8 (2, 8)": (_scaling(_llama3(8.0, 2.0, 8.0)), lambda m: m),
    "llama3 8 (1, 4), max_position_embeddings x2": (
        lambda s: s.replace(scaling=_llama3(8.0, 1.0, 4.0), max_position_embeddings=2 * s.max_position_embeddings),
        lambda m: 2 * m,
    ),
    "dynamic 2": (_scaling(RopeScaling("dynamic", factor=2.0)), lambda m: m),
    "dynamic 3": (_scaling(RopeScaling("dynamic", factor=3.0)), lambda m: m),
    "dynamic 2, max_position_embeddings x2": (
        lambda s: s.replace(
            scaling=RopeScaling("dynamic", factor=2.0), max_position_embeddings=2 * s.max_position_embeddings
        ),
        lambda m: 2 * m,
    ),
    "longrope 64": (lambda s: _longrope(s, 2.0, 64), lambda m: m),
    "longrope 64, max_position_embeddings x2": (
        lambda s: _longrope(s, 2.0, 64).replace(max_position_embeddings=2 * s.max_position_embeddings),
        lambda m: 2 * m,
    ),
    "longrope 256": (lambda s: _longrope(s, 2.0, 256), lambda m: m),
    "longrope 64, other long factors": (lambda s: _longrope(s, 3.0, 64), lambda m: m),
    "layout swapped": (lambda s: s.replace(layout="gptj" if s.layout == "neox" else "neox"), lambda m: m),
    "rotary_dim halved": (
        lambda s: s.replace(rotary_dim=s.rotary_dim // 2) if s.rotary_dim % 4 == 0 and not s.mrope_section else s,
        lambda m: m,
    ),
    "attention_factor x1.2": (lambda s: s.replace(attention_factor=s.attention_factor * 1.2), lambda m: m),
}


def variant_config(config: ModelConfig, name: str) -> ModelConfig | None:
    """``config`` under variant ``name``, or None where the variant is no valid spec for it."""
    change, max_positions = VARIANTS[name]
    try:
        rope = change(config.rope)
        layer_ropes = (
            None if config.layer_ropes is None else tuple(None if r is None else change(r) for r in config.layer_ropes)
        )
        return config.replace(
            rope=rope, layer_ropes=layer_ropes, max_position_embeddings=max_positions(config.max_position_embeddings)
        )
    except ConfigError:  # a variant this architecture cannot take (e.g. LongRoPE on an mRoPE spec)
        return None


# ---------------------------------------------------------------------- the ground truth


def computation(contract: CacheContract, x: torch.Tensor) -> list[torch.Tensor | None]:
    """What each layer's RoPE makes of ``x [1, 1, head_dim]`` at every (position, length) of
    :data:`LENGTHS`: ``[pairs, head_dim]`` float64 per layer, None for a NoPE layer."""
    out: list[torch.Tensor | None] = []
    for layer in range(contract.num_layers):
        spec = contract.layer_rope(layer)
        if spec is None:
            out.append(None)
            continue
        rows = []
        for length in LENGTHS:
            for p in sorted({0, min(1, length - 1), length // 2, length - 1}):
                rows.append(spec.rotate(x, torch.tensor([p]), seq_len=length)[0, 0])
        out.append(torch.stack(rows))
    return out


def same_computation(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    if len(a) != len(b):
        return False
    for ta, tb in zip(a, b):
        if (ta is None) != (tb is None):
            return False
        if ta is not None and tb is not None:
            if ta.shape != tb.shape:
                return False
            if float((ta - tb).abs().max()) > TRUTH_RTOL * max(float(ta.abs().max()), 1.0):
                return False
    return True


def spec_fields(c: CacheContract) -> dict[str, Any]:
    """Every RoPE field of every layer, flat (``rope.theta``, ``layers.1.rope.scaling.factor``): what
    a refusal may name."""
    out: dict[str, Any] = {}

    def flat(prefix: str, spec: RopeSpec | None) -> None:
        out[prefix] = None if spec is None else "RoPE"
        if spec is None:
            return
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if f.name == "scaling":
                for k in dataclasses.fields(value):
                    out[f"{prefix}.scaling.{k.name}"] = getattr(value, k.name)
            else:
                out[f"{prefix}.{f.name}"] = value

    flat("rope", c.rope)
    for i in range(c.num_layers):
        flat(f"layers.{i}.rope", c.layer_rope(i))
    return out


# ---------------------------------------------------------------------- the sweep


@dataclass
class Counts:
    pairs: int = 0
    equal: int = 0
    equal_accepted: int = 0
    different: int = 0
    different_refused: int = 0
    controls: int = 0
    controls_refused: int = 0
    skipped_variants: int = 0
    wrong: list[str] = dataclasses.field(default_factory=list)


def controls(base: CacheContract, config: ModelConfig) -> dict[str, CacheContract]:
    """Contracts differing from ``base`` in one non-RoPE field each (the field -> the contract)."""
    return {
        "key_form": base.with_key_form("raw"),
        "window": base.replace(window=3, window_layers=tuple(range(base.num_layers)), chunk_size=None, chunk_layers=()),
        "dtype": base.replace(dtype="bfloat16"),
        "block_size": base.replace(block_size=base.block_size * 2),
        "block_layout": base.replace(block_layout="blocks,2,heads,block,dim"),
        "kv_quant": base.replace(
            dtype="float8_e4m3fn",
            kv_quant=KvQuant("per_tensor", "after_rope" if base.key_form == "rotated" else "before_rope"),
        ),
        "weights_fingerprint": base.replace(weights_fingerprint="another-model"),
        "config_fingerprint": CacheContract.for_model(
            config.replace(rms_norm_eps=config.rms_norm_eps * 10), key_form="rotated", weights_fingerprint="weights"
        ),
    }


def sweep(archs: tuple[str, ...], variants: tuple[str, ...] = tuple(VARIANTS), counts: Counts | None = None) -> Counts:
    counts = counts or Counts()
    for arch in archs:
        config = arch_config(arch)
        contracts: dict[str, CacheContract] = {}
        for name in variants:
            cfg = variant_config(config, name)
            if cfg is None:
                counts.skipped_variants += 1
                continue
            contracts[name] = CacheContract.for_model(cfg, key_form="rotated", weights_fingerprint="weights")
        head_dim = contracts["as configured"].head_dim  # an MLA row's, where the model is MLA
        x = torch.randn(1, 1, head_dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        computed = {name: computation(c, x) for name, c in contracts.items()}
        for a, b in itertools.combinations(contracts, 2):
            counts.pairs += 1
            ca, cb = contracts[a], contracts[b]
            fields = [d.field for d in ca.diff(cb)]
            label = f"{arch}: {a!r} vs {b!r}"
            if same_computation(computed[a], computed[b]):
                counts.equal += 1
                if fields:
                    counts.wrong.append(f"{label}: the same computation refused naming {fields}")
                else:
                    counts.equal_accepted += 1
                continue
            counts.different += 1
            fa, fb = spec_fields(ca), spec_fields(cb)
            changed = {k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k)}
            named = [f for f in fields if f != "layer_ropes"]
            if not fields:
                counts.wrong.append(f"{label}: a different computation accepted")
            elif not set(named) <= changed or not named:
                counts.wrong.append(f"{label}: refused naming {fields}, but the specs differ in {sorted(changed)}")
            else:
                counts.different_refused += 1
        base = contracts["as configured"]
        for field, other in controls(base, config).items():
            counts.controls += 1
            fields = [d.field for d in base.diff(other)]
            if field in fields:
                counts.controls_refused += 1
            else:
                counts.wrong.append(f"{arch}: control {field!r} not named (named {fields})")
    return counts


def main(argv: list[str]) -> int:
    archs = tuple(argv) or ARCHITECTURES
    counts = sweep(archs)
    print(
        f"architectures: {len(archs)}; variants per architecture: {len(VARIANTS)} ({counts.skipped_variants} not valid there)"
    )
    print(f"pairs: {counts.pairs}")
    print(f"  computing the same:    {counts.equal}, accepted {counts.equal_accepted}")
    print(f"  computing differently: {counts.different}, refused naming a differing field {counts.different_refused}")
    print(f"controls (non-RoPE fields): {counts.controls}, refused naming the field {counts.controls_refused}")
    print(f"wrong: {len(counts.wrong)}")
    for line in counts.wrong[:40]:
        print("  " + line)
    return 1 if counts.wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
