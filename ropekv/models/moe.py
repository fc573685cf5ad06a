"""Mixture-of-experts MLPs as data: the router and the experts of mixtral, qwen2_moe, qwen3_moe, granitemoe,
deepseek_v2, deepseek_v3, glm4_moe, llama4 and gpt_oss.

MoE changes nothing about RoPE or the cache, but a decoder that cannot run its MLP cannot be checked.
:class:`MoeSpec` holds every number the MLP uses; both the float64 reference and the engine compute
from it. Canonical tensors (per layer, under ``model.layers.{i}.mlp.``): ``gate.weight [E, hidden]``
(the router), ``experts.gate_up_proj [E, 2 * I, hidden]`` and ``experts.down_proj [E, hidden, I]``
(transformers 5's fused expert layout), and for a shared expert ``shared_expert.{gate,up,down}_proj``
plus ``shared_expert_gate.weight [1, hidden]`` (qwen2_moe: its output times ``sigmoid(gate(h))``).

Routers (transformers' ``*TopKRouter``):

- ``softmax_topk`` (mixtral, qwen2_moe, qwen3_moe): softmax over all experts, keep the top k,
  renormalize them to sum 1 iff ``normalize``;
- ``topk_softmax`` (granitemoe, gpt_oss): top k router logits, softmax over those k;
- ``sigmoid_group`` (deepseek_v3, glm4_moe): ``s = sigmoid(logits)``; choice scores ``s + bias``
  (``mlp.gate.e_score_correction_bias [E]``); the ``n_group`` groups ranked by the sum of their two
  best choice scores, the best ``topk_group`` kept; top k experts by choice score among those; weights
  are ``s`` (not the biased scores) of the chosen, renormalized (``/ (sum + 1e-20)``) iff
  ``normalize``, times ``routed_scaling_factor``;
- ``softmax_greedy`` (deepseek_v2 ``greedy``): top k of the softmax, times ``routed_scaling_factor``,
  never renormalized (deepseek_v2's router ignores ``norm_topk_prob``);
- ``softmax_group_limited`` (deepseek_v2 ``group_limited_greedy``): groups ranked by their best
  softmax score, the best ``topk_group`` kept, the others' scores set to 0, then top k, times
  ``routed_scaling_factor``;
- ``topk_sigmoid_input`` (llama4's ``Llama4Router``): top k router logits, their sigmoid is each
  chosen expert's score, and the score multiplies the expert's *input* (``expert(h * score)``, not
  ``score * expert(h)``: the experts are not linear); a shared expert of ``shared_expert_size`` is
  added ungated (``shared_expert_gated=False``).

``shared_experts_size`` (deepseek, glm4_moe): an ungated shared MLP ``mlp.shared_experts.{gate,up,down}_proj``
of intermediate size ``n_shared_experts * moe_intermediate_size``, added to the routed output.

gpt_oss adds biases (``gate.bias [E]``, ``experts.gate_up_proj_bias [E, 2 * I]``,
``experts.down_proj_bias [E, hidden]``) and its experts' clamped SwiGLU instead of ``act(gate) * up``:
``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``
(``GptOssExperts._apply_gate``; ``hidden_act`` is not read). Its checkpoint stores gate and up
interleaved and transposed; :func:`~ropekv.models.families.canonical_weights` maps them to the
canonical gate-then-up rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from ..errors import ConfigError
from .limits import MAX_EXPERTS, MAX_WIDTH, check_int

Router = Literal[
    "softmax_topk", "topk_softmax", "sigmoid_group", "softmax_greedy", "softmax_group_limited", "topk_sigmoid_input"
]
ROUTERS: tuple[str, ...] = get_args(Router)
GROUPED = ("sigmoid_group", "softmax_group_limited")


@dataclass(frozen=True)
class MoeSpec:
    router: Router
    num_experts: int
    top_k: int
    expert_size: int  # intermediate size of one expert
    normalize: bool  # renormalize the top-k probabilities (softmax_topk)
    shared_expert_size: int | None = None  # qwen2_moe: a gated shared expert of this intermediate size
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the MoE; the others are dense
    num_groups: int = 1  # n_group (grouped routers)
    top_groups: int = 1  # topk_group (grouped routers)
    routed_scale: float = 1.0  # routed_scaling_factor
    shared_experts_size: int | None = None  # deepseek / glm4_moe: ungated shared experts of this size
    correction_bias: bool = False  # sigmoid_group: the router has e_score_correction_bias
    shared_expert_gated: bool = True  # qwen2_moe: times sigmoid(shared_expert_gate(h)); llama4: plain sum
    bias: bool = False  # gpt_oss: router and expert projections carry biases
    swiglu_limit: float | None = None  # gpt_oss: the clamped SwiGLU with this limit (None: act(gate) * up)
    swiglu_alpha: float | None = None  # its sigmoid gain

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"unknown MoE router {self.router!r}")
        for name, high in (("num_experts", MAX_EXPERTS), ("top_k", MAX_EXPERTS), ("expert_size", MAX_WIDTH)):
            check_int(f"MoE {name}", getattr(self, name), 1, high)
        if self.top_k > self.num_experts:
            raise ConfigError(f"MoE top_k {self.top_k} exceeds num_experts {self.num_experts}")
        for name in ("shared_expert_size", "shared_experts_size"):
            if getattr(self, name) is not None:
                check_int(f"MoE {name}", getattr(self, name), 1, MAX_WIDTH)
        if self.router in GROUPED:
            g, k = self.num_groups, self.top_groups
            if not (isinstance(g, int) and isinstance(k, int)) or g < 1 or not 1 <= k <= g or self.num_experts % g:
                raise ConfigError(
                    f"MoE grouped routing needs n_group dividing the {self.num_experts} experts and "
                    f"1 <= topk_group <= n_group, got n_group={g!r}, topk_group={k!r}"
                )
            if self.router == "sigmoid_group" and self.num_experts // g < 2:
                raise ConfigError(
                    f"MoE sigmoid group routing ranks groups by their two best experts: n_group {g} "
                    f"leaves {self.num_experts // g} expert(s) per group"
                )
            if self.top_k > k * (self.num_experts // g):
                raise ConfigError(
                    f"MoE top_k {self.top_k} exceeds the {k * (self.num_experts // g)} experts of the {k} groups kept"
                )
        if (
            isinstance(self.routed_scale, bool)
            or not isinstance(self.routed_scale, (int, float))
            or not math.isfinite(self.routed_scale)
        ):
            raise ConfigError(f"MoE routed_scaling_factor must be a finite number, got {self.routed_scale!r}")
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            raise ConfigError("MoE clamped SwiGLU needs both swiglu_limit and swiglu_alpha")
        for name in ("swiglu_limit", "swiglu_alpha"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
            ):
                raise ConfigError(f"MoE {name} must be a finite number > 0, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "router": self.router,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "expert_size": self.expert_size,
            "normalize": self.normalize,
            "shared_expert_size": self.shared_expert_size,
            "sparse_layers": list(self.sparse_layers),
        }
        if self.router in ("sigmoid_group", "softmax_greedy", "softmax_group_limited"):
            d.update(
                {
                    "num_groups": self.num_groups,
                    "top_groups": self.top_groups,
                    "routed_scale": self.routed_scale,
                    "shared_experts_size": self.shared_experts_size,
                    "correction_bias": self.correction_bias,
                }
            )
        if not self.shared_expert_gated:  # written only where it differs: earlier fingerprints stay
            d["shared_expert_gated"] = False
        if self.bias or self.swiglu_limit is not None:  # gpt_oss; left out elsewhere (fingerprints unchanged)
            d.update(bias=self.bias, swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        return d


def read_moe(kind: str, config: Mapping[str, Any], num_layers: int, source: str) -> MoeSpec:
    """The MoE MLP of a ``kind`` family (``FAMILIES[...].reading.moe``) from its config.json."""

    def integer(*names: str) -> int:
        for name in names:
            value = config.get(name)
            if value is not None:
                return check_int(f"{source}: field {name!r}", value, 1, MAX_WIDTH)
        raise ConfigError(f"{source}: missing field {names[0]!r}")

    experts = integer("num_local_experts", "num_experts", "n_routed_experts")
    top_k = integer("num_experts_per_tok")
    layers = tuple(range(num_layers))
    if kind in ("qwen2_moe", "qwen3_moe"):
        step = integer("decoder_sparse_step") if config.get("decoder_sparse_step") is not None else 1
        dense = config.get("mlp_only_layers") or []
        if not isinstance(dense, list):
            raise ConfigError(f"{source}: field 'mlp_only_layers' must be a list")
        layers = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
        return MoeSpec(
            "softmax_topk",
            experts,
            top_k,
            integer("moe_intermediate_size"),
            normalize=bool(config.get("norm_topk_prob", False)),
            shared_expert_size=integer("shared_expert_intermediate_size") if kind == "qwen2_moe" else None,
            sparse_layers=layers,
        )
    if kind == "mixtral":
        return MoeSpec(
            "softmax_topk", experts, top_k, integer("intermediate_size"), normalize=True, sparse_layers=layers
        )
    if kind in ("deepseek_v3", "glm4_moe", "deepseek_v2"):
        return _read_deepseek(kind, config, num_layers, source, experts, top_k, integer)
    if kind == "llama4":
        # Llama4TextConfig: moe_layers, else every interleave_moe_layer_step-th layer from step - 1;
        # experts and the shared expert have intermediate_size, dense layers intermediate_size_mlp.
        step = integer("interleave_moe_layer_step") if config.get("interleave_moe_layer_step") is not None else 1
        given = config.get("moe_layers")
        if given is not None:
            if not isinstance(given, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in given):
                raise ConfigError(f"{source}: field 'moe_layers' must list layer indices in [0, {num_layers})")
            layers = tuple(sorted(set(given)))
        else:
            layers = tuple(range(step - 1, num_layers, step))
        size = integer("intermediate_size")
        return MoeSpec(
            "topk_sigmoid_input",
            experts,
            top_k,
            size,
            normalize=False,
            shared_expert_size=size,
            sparse_layers=layers,
            shared_expert_gated=False,
        )
    if kind == "granitemoe":
        return MoeSpec(
            "topk_softmax", experts, top_k, integer("intermediate_size"), normalize=False, sparse_layers=layers
        )
    if kind == "gpt_oss":

        def positive(name: str) -> float:
            value = config.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{source}: field {name!r} must be a finite number > 0, got {value!r}")
            return float(value)

        return MoeSpec(
            "topk_softmax",
            experts,
            top_k,
            integer("intermediate_size"),
            normalize=False,
            sparse_layers=layers,
            bias=True,
            swiglu_limit=positive("swiglu_limit"),
            swiglu_alpha=positive("swiglu_alpha"),
        )
    raise ConfigError(f"{source}: unknown MoE kind {kind!r}")


def _read_deepseek(
    kind: str, config: Mapping[str, Any], num_layers: int, source: str, experts: int, top_k: int, integer
) -> MoeSpec:
    """deepseek_v2/v3 and glm4_moe: MoE on layers ``first_k_dense_replace..``, shared experts, grouped routing."""
    first = config.get("first_k_dense_replace") or 0
    check_int(f"{source}: field 'first_k_dense_replace'", first, 0)
    scale = config.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ConfigError(f"{source}: field 'routed_scaling_factor' must be a number, got {scale!r}")
    shared = config.get("n_shared_experts")
    if shared is not None:
        check_int(f"{source}: field 'n_shared_experts'", shared, 0, MAX_EXPERTS)
    size = integer("moe_intermediate_size")
    if not shared:  # transformers builds the shared MLP whatever n_shared_experts is; 0 would be an empty MLP
        raise ConfigError(
            f"{source}: {kind} with n_shared_experts={shared!r}: transformers always builds the shared "
            "experts, of intermediate size n_shared_experts * moe_intermediate_size"
        )
    common = dict(
        num_experts=experts,
        top_k=top_k,
        expert_size=size,
        sparse_layers=tuple(range(first, num_layers)),
        routed_scale=float(scale),
        shared_experts_size=shared * size,
    )
    try:
        if kind == "deepseek_v2":
            method = config.get("topk_method", "greedy")
            if method == "greedy":
                return MoeSpec("softmax_greedy", normalize=False, **common)
            if method == "group_limited_greedy":
                return MoeSpec(
                    "softmax_group_limited",
                    normalize=False,
                    num_groups=_given(config, "n_group"),
                    top_groups=_given(config, "topk_group"),
                    **common,
                )
            raise ConfigError(
                f"deepseek_v2 topk_method {method!r} is not one transformers' DeepseekV2TopkRouter "
                "runs (greedy, group_limited_greedy)"
            )
        return MoeSpec(
            "sigmoid_group",
            normalize=bool(config.get("norm_topk_prob", False)),
            num_groups=_given(config, "n_group"),
            top_groups=_given(config, "topk_group"),
            correction_bias=True,
            **common,
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _given(config: Mapping[str, Any], name: str) -> Any:
    """``config[name]`` as given, None where absent: MoeSpec validates it, naming the field."""
    return config.get(name)
