"""Mixture-of-experts MLPs as data: the router and the experts of mixtral, qwen2_moe, qwen3_moe, granitemoe, gpt_oss.

MoE changes nothing about RoPE or the cache, but a decoder that cannot run its MLP cannot be checked.
:class:`MoeSpec` holds every number the MLP uses; both the float64 reference and the engine compute
from it. Canonical tensors (per layer, under ``model.layers.{i}.mlp.``): ``gate.weight [E, hidden]``
(the router), ``experts.gate_up_proj [E, 2 * I, hidden]`` and ``experts.down_proj [E, hidden, I]``
(transformers 5's fused expert layout), and for a shared expert ``shared_expert.{gate,up,down}_proj``
plus ``shared_expert_gate.weight [1, hidden]`` (qwen2_moe: its output times ``sigmoid(gate(h))``).

Routers (transformers' ``*TopKRouter``):

- ``softmax_topk`` (mixtral, qwen2_moe, qwen3_moe): softmax over all experts, keep the top k,
  renormalize them to sum 1 iff ``normalize``;
- ``topk_softmax`` (granitemoe, gpt_oss): top k router logits, softmax over those k.

gpt_oss adds biases (``gate.bias [E]``, ``experts.gate_up_proj_bias [E, 2 * I]``,
``experts.down_proj_bias [E, hidden]``) and its experts' clamped SwiGLU instead of ``act(gate) * up``:
``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``
(``GptOssExperts._apply_gate``; ``hidden_act`` is not read). Its checkpoint stores gate and up
interleaved and transposed; :func:`~ropekv.models.families.canonical_weights` maps them to the
canonical gate-then-up rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from ..errors import ConfigError

Router = Literal["softmax_topk", "topk_softmax"]


@dataclass(frozen=True)
class MoeSpec:
    router: Router
    num_experts: int
    top_k: int
    expert_size: int  # intermediate size of one expert
    normalize: bool  # renormalize the top-k probabilities (softmax_topk)
    shared_expert_size: int | None = None  # qwen2_moe: a gated shared expert of this intermediate size
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the MoE; the others are dense
    bias: bool = False  # gpt_oss: router and expert projections carry biases
    swiglu_limit: float | None = None  # gpt_oss: the clamped SwiGLU with this limit (None: act(gate) * up)
    swiglu_alpha: float | None = None  # its sigmoid gain

    def __post_init__(self) -> None:
        if self.router not in ("softmax_topk", "topk_softmax"):
            raise ConfigError(f"unknown MoE router {self.router!r}")
        for name in ("num_experts", "top_k", "expert_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"MoE {name} must be a positive integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"MoE top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.shared_expert_size is not None and (not isinstance(self.shared_expert_size, int)
                                                    or self.shared_expert_size < 1):
            raise ConfigError(f"MoE shared_expert_size must be a positive integer, got {self.shared_expert_size!r}")
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            raise ConfigError("MoE clamped SwiGLU needs both swiglu_limit and swiglu_alpha")
        for name in ("swiglu_limit", "swiglu_alpha"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise ConfigError(f"MoE {name} must be a finite number > 0, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        d = {"router": self.router, "num_experts": self.num_experts, "top_k": self.top_k,
             "expert_size": self.expert_size, "normalize": self.normalize,
             "shared_expert_size": self.shared_expert_size, "sparse_layers": list(self.sparse_layers)}
        if self.bias or self.swiglu_limit is not None:  # gpt_oss; left out elsewhere (fingerprints unchanged)
            d.update(bias=self.bias, swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        return d


def read_moe(kind: str, config: Mapping[str, Any], num_layers: int, source: str) -> MoeSpec:
    """The MoE MLP of a ``kind`` family (``FAMILIES[...].moe``) from its config.json."""
    def integer(*names: str) -> int:
        for name in names:
            value = config.get(name)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ConfigError(f"{source}: field {name!r} must be a positive integer, got {value!r}")
                return value
        raise ConfigError(f"{source}: missing field {names[0]!r}")

    experts = integer("num_local_experts", "num_experts")
    top_k = integer("num_experts_per_tok")
    layers = tuple(range(num_layers))
    if kind in ("qwen2_moe", "qwen3_moe"):
        step = integer("decoder_sparse_step") if config.get("decoder_sparse_step") is not None else 1
        dense = config.get("mlp_only_layers") or []
        if not isinstance(dense, list):
            raise ConfigError(f"{source}: field 'mlp_only_layers' must be a list")
        layers = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
        return MoeSpec("softmax_topk", experts, top_k, integer("moe_intermediate_size"),
                       normalize=bool(config.get("norm_topk_prob", False)),
                       shared_expert_size=integer("shared_expert_intermediate_size") if kind == "qwen2_moe" else None,
                       sparse_layers=layers)
    if kind == "mixtral":
        return MoeSpec("softmax_topk", experts, top_k, integer("intermediate_size"), normalize=True,
                       sparse_layers=layers)
    if kind == "granitemoe":
        return MoeSpec("topk_softmax", experts, top_k, integer("intermediate_size"), normalize=False,
                       sparse_layers=layers)
    if kind == "gpt_oss":
        def positive(name: str) -> float:
            value = config.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{source}: field {name!r} must be a finite number > 0, got {value!r}")
            return float(value)

        return MoeSpec("topk_softmax", experts, top_k, integer("intermediate_size"), normalize=False,
                       sparse_layers=layers, bias=True, swiglu_limit=positive("swiglu_limit"),
                       swiglu_alpha=positive("swiglu_alpha"))
    raise ConfigError(f"{source}: unknown MoE kind {kind!r}")
