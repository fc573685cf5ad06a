"""The RoPE a llama.cpp context runs: the settings a caller gives it, and what its graph computes with.

A context's RoPE is not the model's: ``llama_context_params`` overrides the base (``rope_freq_base``),
the linear factor (``rope_freq_scale``), the scaling type and YaRN's parameters, and llama.cpp resolves
them against the GGUF's metadata when the context is made. There is no getter for the result, so
ropekv reads it where it is used: every ``ROPE`` node of the graph carries ``ggml_rope_ext``'s
arguments in its ``op_params`` (ggml.c, ``ggml_rope_impl``: int32 ``[0, n_dims, mode, 0, n_ctx_orig]``
then float32 ``freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow`` at 5..10).
:class:`RopeRun` is that record and :meth:`RopeRun.spec` the :class:`~ropekv.rope.RopeSpec` it
computes, so two contexts' contracts compare what their kernels turn keys with, not what was asked.

The mapping follows ggml's CPU kernel (``rope_yarn``): ``theta = freq_scale * theta_extrap`` mixed
back towards ``theta_extrap`` by YaRN's ramp times ``ext_factor``, and cos/sin scaled by ``attn_factor``
(times ``1 + 0.1 ln(1 / freq_scale)`` where ``ext_factor`` is not 0). ``ext_factor`` 0 is linear
interpolation (or none at scale 1); 1 is YaRN as transformers computes it with ``truncate`` (floor and
ceil of the correction dims). Another ``ext_factor`` mixes the two in a way no
:class:`~ropekv.rope.RopeScaling` describes, and is refused.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Literal, get_args

from ...errors import ConfigError, UsageError
from ...numbers import is_finite_number, is_int
from ...rope import RopeScaling, RopeSpec

ScalingType = Literal["none", "linear", "yarn"]
SCALING_TYPES: tuple[str, ...] = get_args(ScalingType)
# enum llama_rope_scaling_type (llama.h); the same in llama_cpp.LLAMA_ROPE_SCALING_TYPE_*.
_SCALING_ENUM = {"none": 0, "linear": 1, "yarn": 2}
_MODE_NEOX = 2  # GGML_ROPE_TYPE_NEOX; 0 is llama's "NORM" (interleaved pairs)
MAX_ORIG_CTX = 2**24  # a YaRN original context beyond any model's (16M tokens)


@dataclass(frozen=True)
class RopeOverrides:
    """The RoPE fields of ``llama_context_params`` a caller sets; None keeps llama.cpp's default (which
    reads the model's metadata). Each value is checked here, before llama.cpp sees it."""

    freq_base: float | None = None
    freq_scale: float | None = None
    scaling_type: ScalingType | None = None
    yarn_orig_ctx: int | None = None
    yarn_ext_factor: float | None = None
    yarn_attn_factor: float | None = None
    yarn_beta_fast: float | None = None
    yarn_beta_slow: float | None = None

    def __post_init__(self) -> None:
        bounds = {
            "freq_base": (1.0, 1e12),
            "freq_scale": (1e-6, 1e6),
            "yarn_ext_factor": (0.0, 1.0),
            "yarn_attn_factor": (1e-6, 1e6),
            "yarn_beta_fast": (0.0, 1e6),
            "yarn_beta_slow": (0.0, 1e6),
        }
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if value is not None and not (
                is_finite_number(value) and not isinstance(value, bool) and low <= value <= high
            ):
                raise UsageError(f"llama.cpp {name} must be a finite number in [{low:g}, {high:g}], got {value!r}")
        if self.scaling_type is not None and self.scaling_type not in SCALING_TYPES:
            raise UsageError(f"llama.cpp rope scaling type must be one of {SCALING_TYPES}, got {self.scaling_type!r}")
        orig = self.yarn_orig_ctx
        if orig is not None and not (is_int(orig) and 1 <= orig <= MAX_ORIG_CTX):
            raise UsageError(f"llama.cpp yarn_orig_ctx must be an integer in [1, {MAX_ORIG_CTX}], got {orig!r}")

    def apply(self, params) -> None:
        """Set the given fields on a ``llama_context_params`` (the others keep their defaults)."""
        for name in ("freq_base", "freq_scale"):
            value = getattr(self, name)
            if value is not None:
                setattr(params, f"rope_{name}", float(value))
        if self.scaling_type is not None:
            params.rope_scaling_type = _SCALING_ENUM[self.scaling_type]
        for name in ("yarn_orig_ctx", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow"):
            value = getattr(self, name)
            if value is not None:
                setattr(params, name, value)

    def label(self) -> str:
        """``"rope_freq_base=20000"``, the given fields only; ``"model defaults"`` when none is."""
        parts = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.given().items()]
        return ", ".join(parts) or "model defaults"

    def given(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is not None:
                out[name if name.startswith("yarn") else f"rope_{name}"] = value
        return out


@dataclass(frozen=True)
class RopeRun:
    """What one ``ROPE`` node of a llama.cpp graph computes with (its ``op_params``)."""

    n_dims: int  # rotated channels per head
    mode: int  # 0: NORM (interleaved pairs), 2: NEOX
    n_ctx_orig: int  # YaRN's original context (read only where ext_factor != 0)
    freq_base: float
    freq_scale: float
    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float

    @classmethod
    def from_op_params(cls, words: list[int]) -> RopeRun:
        """``words``: the node's ``op_params`` as int32 (at least 11)."""
        if len(words) < 11:
            raise ValueError(f"a ROPE node has 11 op_params or more, got {len(words)}")
        floats = struct.unpack("<6f", struct.pack("<6i", *words[5:11]))
        return cls(int(words[1]), int(words[2]), int(words[4]), *(float(f) for f in floats))

    def spec(self, model: RopeSpec) -> RopeSpec:
        """The :class:`RopeSpec` these arguments compute, on ``model``'s head size and positions."""
        if self.n_dims != model.rotary_dim:
            raise ConfigError(f"llama.cpp rotates {self.n_dims} channels per head, the model {model.rotary_dim}")
        if not (self.freq_scale > 0 and self.freq_base > 1 and self.attn_factor > 0):
            raise ConfigError(f"llama.cpp RoPE arguments out of range: {self}")
        factor = 1.0 / self.freq_scale
        attention_factor = self.attn_factor
        if self.ext_factor == 0.0:
            scaling = RopeScaling() if self.freq_scale == 1.0 else RopeScaling("linear", factor=factor)
        elif self.ext_factor == 1.0:
            scaling = RopeScaling(
                "yarn",
                factor=factor,
                original_max_position_embeddings=self.n_ctx_orig,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                truncate=True,
            )
            attention_factor *= 1.0 + 0.1 * math.log(factor)  # ggml's YaRN mscale (rope_yarn)
        else:
            raise ConfigError(
                f"llama.cpp YaRN ext_factor {self.ext_factor:g} mixes interpolation and extrapolation in a "
                "way ropekv's RoPE spec does not describe (0: linear, 1: YaRN)"
            )
        return model.replace(
            theta=self.freq_base,
            layout="neox" if self.mode & _MODE_NEOX else "gptj",
            scaling=scaling,
            attention_factor=attention_factor,
        )
