"""Multi-head latent attention (MLA, DeepSeek V2/V3) as data: the sizes its projections use.

transformers' ``DeepseekV3Attention`` / ``DeepseekV2Attention`` (5.x), per token ``h [hidden]``:

- query: ``q_b_proj(q_a_layernorm(q_a_proj(h)))`` (``q_lora_rank`` set) or ``q_proj(h)``, viewed
  ``[H, qk_nope_head_dim + qk_rope_head_dim]`` and split into ``q_nope`` and ``q_pe``;
- ``kv_a_proj_with_mqa(h)`` -> the compressed latent ``[kv_lora_rank]`` and ``k_pe
  [qk_rope_head_dim]``, one rope head shared by all heads; ``kv_a_layernorm`` on the latent;
- ``kv_b_proj(latent)`` -> per head ``k_nope [qk_nope_head_dim]`` and ``v [v_head_dim]``;
- RoPE turns ``q_pe`` and ``k_pe`` only; the key the kernel multiplies is ``[k_nope, k_pe]`` per head
  (``k_pe`` broadcast), the query ``[q_nope, q_pe]``; softmax scale ``qk_head_dim ** -0.5`` (times
  ``mscale ** 2`` under yarn with ``mscale_all_dim``); ``o_proj`` reads ``[H * v_head_dim]``.

``q_a_layernorm`` and ``kv_a_layernorm`` are RMSNorms built without the config's epsilon: they use
transformers' default ``1e-6`` whatever ``rms_norm_eps`` says (:data:`LATENT_NORM_EPS`).

In ropekv's :class:`~ropekv.models.config.ModelConfig` an MLA model has ``head_dim = qk_nope_head_dim +
qk_rope_head_dim`` (the key's size per head), ``num_kv_heads = num_heads`` (keys are per head once
expanded) and a :class:`~ropekv.rope.RopeSpec` with ``rotary_offset = qk_nope_head_dim``: the rope part
is the last ``qk_rope_head_dim`` channels of each key. What the cache holds is the contract's
:class:`~ropekv.contract.MlaCache` (docs/architectures.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .limits import MAX_WIDTH, check_int

LATENT_NORM_EPS = 1e-6  # DeepseekV{2,3}RMSNorm(q_lora_rank / kv_lora_rank): the class default, not rms_norm_eps


@dataclass(frozen=True)
class MlaSpec:
    """The sizes of one MLA attention (the same on every layer)."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"MLA qk_rope_head_dim must be even (channel pairs rotate), got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """The query's and key's size per head: the no-position part then the rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def to_dict(self) -> dict[str, Any]:
        return {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
        }


def _positive(name: str, value: Any) -> None:
    check_int(f"MLA field {name!r}", value, 1, MAX_WIDTH)


def read_mla(config: dict, num_heads: int, source: str) -> MlaSpec:
    """The MLA sizes of a deepseek_v2/v3 ``config.json``, refusing what transformers' attention
    cannot run as described (grouped KV heads over expanded keys, a rotary head dim other than the rope part)."""

    def need(name: str) -> Any:
        if config.get(name) is None:
            raise ConfigError(f"{source}: missing field {name!r}")
        return config[name]

    try:
        spec = MlaSpec(
            q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=need("kv_lora_rank"),
            qk_nope_head_dim=need("qk_nope_head_dim"),
            qk_rope_head_dim=need("qk_rope_head_dim"),
            v_head_dim=need("v_head_dim"),
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    kv = config.get("num_key_value_heads")
    if kv is not None and kv != num_heads:
        raise ConfigError(
            f"{source}: MLA with num_key_value_heads {kv} != num_attention_heads {num_heads}: the "
            "expanded keys have one head per query head, and transformers' attention would group them "
            "again; ropekv refuses to check it under another reading"
        )
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != spec.qk_rope_head_dim:
        raise ConfigError(
            f"{source}: MLA config with head_dim {head_dim} != qk_rope_head_dim {spec.qk_rope_head_dim}: "
            "transformers sizes the rotary frequencies by head_dim but rotates only the rope part, "
            "a config it cannot run"
        )
    if spec.v_head_dim > spec.qk_head_dim:
        raise ConfigError(
            f"{source}: MLA v_head_dim {spec.v_head_dim} > qk_nope_head_dim + qk_rope_head_dim "
            f"{spec.qk_head_dim}: ropekv's cache pads values to the key's head size and cannot hold "
            "wider values yet"
        )
    return spec
