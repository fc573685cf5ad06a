"""Rotary position embedding as data (:class:`RopeSpec`) and pure functions.

A rotation by position ``p`` turns each channel pair ``m`` of a query or key by the angle ``p * w_m``
(RoFormer, Su et al. 2021). The frequencies ``w = inv_freq`` come from ``theta`` and the scaling type;
the formulas mirror transformers' ``ROPE_INIT_FUNCTIONS`` (modeling_rope_utils.py), computed here in
float64. Angles and their cos/sin are always computed in float64 and applied in float32 or wider,
whatever the dtype of the tensor being rotated.

Layouts (vLLM calls the first ``is_neox_style``):

- ``"neox"`` (HF ``rotate_half``): channel ``m`` pairs with ``m + rotary_dim // 2``.
- ``"gptj"`` (llama.cpp NORM, interleaved): channel ``2m`` pairs with ``2m + 1``.

Channels outside the rotated slice pass through unchanged: ``rotary_dim:head_dim`` for partial rotary
(the rotated channels lead), and ``0:rotary_offset`` for multi-head latent attention (DeepSeek V2/V3:
the key is ``[k_nope, k_pe]`` and only the trailing decoupled rope part ``k_pe`` rotates).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

import torch

from .errors import ConfigError
from .numbers import check_number, is_finite_number, is_int, is_real

Layout = Literal["neox", "gptj"]  # NeoX/HF rotate_half pairs m with m + d/2; GPT-J/llama.cpp pairs 2m, 2m+1
LAYOUTS: tuple[str, ...] = get_args(Layout)
SCALING_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")

# Parameters each scaling type requires (after defaults are filled in) and may take.
REQUIRED_PARAMS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
OPTIONAL_PARAMS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": (),
    "dynamic": (),
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "llama3": (),
    "longrope": ("factor",),
}
# Far above any real model (<= 512); bounds what a config can make us allocate for frequencies.
MAX_HEAD_DIM = 65536
# Far above any real context (~10M tokens); keeps every position an int64 and every angle finite.
MAX_POSITIONS = 2**40

_T = TypeVar("_T")


@dataclass(frozen=True)
class RopeScaling:
    """A scaling type and every parameter it uses. Unused parameters must stay None."""

    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rope_type, str) or self.rope_type not in SCALING_TYPES:
            raise ConfigError(f"unknown RoPE scaling type {self.rope_type!r}; supported: {', '.join(SCALING_TYPES)}")
        allowed = set(REQUIRED_PARAMS[self.rope_type]) | set(OPTIONAL_PARAMS[self.rope_type])
        for f in dataclasses.fields(self):
            if f.name == "rope_type":
                continue
            value = getattr(self, f.name)
            if f.name in REQUIRED_PARAMS[self.rope_type] and value is None:
                raise ConfigError(f"RoPE scaling type {self.rope_type!r} needs parameter {f.name!r}")
            if value is not None and f.name not in allowed:
                raise ConfigError(f"RoPE scaling type {self.rope_type!r} does not take parameter {f.name!r}")
        # Types and ranges: every value below ends up in a division, a log or a power.
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if getattr(self, name) is not None:
                check_number(f"RoPE scaling {name}", getattr(self, name), 0, strict=True)
        for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                check_number(f"RoPE scaling {name}", getattr(self, name), 0, strict=False)
        orig = self.original_max_position_embeddings
        if orig is not None and not (is_int(orig) and 1 <= orig <= MAX_POSITIONS):
            raise ConfigError(f"RoPE original_max_position_embeddings must be an integer in [1, 2**40], got {orig!r}")
        if self.truncate is not None and not isinstance(self.truncate, bool):
            raise ConfigError(
                f"RoPE scaling truncate has the wrong type: true or false is needed, got {self.truncate!r}"
            )
        if self.rope_type == "llama3" and self.low_freq_factor == self.high_freq_factor:
            raise ConfigError("llama3 RoPE needs low_freq_factor != high_freq_factor")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or not all(is_real(v) for v in value):
                raise ConfigError(f"longrope {name} has the wrong type: a list of numbers is needed, got {value!r}")
            if not all(is_finite_number(v) and v > 0 for v in value):
                raise ConfigError(f"longrope {name} must hold positive finite numbers")
            if isinstance(value, list):  # normalize, do not reinterpret (frozen: keep it hashable)
                object.__setattr__(self, name, tuple(value))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "rope_type" and value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RopeScaling:
        if not isinstance(data, Mapping):
            raise ConfigError(f"RoPE scaling must be an object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"unknown RoPE scaling parameter(s): {', '.join(sorted(map(str, unknown)))}")
        kwargs = dict(data)
        for name in ("short_factor", "long_factor"):
            value = kwargs.get(name)
            if value is not None:
                if not isinstance(value, (list, tuple)) or not all(is_real(v) for v in value):
                    raise ConfigError(f"longrope {name} has the wrong type: a list of numbers is needed, got {value!r}")
                if not all(is_finite_number(v) for v in value):
                    raise ConfigError(f"longrope {name} must hold positive finite numbers")
                kwargs[name] = tuple(float(v) for v in value)
        return cls(**kwargs)


@dataclass(frozen=True)
class RopeSpec:
    """Everything that determines how a position turns a query or key.

    ``attention_factor`` multiplies cos and sin (YaRN, LongRoPE), so it scales both q and k;
    ``max_position_embeddings`` is the config's value, which dynamic NTK and LongRoPE compare
    the sequence length against. ``rotary_offset``: the first rotated channel; channels
    ``rotary_offset .. rotary_offset + rotary_dim - 1`` rotate (0 for every architecture but MLA,
    whose rope part trails the per-head no-position part: offset ``qk_nope_head_dim``).

    ``mrope_section`` (Qwen2-VL's multimodal RoPE, ``rope_parameters.mrope_section``): the
    frequency pairs ``[0, rotary_dim / 2)`` cut into consecutive sections that turn by the temporal,
    height and width position streams in turn (section ``i`` by stream ``i % 3``). For text all three
    streams are the token's position: then every section turns by the same position and the rotation
    *is* the plain RoPE of this spec (checked against transformers in tests/test_mrope.py). Image-like
    positions (:class:`PositionStreams`, e.g. from :func:`image_streams`) differ per stream; the
    rotation then takes ``[3, num_tokens]`` positions (tests/test_mrope_axes.py). The sections are
    recorded so that a cache contract says the keys were written by an mRoPE model: a reader without
    them is not compatible.
    """

    head_dim: int
    rotary_dim: int
    theta: float
    layout: str = "neox"
    scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_factor: float = 1.0
    max_position_embeddings: int = 2048
    rotary_offset: int = 0
    mrope_section: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not is_int(self.head_dim) or not 2 <= self.head_dim <= MAX_HEAD_DIM or self.head_dim % 2:
            raise ConfigError(f"RoPE head_dim must be an even integer in [2, {MAX_HEAD_DIM}], got {self.head_dim!r}")
        if not is_int(self.rotary_dim) or not (2 <= self.rotary_dim <= self.head_dim) or self.rotary_dim % 2:
            raise ConfigError(
                f"RoPE rotary_dim must be even and in [2, head_dim={self.head_dim}], got {self.rotary_dim!r}"
            )
        if (
            not is_int(self.rotary_offset)
            or self.rotary_offset < 0
            or self.rotary_offset + self.rotary_dim > self.head_dim
        ):
            raise ConfigError(
                f"RoPE rotary_offset must be an integer >= 0 with rotary_offset + rotary_dim <= head_dim "
                f"({self.head_dim}), got {self.rotary_offset!r} (rotary_dim {self.rotary_dim})"
            )
        check_number("RoPE theta", self.theta, 1, strict=True)
        if not isinstance(self.layout, str) or self.layout not in LAYOUTS:
            raise ConfigError(f"unknown RoPE layout {self.layout!r}; supported: {', '.join(LAYOUTS)}")
        if not isinstance(self.scaling, RopeScaling):
            raise ConfigError(f"RoPE scaling must be a RopeScaling, got {type(self.scaling).__name__}")
        check_number("RoPE attention_factor", self.attention_factor, 0, strict=True)
        if not is_int(self.max_position_embeddings) or not 1 <= self.max_position_embeddings <= MAX_POSITIONS:
            raise ConfigError(
                f"RoPE max_position_embeddings must be an integer in [1, 2**40], got {self.max_position_embeddings!r}"
            )
        n = self.rotary_dim // 2
        if isinstance(self.mrope_section, list):  # normalize, do not reinterpret
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.mrope_section is not None:
            m = self.mrope_section
            if not isinstance(m, tuple) or not m or not all(is_int(x) and x >= 1 for x in m) or sum(m) != n:
                raise ConfigError(
                    f"RoPE mrope_section must be positive integers summing to rotary_dim/2 = {n}, got {m!r}"
                )
        s = self.scaling
        for name in ("short_factor", "long_factor"):
            value = getattr(s, name)
            if value is not None and len(value) != n:
                raise ConfigError(f"longrope {name} has {len(value)} entries, rotary_dim/2 = {n} needed")
        if self.scaling.rope_type == "dynamic" and self.rotary_dim <= 2:
            raise ConfigError("dynamic NTK RoPE needs rotary_dim > 2")
        self._check_frequencies()

    def _check_frequencies(self) -> None:
        """Every parameter is in range, but their combination can still overflow (a huge dynamic factor,
        a vanishing yarn beta): compute the frequencies once, at the base length and at the longest
        length a length-dependent type is meant for, and refuse what is not finite and positive."""
        lengths: list[int | None] = [None]
        if self.scaling.rope_type == "dynamic":
            lengths.append(int(self.max_position_embeddings * max(1.0, _param(self.scaling.factor))) + 1)
        elif self.scaling.rope_type == "longrope":
            lengths.append(_param(self.scaling.original_max_position_embeddings) + 1)  # the long factors
        for seq_len in lengths:
            try:
                inv_freq = self.inv_freq(seq_len)
                ok = bool(torch.isfinite(inv_freq).all()) and bool((inv_freq > 0).all())
            except (ArithmeticError, ValueError):
                ok = False
            if not ok:
                at = "" if seq_len is None else f" at sequence length {seq_len}"
                raise ConfigError(
                    f"RoPE {self.scaling.rope_type} parameters {self.scaling.to_dict()} with theta {self.theta!r} "
                    f"give frequencies that are not finite and positive{at}"
                )

    def replace(self, **changes: Any) -> RopeSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field; ``rotary_offset`` and ``mrope_section`` only where they are set (specs without
        them keep their serialized form and fingerprints)."""
        out = {
            "head_dim": self.head_dim,
            "rotary_dim": self.rotary_dim,
            "theta": self.theta,
            "layout": self.layout,
            "scaling": self.scaling.to_dict(),
            "attention_factor": self.attention_factor,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.rotary_offset:
            out["rotary_offset"] = self.rotary_offset
        if self.mrope_section is not None:  # written only for mRoPE: other specs keep their fingerprints
            out["mrope_section"] = list(self.mrope_section)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RopeSpec:
        expected = {
            "head_dim",
            "rotary_dim",
            "theta",
            "layout",
            "scaling",
            "attention_factor",
            "max_position_embeddings",
        }
        if isinstance(data, Mapping) and "rotary_offset" in data:
            expected = expected | {"rotary_offset"}
        if isinstance(data, Mapping) and "mrope_section" in data:
            if not isinstance(data["mrope_section"], list):
                raise ConfigError(f"RoPE mrope_section must be a list, got {data['mrope_section']!r}")
            expected = expected | {"mrope_section"}
        if not isinstance(data, Mapping) or set(data) != expected:
            got = set(data) if isinstance(data, Mapping) else set()
            raise ConfigError(
                "RoPE spec must have exactly the fields "
                f"{', '.join(sorted(expected))}; missing {sorted(expected - got)}, unexpected {sorted(got - expected)}"
            )
        kwargs = dict(data)
        kwargs["scaling"] = RopeScaling.from_dict(data["scaling"])
        if "mrope_section" in kwargs:
            kwargs["mrope_section"] = tuple(kwargs["mrope_section"])
        return cls(**kwargs)

    def fingerprint(self) -> str:
        """A short stable hash of everything that changes the rotation."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ frequencies

    @property
    def length_dependent(self) -> bool:
        """True when the frequencies depend on the sequence length (dynamic NTK, LongRoPE)."""
        return self.scaling.rope_type in ("dynamic", "longrope")

    @property
    def switch_length(self) -> int | None:
        """The sequence length past which the frequencies change, or None: dynamic NTK grows its base
        past ``max_position_embeddings``; LongRoPE switches to its long factors past
        ``scaling.original_max_position_embeddings`` (not ``max_position_embeddings``)."""
        if self.scaling.rope_type == "dynamic":
            return self.max_position_embeddings
        if self.scaling.rope_type == "longrope":
            return self.scaling.original_max_position_embeddings
        return None

    def frequencies(self) -> Frequencies:
        """What this spec's frequencies are, as values (:class:`Frequencies`): the fields that produce
        them (``theta``, the scaling's parameters, ``max_position_embeddings`` for dynamic NTK) compared
        by what they compute, not by how they are spelled."""
        switch = self.switch_length
        past = None if switch is None else tuple(self.inv_freq(2 * switch).tolist())
        return Frequencies(self, tuple(self.inv_freq().tolist()), switch, past)

    def inv_freq(self, seq_len: int | None = None) -> torch.Tensor:
        """Inverse frequencies ``[rotary_dim // 2]`` in float64 for a sequence of ``seq_len`` tokens."""
        return _INV_FREQ[self.scaling.rope_type](self, seq_len)

    def angles(self, positions: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """Rotation angles ``[num_tokens, rotary_dim // 2]`` in float64 for integer ``positions``:
        ``[num_tokens]``, or for an mRoPE spec the three streams ``[3, num_tokens]`` (temporal, height,
        width; :class:`PositionStreams`), section ``i`` of the pairs turning by stream ``i % 3``."""
        positions = _as_positions(positions, streams=self.mrope_section is not None)
        inv_freq = self.inv_freq(seq_len).to(positions.device)
        if positions.dim() == 2:
            return positions[self.section_axes().to(positions.device)].T.to(torch.float64) * inv_freq[None, :]
        return positions.to(torch.float64)[:, None] * inv_freq[None, :]

    def section_axes(self) -> torch.Tensor:
        """The stream (0: t, 1: h, 2: w) each frequency pair turns by, ``[rotary_dim // 2]``; every
        pair turns by stream 0 for a spec without ``mrope_section``."""
        n = self.rotary_dim // 2
        if self.mrope_section is None:
            return torch.zeros(n, dtype=torch.int64)
        sections = torch.tensor(self.mrope_section)
        return torch.repeat_interleave(torch.arange(len(self.mrope_section)) % 3, sections)

    def cos_sin(self, positions: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of :meth:`angles`, scaled by ``attention_factor``; float64 ``[num_tokens, rotary_dim // 2]``."""
        ang = self.angles(positions, seq_len)
        return torch.cos(ang) * self.attention_factor, torch.sin(ang) * self.attention_factor

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape ``[..., num_tokens, num_heads, head_dim]`` to ``positions [num_tokens]``."""
        cos, sin = self.cos_sin(positions, seq_len)
        return apply_rotation(x, cos, sin, self.layout, self.rotary_offset)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """Inverse of :meth:`rotate` (rotation by ``-p``, attention factor divided out)."""
        ang = self.angles(positions, seq_len)
        a = self.attention_factor
        return apply_rotation(x, torch.cos(ang) / a, -torch.sin(ang) / a, self.layout, self.rotary_offset)


# Two inverse frequencies are the same when they agree to this relative tolerance. Equal
# computations spelled differently (llama3 or YaRN with factor 1 against default RoPE, linear with
# factor 1) differ by float64 rounding (~1e-16); the smallest real difference (another theta, factor,
# llama3 band) is many orders larger. What the tolerance lets through turns a key at position p by at
# most p * 1e-12 rad more (inverse frequencies are <= 1): 1e-6 rad at a million positions.
FREQUENCY_RTOL = 1e-12


@dataclass(frozen=True, eq=False)
class Frequencies:
    """What a :class:`RopeSpec` turns by, by value (:meth:`RopeSpec.frequencies`).

    - ``inv_freq``: the inverse frequency of each channel pair (float64), at lengths up to the switch;
    - ``switch_length``: for a length-dependent type, the sequence length past which they change
      (dynamic NTK: ``max_position_embeddings``; LongRoPE: ``original_max_position_embeddings``), else None;
    - ``past``: for a length-dependent type, the inverse frequencies at twice the switch length. Two
      dynamic NTK specs with the same base frequencies and switch agree there exactly when their
      factors agree, and then at every length; LongRoPE's long factors hold at every length past it.

    Equality (``==``) is by value: the same switch length and inverse frequencies that agree within
    :data:`FREQUENCY_RTOL`. ``spec`` is the spec they came from, for naming what differs; it takes no
    part in the comparison.
    """

    spec: RopeSpec
    inv_freq: tuple[float, ...]
    switch_length: int | None
    past: tuple[float, ...] | None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frequencies):
            return NotImplemented
        return (
            self.switch_length == other.switch_length
            and _close(self.inv_freq, other.inv_freq)
            and (self.past is None) == (other.past is None)
            and (self.past is None or other.past is None or _close(self.past, other.past))
        )

    __hash__ = None  # type: ignore[assignment]  # equality within a tolerance is not hashable

    def __repr__(self) -> str:
        return f"Frequencies(switch_length={self.switch_length}, inv_freq[:3]={self.inv_freq[:3]})"


def _close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=FREQUENCY_RTOL, abs_tol=0.0) for x, y in zip(a, b))


# ---------------------------------------------------------------------- pure functions


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str, offset: int = 0) -> torch.Tensor:
    """Rotate channel pairs of ``x [..., num_tokens, num_heads, head_dim]`` by ``cos/sin [num_tokens, n]``.

    Channels ``offset .. offset + 2n - 1`` rotate (``offset`` 0: the leading channels; partial rotary
    leaves the rest; MLA rotates its trailing rope part). The arithmetic runs in float64 for float64
    input and float32 otherwise; the result has ``x``'s dtype.
    """
    if x.shape[-3] != cos.shape[0] or cos.shape != sin.shape:
        raise ValueError(f"rotation: x has {x.shape[-3]} tokens, cos/sin {tuple(cos.shape)}/{tuple(sin.shape)}")
    if offset:
        head, rotated = x[..., :offset], apply_rotation(x[..., offset:], cos, sin, layout)
        return torch.cat((head.to(rotated.dtype), rotated), dim=-1)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = cos.shape[-1]
    rot, rest = x[..., : 2 * n].to(work), x[..., 2 * n :]
    c = cos.to(device=x.device, dtype=work)[:, None, :]  # [T, 1, n]
    s = sin.to(device=x.device, dtype=work)[:, None, :]
    if layout == "neox":
        a, b = rot[..., :n], rot[..., n:]
        out = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    elif layout == "gptj":
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return torch.cat((out.to(x.dtype), rest), dim=-1) if rest.shape[-1] else out.to(x.dtype)


def inv_freq_for_theta(spec: RopeSpec, theta: float, seq_len: int | None = None) -> torch.Tensor:
    """``spec.replace(theta=theta).inv_freq(seq_len)`` without validating a new spec (``theta`` must be
    finite and positive): its scaling recomputed for the other base (YaRN's bands, llama3's smoothing),
    cheaply enough for the forensics to sweep thousands of bases."""
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ConfigError(f"RoPE theta must be a finite positive number, got {theta!r}")
    other = _with_theta(spec, float(theta))
    return _INV_FREQ[spec.scaling.rope_type](other, seq_len)


def _with_theta(spec: RopeSpec, theta: float) -> RopeSpec:
    other = object.__new__(RopeSpec)
    for f in dataclasses.fields(RopeSpec):
        object.__setattr__(other, f.name, getattr(spec, f.name))
    object.__setattr__(other, "theta", theta)
    return other


def pair_channels(rotary_dim: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(first, second)`` of the two channels of each rotating pair, ``[rotary_dim // 2]`` each."""
    n = rotary_dim // 2
    m = torch.arange(n)
    if layout == "neox":
        return m, m + n
    if layout == "gptj":
        return 2 * m, 2 * m + 1
    raise ValueError(f"unknown layout {layout!r}")


def layout_permutation(rotary_dim: int, head_dim: int, src: str, dst: str) -> torch.Tensor:
    """Channel permutation ``perm`` with ``x_dst = x_src[..., perm]`` mapping one pairing onto the other."""
    perm = torch.arange(head_dim)
    if src == dst:
        return perm
    a_src, b_src = pair_channels(rotary_dim, src)
    a_dst, b_dst = pair_channels(rotary_dim, dst)
    perm[a_dst] = a_src
    perm[b_dst] = b_src
    return perm


def _as_positions(positions: torch.Tensor | Any, *, streams: bool = False) -> torch.Tensor:
    """``positions [num_tokens]``, or with ``streams`` (an mRoPE spec) also ``[3, num_tokens]``."""
    if not isinstance(positions, torch.Tensor):
        positions = torch.as_tensor(positions)
    if positions.dim() != 1 and not (streams and positions.dim() == 2 and positions.shape[0] == 3):
        want = "[num_tokens] or [3, num_tokens] (mRoPE streams)" if streams else "1-D [num_tokens]"
        raise ValueError(f"positions must be {want}, got shape {tuple(positions.shape)}")
    if positions.is_floating_point() or positions.is_complex():
        raise ValueError("positions must be integers")
    return positions


def _param(value: _T | None) -> _T:
    """A parameter the scaling type requires: :class:`RopeScaling` refuses a spec without it."""
    if value is None:
        raise ValueError("RoPE scaling parameter missing for its type")
    return value


def _base_inv_freq(spec: RopeSpec, base: float) -> torch.Tensor:
    exponents = torch.arange(0, spec.rotary_dim, 2, dtype=torch.float64) / spec.rotary_dim
    return 1.0 / (base**exponents)


def _default(spec: RopeSpec, seq_len: int | None) -> torch.Tensor:
    return _base_inv_freq(spec, spec.theta)


def _linear(spec: RopeSpec, seq_len: int | None) -> torch.Tensor:
    return _base_inv_freq(spec, spec.theta) / _param(spec.scaling.factor)


def _dynamic(spec: RopeSpec, seq_len: int | None) -> torch.Tensor:
    max_pos = spec.max_position_embeddings
    length = max(seq_len, max_pos) if seq_len is not None else max_pos
    factor, dim = _param(spec.scaling.factor), spec.rotary_dim
    base = spec.theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(spec, base)


def _yarn(spec: RopeSpec, seq_len: int | None) -> torch.Tensor:
    s, dim, base = spec.scaling, spec.rotary_dim, spec.theta
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1
    truncate = True if s.truncate is None else s.truncate
    orig = _param(s.original_max_position_embeddings)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (_param(s.factor) * pos_freqs)
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def _llama3(spec: RopeSpec, seq_len: int | None) -> torch.Tensor:
    s = spec.scaling
    factor, low, high = _param(s.factor), _param(s.low_freq_factor), _param(s.high_freq_factor)
    inv_freq = _base_inv_freq(spec, spec.theta)
    old_len = _param(s.original_max_position_embeddings)
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope(spec: RopeSpec, seq_len: int | None) -> torch.Tensor:
    s = spec.scaling
    long = seq_len is not None and seq_len > _param(s.original_max_position_embeddings)
    ext = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float64)
    exponents = torch.arange(0, spec.rotary_dim, 2, dtype=torch.float64) / spec.rotary_dim
    return 1.0 / (ext * spec.theta**exponents)


_INV_FREQ: dict[str, Callable[[RopeSpec, int | None], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
}


# ---------------------------------------------------------------------- mRoPE position streams

MROPE_AXES = ("t", "h", "w")  # Qwen2-VL's streams: temporal, height, width
MAX_IMAGE_SIDE = 1024  # rows or columns of one image grid in LLM tokens (Qwen2-VL's largest images: ~100)


@dataclass(frozen=True, eq=False)
class PositionStreams:
    """The three mRoPE position streams of a sequence by token index: ``streams [3, N]`` int64.

    Token ``j < N`` turns section ``i`` of its pairs by ``streams[i % 3, j]``. Tokens past ``N`` are
    text that follows the prompt: all three streams at ``max(streams) + 1 + (j - N)``, Qwen2-VL's
    ``rope_deltas`` rule for generated tokens. The engine's logical positions stay the token indices
    (the mask, the slots, the cache); only the rotation reads the streams.
    """

    streams: torch.Tensor

    def __post_init__(self) -> None:
        s = self.streams
        if not isinstance(s, torch.Tensor) or s.dim() != 2 or s.shape[0] != 3 or s.shape[1] < 1:
            shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ConfigError(f"mRoPE position streams must be a tensor [3, num_tokens >= 1], got {shape}")
        if s.is_floating_point() or s.is_complex() or s.dtype == torch.bool:
            raise ConfigError(f"mRoPE position streams must be integers, got {s.dtype}")
        if int(s.min()) < 0 or int(s.max()) >= MAX_POSITIONS:
            raise ConfigError(f"mRoPE position streams must lie in [0, 2**40), got {int(s.min())}..{int(s.max())}")
        object.__setattr__(self, "streams", s.to(torch.int64).cpu())

    @property
    def num_tokens(self) -> int:
        return int(self.streams.shape[1])

    @property
    def next_text(self) -> int:
        """The streams' value for the first token past the prompt (all three equal)."""
        return int(self.streams.max()) + 1

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The streams ``[3, T]`` of the tokens at logical ``positions [T]``: the table below ``N``,
        text after it; a negative position (only a faulty engine computes one) as text."""
        p = positions.to(torch.int64)
        inside = (p >= 0) & (p < self.num_tokens)
        text = torch.where(p >= self.num_tokens, p - self.num_tokens + self.next_text, p)
        table = self.streams.to(p.device)[:, p.clamp(0, self.num_tokens - 1)]
        return torch.where(inside[None, :], table, text[None, :])

    def collapsed(self) -> PositionStreams:
        """Every stream replaced by the temporal one (h and w at t): one position per token."""
        return PositionStreams(self.streams[:1].expand(3, -1).clone())

    def agrees(self, other: PositionStreams, num_tokens: int) -> bool:
        """Whether both give the first ``num_tokens`` tokens the same streams."""
        index = torch.arange(num_tokens)
        return bool(torch.equal(self.at(index), other.at(index)))


def image_streams(num_tokens: int, start: int, rows: int, cols: int) -> PositionStreams:
    """The streams Qwen2-VL's ``get_rope_index`` gives ``num_tokens`` tokens with one image of
    ``rows x cols`` LLM tokens (one temporal patch, after the spatial merge) at token ``start``: text
    before it at ``0..start-1`` on all streams; image token ``(r, c)`` (row-major) at ``t = start``,
    ``h = start + r``, ``w = start + c``; text after it from ``start + max(rows, cols)`` on
    (transformers' ``current_pos += max(h, w)``; the image's largest stream + 1)."""
    for name, value, low, high in (
        ("num_tokens", num_tokens, 1, MAX_POSITIONS),
        ("start", start, 0, MAX_POSITIONS),
        ("rows", rows, 1, MAX_IMAGE_SIDE),
        ("cols", cols, 1, MAX_IMAGE_SIDE),
    ):
        if not is_int(value) or not low <= value <= high:
            raise ConfigError(f"image streams: {name} must be an integer in [{low}, {high}], got {value!r}")
    end = start + rows * cols
    if end > num_tokens:
        raise ConfigError(f"image streams: a {rows}x{cols} image at token {start} ends at {end}, past {num_tokens}")
    out = torch.arange(num_tokens, dtype=torch.int64).expand(3, -1).clone()  # text before the image
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    out[0, start:end] = start
    out[1, start:end] = start + r.reshape(-1)
    out[2, start:end] = start + c.reshape(-1)
    after = start + max(rows, cols)
    out[:, end:] = torch.arange(after, after + num_tokens - end)
    return PositionStreams(out)
