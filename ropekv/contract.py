"""The cache contract: the RoPE convention of a KV cache, explicit and checked at every boundary.

A KV cache can hold keys *rotated* (``R(j) k_j``, what HF transformers, vLLM and llama.cpp store) or
*raw* (``k_j`` after ``k_proj``/``k_norm``; the attention kernel rotates on read, FlashInfer-style).
Both are right; mixing them is the bug (docs/contract.md). A
:class:`CacheContract` records the form and everything else that decides what a cached key means, so
that an append, an import or a prefill->decode handoff can refuse keys written under another
convention (:meth:`CacheContract.require_compatible`) instead of silently computing wrong attention.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from .attention_kind import MODEL_WINDOWS, LayerAttention, ModelWindows
from .errors import ConfigError, ContractMismatch
from .rope import Frequencies, RopeSpec

if TYPE_CHECKING:  # only attributes are read; avoids importing the model loaders
    from .models.config import ModelConfig

KeyForm = Literal["raw", "rotated"]  # closed sets are types; the tuples follow from them
RotationIndex = Literal["logical", "cache"]
# Where a layer's keys are turned (:attr:`CacheContract.rotation_sites`): by a separate RoPE op before the
# cache write (vLLM, llama.cpp, mlx-lm, transformers, ropekv's rotated backend), inside the fused attention
# kernel before it writes the cache (ONNX Runtime's GroupQueryAttention with do_rotary=1), or inside the
# kernel as it reads raw cached keys (FlashInfer's ROPE_LLAMA decode, ropekv's raw backend).
RotationSite = Literal["op", "kernel_write", "kernel_read"]
ROTATION_SITES: tuple[str, ...] = get_args(RotationSite)
# The key form each site stores: "op" and "kernel_write" both leave R(j) k_j in the cache.
SITE_KEY_FORM: dict[str, str] = {"op": "rotated", "kernel_write": "rotated", "kernel_read": "raw"}
DEFAULT_SITE: dict[str, RotationSite] = {"rotated": "op", "raw": "kernel_read"}
MlaForm = Literal["expanded", "latent"]
MLA_FORMS: tuple[str, ...] = get_args(MlaForm)
# How a layer's KV block tensor lies in memory, as the transfer carries it (not RoPE's channel-pair
# ``rope.layout``): the block tensor ``[blocks, 2, ...]`` (2: keys, values) with each block's tokens
# outermost (``block,heads``: ropekv's payload rows ``[rows, KVH, D]``) or its heads outermost
# (``heads,block``: one head's rows of a block contiguous, a paged kernel's layout).
BlockLayout = Literal["blocks,2,block,heads,dim", "blocks,2,heads,block,dim"]
BLOCK_LAYOUTS: tuple[str, ...] = get_args(BlockLayout)
DEFAULT_BLOCK_LAYOUT: BlockLayout = "blocks,2,block,heads,dim"
KEY_FORMS: tuple[str, ...] = get_args(KeyForm)
ROTATION_INDICES: tuple[str, ...] = get_args(RotationIndex)
DTYPES: dict[str, torch.dtype] = {  # compute and storage dtypes
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
FP8_DTYPE = "float8_e4m3fn"  # an 8-bit KV cache (vLLM's kv_cache_dtype=fp8): storage only, with scales
STORAGE_DTYPES: dict[str, torch.dtype] = {**DTYPES, FP8_DTYPE: torch.float8_e4m3fn}
KvDtype = Literal["fp8"]  # the cache dtypes an engine may store in besides its compute dtype
KV_DTYPES: tuple[str, ...] = get_args(KvDtype)
# How a quantized cache's scales are kept (:class:`KvQuant`): one per layer, or one per layer and KV head.
KvScale = Literal["per_tensor", "per_head"]
KV_SCALES: tuple[str, ...] = get_args(KvScale)
# Where keys are quantized: after RoPE (rotated keys, vLLM) or before it (raw keys, rotated on read).
QuantPoint = Literal["after_rope", "before_rope"]
QUANT_POINTS: tuple[str, ...] = get_args(QuantPoint)
FORMAT = "ropekv.cache_contract"
# Version 5 names the weights (``weights_fingerprint``: the tensors alone) apart from the configuration
# (``config_fingerprint``); earlier versions carried one fingerprint of both, whose meaning a reader cannot
# split, so they are refused by version (:func:`CacheContract.from_json`) rather than read.
# ``chunk_size``/``chunk_layers`` are written exactly when there are chunked layers, ``rotation_sites``
# where a layer's site is not its key form's default, ``layer_ropes``, ``mla``, ``kv_quant`` and
# ``block_layout`` where they are set (not the default).
FORMAT_VERSION = 5
READABLE_VERSIONS = (5,)

_FREQUENCIES = "keys and queries would turn at different frequencies: the error grows with position"
_WINDOW = "the reader would see keys the writer dropped, or miss keys"
# What goes wrong when a differing field is ignored. key_form depends on the direction and is
# worded in :func:`consequence`; "rope.scaling.*" share the frequency sentence.
_CONSEQUENCES: dict[str, str] = {
    "rotation_index": (
        "one side rotates by logical position, the other by index among cached tokens: once tokens are "
        "evicted or a prefix offset exists, keys would turn by the wrong angle (slot used as position)"
    ),
    "rotation_sites": (
        "a kernel that turns keys on read would turn keys another site already turned (keys at twice their "
        "position), or nothing would turn raw keys (every key at position 0)"
    ),
    "rope.head_dim": "keys would have another size per head: nothing would be read right",
    "rope.rotary_dim": (
        "a different number of channels would rotate (partial rotary): the channels in between would be "
        "wrong from the first layer"
    ),
    "rope.theta": _FREQUENCIES,
    "rope.frequencies": _FREQUENCIES,
    "rope.layout": "channel pairs would not match: wrong from the first layer",
    "rope.scaling": _FREQUENCIES,
    "rope.attention_factor": (
        "cos/sin would be scaled by another attention factor: every attention logit would be off by the ratio"
    ),
    # Compared only where a side uses dynamic NTK: it is the length past which its base grows. For every
    # other type it changes no key or query (LongRoPE's switch is its original_max_position_embeddings).
    "rope.max_position_embeddings": ("dynamic NTK would grow its base past another sequence length: " + _FREQUENCIES),
    "rope.mrope_section": (
        "one side turns sections of the channel pairs by three position streams (mRoPE: temporal, height, "
        "width), the other by one position or other sections: the same only while all three streams are the "
        "token's position (text); keys of image or video tokens would be read at the wrong angles"
    ),
    "window": _WINDOW,
    "window_layers": "a layer windowed on one side is full on the other: " + _WINDOW,
    "chunk_size": "chunks would start at other positions: " + _WINDOW,
    "chunk_layers": "a layer chunked on one side is full or windowed on the other: " + _WINDOW,
    "attention": "its queries would see another set of keys (full, sliding window, chunk): " + _WINDOW,
    "sink_tokens": "sinks kept on one side are evicted on the other and ring slots shift: " + _WINDOW,
    "block_size": "blocks would be cut at other token boundaries: block tables would address the wrong slots",
    "dtype": "key and value bytes would be read in another precision: garbage, or a silent precision change",
    "num_layers": "layer counts differ: keys would be read for the wrong layer, or be missing",
    "num_kv_heads": "head counts differ: tensors would not fit, or one head's keys would be read as another's",
    "head_dim": "head sizes differ: tensors would not fit, channels would be misread",
    "weights_fingerprint": (
        "keys come from another model (other weights): attention would read keys this model never produced"
    ),
    "config_fingerprint": (
        "the same weights under another configuration outside RoPE and the cache layout (head counts, norms, "
        "activations, scales): the keys and values this model computes would differ from the stored ones"
    ),
    "layer_ropes": "some layers would turn their keys with another RoPE spec, or with none (NoPE)",
    "rope.rotary_offset": (
        "another slice of each key would rotate (MLA's rope part is the trailing qk_rope_head_dim channels): "
        "position-free channels would turn, or the rope part would not"
    ),
    "mla": (
        "one side is multi-head latent attention and the other is not: cache rows would be read as another kind of key"
    ),
    "mla.cached": (
        "one side caches MLA's compressed latent plus the rope part, the other expanded per-head keys and "
        "values: every cache row would be read as the wrong thing"
    ),
    "mla.qk_nope_head_dim": "MLA's position-free and rope parts would be cut at other channels",
    "mla.qk_rope_head_dim": "MLA's position-free and rope parts would be cut at other channels",
    "mla.v_head_dim": "values would be read with another size per head",
    "mla.kv_lora_rank": "the compressed latent would have another size: latent and rope part would be misread",
    "kv_quant": (
        "one side stores 8-bit keys and values with scales, the other does not: codes would be read as "
        "numbers, or numbers as codes"
    ),
    "kv_quant.scale": (
        "scales kept per tensor on one side and per KV head on the other: each head's codes would be "
        "multiplied by another head's or the whole layer's scale (keys and values off by a constant factor)"
    ),
    "kv_quant.quantized": (
        "keys quantized before RoPE on one side and after it on the other: the reader would rotate codes "
        "of rotated keys again, or never rotate codes of raw keys"
    ),
    "block_layout": (
        "each block's bytes would be read with heads and tokens swapped: a received (row, head) would hold "
        "another row's or another head's key and value, wrong from the first layer"
    ),
}


@dataclass(frozen=True)
class MlaCache:
    """What the cache of a multi-head latent attention model (DeepSeek V2/V3) holds per token and layer.

    - ``"expanded"`` (ropekv's engine): per head, the key ``[k_nope, k_pe]`` (``num_kv_heads =
      num_heads``, ``head_dim = qk_nope_head_dim + qk_rope_head_dim``), where the rope part ``k_pe`` is
      the last ``qk_rope_head_dim`` channels (``rope.rotary_offset = qk_nope_head_dim``), identical in
      every head, and rotated or raw as ``key_form`` says; the value row holds ``v_head_dim`` channels
      zero-padded to ``head_dim``.
    - ``"latent"`` (transformers' ``DynamicCache``, vLLM, SGLang): one row ``[latent, k_pe]``
      (``num_kv_heads = 1``, ``head_dim = kv_lora_rank + qk_rope_head_dim``, ``rope.rotary_offset =
      kv_lora_rank``): the normed compressed latent that ``kv_b_proj`` expands into keys and values,
      then the rope part; no value rows.

    The two hold the same information but are not interchangeable bytes: a handoff between them must be
    refused or converted at the boundary (:meth:`CacheContract.require_compatible` names ``mla.cached``).
    """

    cached: MlaForm
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int

    def __post_init__(self) -> None:
        if self.cached not in MLA_FORMS:
            raise ConfigError(f"contract mla.cached must be one of {MLA_FORMS}, got {self.cached!r}")
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"):
            _check_int(f"mla.{name}", getattr(self, name), 1)

    def row(self) -> tuple[int, int]:
        """``(rotary_offset, head_dim)`` of one cache row in this form."""
        first = self.qk_nope_head_dim if self.cached == "expanded" else self.kv_lora_rank
        return first, first + self.qk_rope_head_dim

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any) -> MlaCache:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ConfigError(f"cache contract JSON: mla must be an object with exactly {sorted(names)}")
        return cls(**data)


@dataclass(frozen=True)
class KvQuant:
    """How an 8-bit cache (``dtype="float8_e4m3fn"``) stores its keys and values.

    - ``scale``: ``"per_tensor"`` (one float32 per layer for keys, one for values) or ``"per_head"``
      (one per layer and KV head); :mod:`ropekv.cache.quant` computes them (static, at a layer's first
      write) and the cache keeps them per layer.
    - ``quantized``: ``"after_rope"`` (the rotated key is quantized, vLLM's fp8 cache) or
      ``"before_rope"`` (the raw key is quantized and rotated after dequantizing on read). It follows
      the key form (rotated keys are quantized after RoPE, raw keys before): the contract validates it
      instead of deriving it, so a reader that assumes the other point is refused by name.
    """

    scale: KvScale
    quantized: QuantPoint

    def __post_init__(self) -> None:
        if self.scale not in KV_SCALES:
            raise ConfigError(f"contract kv_quant.scale must be one of {KV_SCALES}, got {self.scale!r}")
        if self.quantized not in QUANT_POINTS:
            raise ConfigError(f"contract kv_quant.quantized must be one of {QUANT_POINTS}, got {self.quantized!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "quantized": self.quantized}

    @classmethod
    def from_dict(cls, data: Any) -> KvQuant:
        if not isinstance(data, dict) or set(data) != {"scale", "quantized"}:
            raise ConfigError("cache contract JSON: kv_quant must be an object with exactly ['quantized', 'scale']")
        return cls(**data)


@dataclass(frozen=True)
class FieldDiff:
    """One field two contracts disagree on; ``field`` is dotted inside the RoPE spec (``rope.theta``)."""

    field: str
    ours: Any
    theirs: Any


def key_form_consequence(stored: str, reader: str) -> str:
    """What a reader expecting ``reader`` keys computes from keys stored as ``stored``."""
    if stored == "rotated" and reader == "raw":
        return "stored keys are rotated, reader rotates again: keys would sit at twice their position"
    if stored == "raw" and reader == "rotated":
        return "stored keys are raw, reader expects rotated ones and never rotates: every key would sit at position 0"
    if stored == reader:
        return "key forms agree"
    return f"keys stored as {stored!r} cannot be read as {reader!r}: key_form must be one of {KEY_FORMS}"


def consequence(diff: FieldDiff) -> str:
    """What goes wrong if ``diff`` is ignored; ``theirs`` wrote the keys, ``ours`` reads them."""
    if diff.field == "key_form":
        return key_form_consequence(stored=diff.theirs, reader=diff.ours)
    field = diff.field
    if field.startswith("layers."):  # layers.{i}.rope...: the same consequence, on that layer
        layer, _, field = field[len("layers.") :].partition(".")
        if field == "rope":
            return (
                f"layer {layer} has no position embedding (NoPE) on one side and turns its keys on the "
                "other: its keys would be rotated where they must not be, or never rotated"
            )
        return f"on layer {layer}: " + consequence(FieldDiff(field, diff.ours, diff.theirs))
    if field.startswith("rope.scaling."):
        return _CONSEQUENCES["rope.scaling"]
    return _CONSEQUENCES[field]


def mismatch(
    diffs: list[FieldDiff], *, ours: str, theirs: str, explain: Callable[[FieldDiff], str] = consequence
) -> ContractMismatch:
    """The handshake's refusal for ``diffs`` (non-empty): every field, both values and the consequence
    (``explain``, :func:`consequence` unless a caller compares fields beyond the contract's own)."""
    parts = [f"{d.field}: {ours}={d.ours!r}, {theirs}={d.theirs!r} ({explain(d)})" for d in diffs]
    return ContractMismatch(
        f"{ours} and {theirs} cache contracts differ in {len(diffs)} field(s): " + "; ".join(parts),
        fields=tuple(d.field for d in diffs),
    )


@dataclass(frozen=True)
class LayerContract:
    """What one layer's cached keys mean beyond the fields every layer shares: which keys its queries
    see (:class:`LayerAttention`: full, sliding window, chunk) and the :class:`RopeSpec` its keys turn
    with (None: a layer without position embedding, NoPE)."""

    attention: LayerAttention
    rope: RopeSpec | None
    rotation: RotationSite = "op"  # where this layer's keys are turned (CacheContract.rotation_sites)


@dataclass(frozen=True, kw_only=True)
class CacheContract:
    """Everything that decides what a cached key means. Frozen; invalid combinations raise ConfigError.

    - ``key_form``: ``"rotated"`` (stored after ``R(position)``) or ``"raw"`` (rotated on read).
    - ``rope``: the :class:`RopeSpec` keys are (or will be) rotated with.
    - ``rotation_index``: ``"logical"`` rotates a token by its position in its sequence; ``"cache"``
      by its index among the cached tokens the reader sees (StreamingLLM sinks re-index on purpose).
      ``"cache"`` needs raw keys: the index of a rotated key is baked in when it is written, and it
      changes every time the window evicts a token, so rotated keys would all have to be rotated
      again on every eviction -- the "rotate all cached keys" change the contract exists to stop.
    - ``rotation_sites``: per layer, where its keys are turned (:data:`ROTATION_SITES`): ``"op"`` (a
      separate RoPE op before the cache write), ``"kernel_write"`` (inside the fused attention kernel,
      before it writes the cache: ONNX Runtime's GroupQueryAttention) or ``"kernel_read"`` (inside the
      kernel, on read of raw cached keys). None (the default) means the key form's default on every
      layer: ``"op"`` for rotated keys, ``"kernel_read"`` for raw ones. Each site must store the
      contract's key form (``"kernel_read"`` exactly when keys are raw). Two contracts whose sites differ
      but store the same form are compatible: the stored keys mean the same (``R(j) k_j``), whoever turned
      them; a site that stores another form is a ``key_form`` difference, refused as such.
    - ``kernel_rotates`` (a property, derived): the attention kernel applies RoPE to keys on read
      (``"kernel_read"``): exactly when keys are stored raw.
    - ``window``/``window_layers``: sliding window size (HF semantics, W keys including the query's)
      and the layers it applies to; ``sink_tokens``: first tokens kept forever (needs a window).
    - ``chunk_size``/``chunk_layers``: chunked attention (llama4's ``attention_chunk_size``) and the
      layers it applies to: a query at position ``p`` sees keys at ``[floor(p / C) * C, p]``. A
      layer is full, sliding or chunked, never two of them: :meth:`layer_attention` names its kind,
      and :meth:`require_compatible` compares the kinds layer by layer (``layers.3.attention``).
    - ``block_size``, ``dtype``, ``num_layers``, ``num_kv_heads``, ``head_dim``: storage layout.
    - ``weights_fingerprint``: identifies the weights that produced the keys, over the weight tensors
      alone (names, shapes, dtypes, bytes: :func:`~ropekv.models.config.weights_fingerprint_of`); ""
      = unnamed, compared like any other field.
    - ``config_fingerprint``: the configuration's computation outside what the contract compares itself
      (RoPE, windows, layer and head counts are fields of their own; ``max_position_embeddings`` and the
      model's name change no key: :func:`~ropekv.models.config.config_fingerprint_of`); "" = unnamed, and
      then not compared (an engine that cannot read ropekv's config, mlx's or ONNX Runtime's, names none).
    - ``layer_ropes``: per layer, the :class:`RopeSpec` that layer's keys turn with, or None for a
      layer without position embedding (NoPE: cohere2's and smollm3's global layers); None (the
      field) means ``rope`` on every layer. Gemma 3's local and global layers turn with different
      specs; a reader that mixed them up would rotate one kind of layer at the other's frequencies.
      :meth:`require_compatible` compares it layer by layer and names the layer
      (``layers.5.rope.theta``).
    - ``mla``: for multi-head latent attention, what a cache row holds (:class:`MlaCache`: expanded
      per-head keys or the compressed latent, and where the rope part sits); None otherwise. The rotated
      slice itself is the RoPE spec's (``rope.rotary_offset`` .. ``+ rope.rotary_dim``).
    - ``block_layout``: the order of a layer's KV block tensor in a transfer (:data:`BLOCK_LAYOUTS`),
      ``"blocks,2,block,heads,dim"`` (the default) or ``"blocks,2,heads,block,dim"``; a payload lays its
      keys and values out so (``ropekv.transfer.payload``). Written only when not the default, so the
      fingerprint of every contract in the default layout is unchanged.
    - ``kv_quant``: for an 8-bit cache (``dtype="float8_e4m3fn"``, vLLM's ``kv_cache_dtype=fp8``), the
      scales' granularity and where keys are quantized (:class:`KvQuant`); None for every other dtype.
      Written only when set, so every unquantized contract keeps its fingerprint.

    ``layers`` (derived, not a constructor argument and not serialized): one :class:`LayerContract` per
    layer, built once from ``window``/``window_layers``, ``chunk_size``/``chunk_layers`` and
    ``layer_ropes`` (the fields are the constructor's and the JSON's spelling). Every per-layer question
    (:meth:`layer`, :meth:`layer_rope`, :meth:`layer_attention`, the layer-by-layer comparison) reads it.

    Rotated keys with a length-dependent RoPE (``rope.length_dependent``) are a valid contract to
    describe -- HF transformers caches exactly that -- even though cached decode then drifts from a full
    forward; refusing it is the engine's decision, not the contract's.
    """

    key_form: KeyForm
    rotation_index: RotationIndex = "logical"
    rope: RopeSpec
    window: int | None = None
    window_layers: tuple[int, ...] = ()
    chunk_size: int | None = None
    chunk_layers: tuple[int, ...] = ()
    sink_tokens: int = 0
    block_size: int = 16
    dtype: str = "float32"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    weights_fingerprint: str = ""
    config_fingerprint: str = ""
    layer_ropes: tuple[RopeSpec | None, ...] | None = None
    mla: MlaCache | None = None
    block_layout: BlockLayout = DEFAULT_BLOCK_LAYOUT
    kv_quant: KvQuant | None = None
    rotation_sites: tuple[RotationSite, ...] | None = None

    def __post_init__(self) -> None:
        if self.key_form not in KEY_FORMS:
            raise ConfigError(f"contract key_form must be one of {KEY_FORMS}, got {self.key_form!r}")
        if self.block_layout not in BLOCK_LAYOUTS:
            raise ConfigError(f"contract block_layout must be one of {BLOCK_LAYOUTS}, got {self.block_layout!r}")
        if not isinstance(self.rope, RopeSpec):
            raise ConfigError(f"contract rope must be a RopeSpec, got {type(self.rope).__name__}")
        if self.rotation_index not in ROTATION_INDICES:
            raise ConfigError(f"contract rotation_index must be one of {ROTATION_INDICES}, got {self.rotation_index!r}")
        if self.rotation_index == "cache" and self.key_form != "raw":
            raise ConfigError(
                "contract: rotation_index='cache' needs key_form='raw'; a rotated key's index is fixed when it "
                "is written and cannot follow the cache index as tokens are evicted without re-rotating it"
            )
        for name, low in (
            ("num_layers", 1),
            ("num_kv_heads", 1),
            ("head_dim", 1),
            ("block_size", 1),
            ("sink_tokens", 0),
        ):
            _check_int(name, getattr(self, name), low)
        if self.head_dim != self.rope.head_dim:
            raise ConfigError(f"contract head_dim {self.head_dim} != rope.head_dim {self.rope.head_dim}")
        if self.window is not None:
            _check_int("window", self.window, 1)
        self._check_layers("window", "window_layers")
        if self.chunk_size is not None:
            _check_int("chunk_size", self.chunk_size, 1)
        self._check_layers("chunk_size", "chunk_layers")
        both = sorted(set(self.window_layers) & set(self.chunk_layers))
        if both:
            raise ConfigError(
                f"contract layer(s) {both} are both sliding (window_layers) and chunked (chunk_layers): "
                "a layer has one attention kind"
            )
        if self.sink_tokens > 0 and self.window is None:
            raise ConfigError(f"contract sink_tokens={self.sink_tokens} needs a window (sinks are what a window keeps)")
        if not isinstance(self.dtype, str) or self.dtype not in STORAGE_DTYPES:
            raise ConfigError(f"contract dtype must be one of {tuple(STORAGE_DTYPES)}, got {self.dtype!r}")
        self._check_kv_quant()
        for name in ("weights_fingerprint", "config_fingerprint"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"contract {name} must be a string, got {getattr(self, name)!r}")
        if isinstance(self.layer_ropes, list):  # normalize, do not reinterpret
            object.__setattr__(self, "layer_ropes", tuple(self.layer_ropes))
        if self.layer_ropes is not None:
            if not isinstance(self.layer_ropes, tuple) or len(self.layer_ropes) != self.num_layers:
                raise ConfigError(
                    f"contract layer_ropes must hold one RoPE spec (or None) per layer "
                    f"({self.num_layers}), got {self.layer_ropes!r}"
                )
            for i, spec in enumerate(self.layer_ropes):
                if spec is not None and not isinstance(spec, RopeSpec):
                    raise ConfigError(
                        f"contract layer_ropes[{i}] must be a RopeSpec or None, got {type(spec).__name__}"
                    )
                if spec is not None and spec.head_dim != self.head_dim:
                    raise ConfigError(f"contract layer_ropes[{i}].head_dim {spec.head_dim} != head_dim {self.head_dim}")
            if all(spec == self.rope for spec in self.layer_ropes):
                object.__setattr__(self, "layer_ropes", None)  # one RoPE for every layer
        self._check_rotation_sites()
        _ = self.layers  # the per-layer records, built once here from the fields just validated
        if self.mla is not None:
            self._check_mla()

    @functools.cached_property
    def layers(self) -> tuple[LayerContract, ...]:
        """One record per layer, from the flat fields (a layer has one attention kind: checked above).
        Not a dataclass field: not an argument, not compared, not serialized (the flat fields are)."""
        records = []
        for i in range(self.num_layers):
            if i in self.window_layers:
                attention = LayerAttention("sliding", self.window)
            elif i in self.chunk_layers:
                attention = LayerAttention("chunked", self.chunk_size)
            else:
                attention = LayerAttention("full")
            rope = self.rope if self.layer_ropes is None else self.layer_ropes[i]
            site = DEFAULT_SITE[self.key_form] if self.rotation_sites is None else self.rotation_sites[i]
            records.append(LayerContract(attention, rope, site))
        return tuple(records)

    def _check_rotation_sites(self) -> None:
        """One site per layer, each storing the contract's key form; all-default sites become None."""
        sites = self.rotation_sites
        if sites is None:
            return
        if isinstance(sites, list):  # normalize, do not reinterpret
            sites = tuple(sites)
            object.__setattr__(self, "rotation_sites", sites)
        if not isinstance(sites, tuple) or len(sites) != self.num_layers:
            raise ConfigError(
                f"contract rotation_sites must hold one site per layer ({self.num_layers}), got {sites!r}"
            )
        for i, site in enumerate(sites):
            if site not in ROTATION_SITES:
                raise ConfigError(f"contract rotation_sites[{i}] must be one of {ROTATION_SITES}, got {site!r}")
            if SITE_KEY_FORM[site] != self.key_form:
                raise ConfigError(
                    f"contract rotation_sites[{i}]={site!r} with key_form={self.key_form!r}: "
                    + (
                        "a kernel that turns keys on read would turn rotated keys again (keys at twice their position)"
                        if site == "kernel_read"
                        else "nothing would turn raw keys on read (every key at position 0)"
                    )
                )
        if all(site == DEFAULT_SITE[self.key_form] for site in sites):
            object.__setattr__(self, "rotation_sites", None)  # the key form's default on every layer

    def _check_kv_quant(self) -> None:
        """An fp8 dtype comes with its :class:`KvQuant` (scales and quantization point), and only it."""
        q = self.kv_quant
        if q is not None and not isinstance(q, KvQuant):
            raise ConfigError(f"contract kv_quant must be a KvQuant or None, got {type(q).__name__}")
        if (self.dtype == FP8_DTYPE) != (q is not None):
            raise ConfigError(
                f"contract dtype={self.dtype!r} with kv_quant={q!r}: an {FP8_DTYPE} cache needs its scale "
                "granularity and quantization point (kv_quant), and only an 8-bit cache has them"
            )
        if q is not None and q.quantized != ("after_rope" if self.key_form == "rotated" else "before_rope"):
            raise ConfigError(
                f"contract kv_quant.quantized={q.quantized!r} with key_form={self.key_form!r}: rotated keys are "
                "quantized after RoPE, raw keys before it (they are rotated after dequantizing)"
            )

    def _check_mla(self) -> None:
        """The rows an MLA cache form implies: their size, head count and the rotated slice (the rope part)."""
        m = self.mla
        if not isinstance(m, MlaCache):
            raise ConfigError(f"contract mla must be an MlaCache or None, got {type(m).__name__}")
        offset, row = m.row()
        if self.head_dim != row or (m.cached == "latent" and self.num_kv_heads != 1):
            raise ConfigError(
                f"contract mla.cached={m.cached!r} holds rows of {row} channels"
                f"{' in one head' if m.cached == 'latent' else ''}, got head_dim {self.head_dim}, "
                f"num_kv_heads {self.num_kv_heads}"
            )
        for i, record in enumerate(self.layers):
            spec = record.rope
            if spec is None or spec.rotary_offset != offset or spec.rotary_dim != m.qk_rope_head_dim:
                raise ConfigError(
                    f"contract mla.cached={m.cached!r}: layer {i} must rotate exactly the rope part, "
                    f"channels {offset}..{row - 1}"
                )

    def _check_layers(self, size_name: str, layers_name: str) -> None:
        """``layers_name`` is a sorted tuple of layer indices, non-empty exactly when ``size_name`` is set."""
        layers = getattr(self, layers_name)
        if isinstance(layers, list):  # normalize, do not reinterpret
            layers = tuple(layers)
            object.__setattr__(self, layers_name, layers)
        if not isinstance(layers, tuple):
            raise ConfigError(f"contract {layers_name} must be a tuple of layer indices, got {layers!r}")
        for i in layers:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers:
                raise ConfigError(f"contract {layers_name} holds {i!r}, not a layer index in [0, {self.num_layers})")
        if list(layers) != sorted(set(layers)):
            raise ConfigError(f"contract {layers_name} must be sorted and unique, got {layers}")
        size = getattr(self, size_name)
        if (size is None) != (not layers):
            what = "a window" if size_name == "window" else "a chunk size"
            raise ConfigError(
                f"contract {size_name}={size!r} with {layers_name}={layers}: "
                f"{what} needs the layers it applies to, and layers need {what}"
            )

    def layer(self, layer: int) -> LayerContract:
        """Layer ``layer``'s record: its attention kind and its RoPE spec."""
        return self.layers[layer]

    def layer_rope(self, layer: int) -> RopeSpec | None:
        """The spec layer ``layer``'s keys turn with, or None for a NoPE layer (``layer(i).rope``)."""
        return self.layers[layer].rope

    def layer_rotation(self, layer: int) -> RotationSite:
        """Where layer ``layer``'s keys are turned (``layer(i).rotation``, :attr:`rotation_sites`)."""
        return self.layers[layer].rotation

    def layer_attention(self, layer: int) -> LayerAttention:
        """Which keys layer ``layer``'s queries see: full, sliding (``window``) or chunked (``chunk_size``)
        (``layer(i).attention``)."""
        return self.layers[layer].attention

    # ------------------------------------------------------------------ construction

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        *,
        key_form: KeyForm,
        block_size: int = 16,
        dtype: str = "float32",
        window: int | ModelWindows | None = MODEL_WINDOWS,
        sink_tokens: int = 0,
        rotation_index: RotationIndex = "logical",
        weights_fingerprint: str = "",
        config_fingerprint: str | None = None,
        mla_form: MlaForm = "expanded",
        kv_scale: KvScale | None = None,
    ) -> CacheContract:
        """The contract for ``config``. ``window=MODEL_WINDOWS`` (``"model"``): the config's sliding and chunked layers with
        their window and chunk size; an int: that window on every layer (and no chunks); None: full
        attention on every layer. The kernel rotates iff keys are raw. ``mla_form`` (MLA models only):
        the rows the cache holds, :class:`MlaCache` (ropekv's engine caches ``"expanded"``;
        ``"latent"`` describes transformers' and vLLM's caches). ``kv_scale`` (``dtype="float8_e4m3fn"``
        only): the scales' granularity; the quantization point follows ``key_form`` (:class:`KvQuant`).
        ``weights_fingerprint``: the weights' (a checkpoint's :attr:`weights_fingerprint`);
        ``config_fingerprint``: None names ``config``'s own (:meth:`ModelConfig.config_fingerprint`)."""
        chunks: tuple[int, ...] = ()
        if window == MODEL_WINDOWS:
            kinds = config.layer_attentions
            layers = tuple(i for i, a in enumerate(kinds) if a.kind == "sliding")
            size = config.sliding_window if layers else None
            chunks = tuple(i for i, a in enumerate(kinds) if a.kind == "chunked")
        elif window is None:
            layers, size = (), None
        elif isinstance(window, int) and not isinstance(window, bool):
            layers, size = tuple(range(config.num_layers)), window
        else:
            raise ConfigError(f"window must be 'model', an int or None, got {window!r}")
        rope, layer_ropes, kv_heads, head_dim, mla = (
            config.rope,
            config.layer_ropes,
            config.num_kv_heads,
            config.head_dim,
            None,
        )
        m = getattr(config, "mla", None)
        if m is not None:
            mla = MlaCache(mla_form, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank)
            offset, head_dim = mla.row()
            kv_heads = kv_heads if mla_form == "expanded" else 1

            def row(spec: RopeSpec) -> RopeSpec:
                return spec.replace(head_dim=head_dim, rotary_offset=offset)

            rope = row(rope)
            layer_ropes = None if layer_ropes is None else tuple(None if r is None else row(r) for r in layer_ropes)
        return cls(
            key_form=key_form,
            rope=rope,
            layer_ropes=layer_ropes,
            mla=mla,
            num_layers=config.num_layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rotation_index=rotation_index,
            window=size,
            window_layers=layers,
            chunk_size=config.attention_chunk_size if chunks else None,
            chunk_layers=chunks,
            sink_tokens=sink_tokens,
            block_size=block_size,
            dtype=dtype,
            weights_fingerprint=weights_fingerprint,
            config_fingerprint=config.config_fingerprint() if config_fingerprint is None else config_fingerprint,
            kv_quant=None
            if kv_scale is None
            else KvQuant(kv_scale, "after_rope" if key_form == "rotated" else "before_rope"),
        )

    def replace(self, **changes: Any) -> CacheContract:
        return dataclasses.replace(self, **changes)

    def with_key_form(self, key_form: KeyForm) -> CacheContract:
        """The same contract with ``key_form`` (``kernel_rotates``, the rotation sites and an 8-bit cache's
        quantization point follow it: another form resets every layer to that form's default site)."""
        q = self.kv_quant
        if q is not None:
            q = KvQuant(q.scale, "after_rope" if key_form == "rotated" else "before_rope")
        sites = self.rotation_sites if key_form == self.key_form else None
        return dataclasses.replace(self, key_form=key_form, kv_quant=q, rotation_sites=sites)

    @property
    def kernel_rotates(self) -> bool:
        """The attention kernel applies RoPE to keys on read (``"kernel_read"``): exactly when keys are
        stored raw. A kernel that turns keys before it writes them (``"kernel_write"``) stores rotated
        keys and does not rotate on read: :meth:`layer_rotation` says which."""
        return self.key_form == "raw"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype keys and values are stored in (the pools')."""
        return STORAGE_DTYPES[self.dtype]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype an engine under this contract computes in: the storage dtype, float32 for an 8-bit
        cache (its rows are dequantized to float32 on read)."""
        return torch.float32 if self.kv_quant is not None else STORAGE_DTYPES[self.dtype]

    def fingerprint(self) -> str:
        """A short stable hash of every field (RoPE included)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ comparison

    def diff(self, other: CacheContract) -> list[FieldDiff]:
        """Every field that differs, in declaration order. The RoPE spec is compared by what it computes:
        its frequencies by value (:class:`~ropekv.rope.Frequencies`: a difference is named by the fields
        that produce it, ``rope.theta``, ``rope.scaling.*``, ``rope.max_position_embeddings`` under
        dynamic NTK), then its other fields one by one. A field that cannot change a key or query takes
        no part (``max_position_embeddings`` outside dynamic NTK, a config fingerprint one side leaves
        unnamed)."""
        per_layer = self.layer_ropes is not None or other.layer_ropes is not None
        ours, theirs = _flat(self, per_layer), _flat(other, per_layer)
        if not self.config_fingerprint or not other.config_fingerprint:
            del ours["config_fingerprint"], theirs["config_fingerprint"]
        diffs: list[FieldDiff] = []
        for k in _union(ours, theirs):
            a, b = ours.get(k), theirs.get(k)
            if a == b:
                continue
            if isinstance(a, Frequencies) and isinstance(b, Frequencies):
                diffs.extend(_frequency_diffs(k[: -len(".frequencies")], a.spec, b.spec))
            else:
                diffs.append(FieldDiff(k, a, b))
        if per_layer and any(d.field.startswith("layers.") for d in diffs):
            # The summary first: each layer's spec (its fingerprint, None for NoPE) on both sides.
            summary = [tuple(None if r.rope is None else r.rope.fingerprint() for r in c.layers) for c in (self, other)]
            diffs.insert(_summary_index(diffs), FieldDiff("layer_ropes", summary[0], summary[1]))
        # A layer that is NoPE on one side differs as a whole ("layers.3.rope"), not field by field.
        whole = {d.field for d in diffs if d.field.startswith("layers.") and d.field.endswith(".rope")}
        whole |= {d.field for d in diffs if d.field in ("mla", "kv_quant")}  # on one side only: one difference
        diffs = [d for d in diffs if not any(d.field.startswith(w + ".") for w in whole)]
        # Each layer whose attention kind differs, by name (the fields above say how the kinds are set).
        for i, (a, b) in enumerate(zip(self.layers, other.layers)):
            if a.attention != b.attention:
                diffs.append(FieldDiff(f"layers.{i}.attention", str(a.attention), str(b.attention)))
        return diffs

    def require_compatible(self, other: CacheContract, *, ours: str = "cache", theirs: str = "writer") -> None:
        """Raise :class:`ContractMismatch` naming every differing field, both values and the consequence.

        ``other`` (labelled ``theirs``) is the side that produced the keys; ``self`` (``ours``) reads them.
        """
        diffs = self.diff(other)
        if diffs:
            raise mismatch(diffs, ours=ours, theirs=theirs)

    # ------------------------------------------------------------------ serialization

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION}
        for name in _FIELDS:
            d[name] = getattr(self, name)
        d["rope"] = self.rope.to_dict()
        d["window_layers"] = list(self.window_layers)
        if self.chunk_layers:
            d["chunk_layers"] = list(self.chunk_layers)
        else:  # no chunked layer
            del d["chunk_size"], d["chunk_layers"]
        if self.rotation_sites is None:
            del d["rotation_sites"]  # the key form's default site on every layer
        else:
            d["rotation_sites"] = list(self.rotation_sites)
        if self.layer_ropes is None:
            del d["layer_ropes"]  # one RoPE for all layers
        else:
            d["layer_ropes"] = [None if spec is None else spec.to_dict() for spec in self.layer_ropes]
        if self.mla is None:
            del d["mla"]  # not MLA
        else:
            d["mla"] = self.mla.to_dict()
        if self.block_layout == DEFAULT_BLOCK_LAYOUT:
            del d["block_layout"]  # the default layout
        if self.kv_quant is None:
            del d["kv_quant"]  # not quantized
        else:
            d["kv_quant"] = self.kv_quant.to_dict()
        return d

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, compact); floats round-trip exactly."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, s: str | bytes) -> CacheContract:
        """Inverse of :meth:`to_json`. Malformed input raises ConfigError naming the problem."""
        try:
            data = json.loads(s)
        except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise ConfigError(f"cache contract JSON does not parse: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"cache contract JSON must be an object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ConfigError(f"cache contract JSON has format {data.get('format')!r}, expected {FORMAT!r}")
        version = data.get("version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            older = isinstance(version, int) and not isinstance(version, bool) and 1 <= version < FORMAT_VERSION
            raise ConfigError(
                f"cache contract JSON version {version!r} is not supported (readable: "
                f"{', '.join(map(str, READABLE_VERSIONS))})"
                + (
                    f": version {version} carried one fingerprint of weights and configuration together, which "
                    "cannot be split into the weights and configuration fingerprints this version compares; "
                    "build the contract again with this ropekv"
                    if older
                    else ""
                )
            )
        expected = set(_FIELDS) | {"format", "version"}
        optional = {"layer_ropes", "mla", "block_layout", "kv_quant", "chunk_size", "chunk_layers", "rotation_sites"}
        missing, unexpected = sorted(expected - set(data) - optional), sorted(set(data) - expected)
        if missing or unexpected:
            raise ConfigError(f"cache contract JSON: missing field(s) {missing}, unexpected field(s) {unexpected}")
        kwargs = {k: v for k, v in data.items() if k not in ("format", "version")}
        if not isinstance(kwargs["window_layers"], list):
            raise ConfigError(f"cache contract JSON: window_layers must be a list, got {kwargs['window_layers']!r}")
        kwargs["window_layers"] = tuple(kwargs["window_layers"])
        if "chunk_layers" in kwargs:
            if not isinstance(kwargs["chunk_layers"], list) or not kwargs["chunk_layers"]:
                raise ConfigError(
                    f"cache contract JSON: chunk_layers must be a non-empty list, got "
                    f"{kwargs['chunk_layers']!r} (a contract without chunks leaves it out)"
                )
            kwargs["chunk_layers"] = tuple(kwargs["chunk_layers"])
        if "rotation_sites" in kwargs:
            sites = kwargs["rotation_sites"]
            form = kwargs["key_form"]
            default = DEFAULT_SITE.get(form) if isinstance(form, str) else None
            if not isinstance(sites, list) or all(site == default for site in sites):
                raise ConfigError(
                    f"cache contract JSON: rotation_sites must be a list with a layer whose site is "
                    f"not the default of key form {form!r}, got {sites!r} (default sites are left out)"
                )
            kwargs["rotation_sites"] = tuple(sites)
        rope = kwargs["rope"]
        if not isinstance(rope, dict) or not isinstance(rope.get("scaling"), dict):
            raise ConfigError("cache contract JSON: rope must be an object with a 'scaling' object")
        for name in ("head_dim", "rotary_dim", "max_position_embeddings"):
            if not isinstance(rope.get(name), int) or isinstance(rope.get(name), bool):
                raise ConfigError(f"cache contract JSON: rope.{name} must be an integer, got {rope.get(name)!r}")
        ropes = kwargs.get("layer_ropes")
        if ropes is not None and (
            not isinstance(ropes, list)
            or not all(r is None or isinstance(r, dict) and isinstance(r.get("scaling"), dict) for r in ropes)
        ):
            raise ConfigError("cache contract JSON: layer_ropes must be a list of RoPE objects or nulls")
        try:
            kwargs["rope"] = RopeSpec.from_dict(rope)
            if ropes is not None:
                kwargs["layer_ropes"] = tuple(None if r is None else RopeSpec.from_dict(r) for r in ropes)
            if kwargs.get("mla") is not None:
                kwargs["mla"] = MlaCache.from_dict(kwargs["mla"])
            if kwargs.get("kv_quant") is not None:
                kwargs["kv_quant"] = KvQuant.from_dict(kwargs["kv_quant"])
            return cls(**kwargs)
        except (TypeError, ValueError, AttributeError, ArithmeticError) as exc:
            raise ConfigError(f"cache contract JSON has a value of the wrong type: {exc}") from None


# The constructor's (and the JSON's) fields, in declaration order; ``layers`` is derived from them.
_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CacheContract))


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"contract {name} must be an integer >= {low}, got {value!r}")


def _flat(c: CacheContract, per_layer: bool = False) -> dict[str, Any]:
    """Fields by dotted name, the RoPE spec (and its scaling) expanded; tuples stay tuples.
    ``per_layer``: each layer's spec too, as ``layers.{i}.rope.*`` (``layers.{i}.rope`` = None for NoPE)."""
    out: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(c, name)
        if name == "rotation_sites":
            # Not compared: "op" and "kernel_write" both store R(j) k_j, so keys read the same whoever
            # turned them; a site that stores another form ("kernel_read") comes with another key_form,
            # and that difference is named (and converted, where asked) as key_form.
            continue
        if name == "layer_ropes":
            if per_layer:  # every layer's spec (the summary is added by diff where one differs)
                for i, record in enumerate(c.layers):
                    spec = record.rope
                    if spec is None:
                        out[f"layers.{i}.rope"] = None
                    else:
                        out[f"layers.{i}.rope"] = "RoPE"
                        _flat_rope(out, f"layers.{i}.rope", spec)
            continue
        if name == "kv_quant":  # "kv_quant" = None for an unquantized cache, else its fields one by one
            if value is None:
                out["kv_quant"] = None
            else:
                out["kv_quant"] = "fp8"
                out.update({f"kv_quant.{k}": v for k, v in value.to_dict().items()})
            continue
        if name == "mla":  # "mla" = None where the model has no MLA, else its fields one by one
            if value is None:
                out["mla"] = None
            else:
                out["mla"] = "MLA"
                out.update({f"mla.{k}": v for k, v in value.to_dict().items()})
            continue
        if name != "rope":
            out[name] = value
            continue
        _flat_rope(out, "rope", value)
    return out


# The RopeSpec fields that produce its frequencies: compared through RopeSpec.frequencies (by value),
# never one by one. Every other field of the spec is compared as it is.
_FREQUENCY_FIELDS = frozenset(("theta", "scaling", "max_position_embeddings"))


def _flat_rope(out: dict[str, Any], prefix: str, spec: RopeSpec) -> None:
    for rf in dataclasses.fields(spec):
        if rf.name not in _FREQUENCY_FIELDS:
            out[f"{prefix}.{rf.name}"] = getattr(spec, rf.name)
    out[f"{prefix}.frequencies"] = spec.frequencies()


def _frequency_diffs(prefix: str, ours: RopeSpec, theirs: RopeSpec) -> list[FieldDiff]:
    """The fields that make two specs' frequencies differ: ``theta``, every scaling parameter, and
    ``max_position_embeddings`` where a side uses dynamic NTK (the length its base grows past). The
    frequencies differ, so some such field does, or ``rotary_dim`` (named on its own);
    ``{prefix}.frequencies`` is the fallback name."""
    a, b = ours.to_dict(), theirs.to_dict()
    names = ["theta"] + [f"scaling.{k}" for k in _union(a["scaling"], b["scaling"])]
    if "dynamic" in (ours.scaling.rope_type, theirs.scaling.rope_type):
        names.append("max_position_embeddings")

    def value(d: dict[str, Any], name: str) -> Any:
        return d["scaling"].get(name[len("scaling.") :]) if name.startswith("scaling.") else d[name]

    diffs = [FieldDiff(f"{prefix}.{n}", value(a, n), value(b, n)) for n in names if value(a, n) != value(b, n)]
    if diffs or ours.rotary_dim != theirs.rotary_dim:  # another rotary_dim is named as itself
        return diffs
    return [FieldDiff(f"{prefix}.frequencies", ours.frequencies(), theirs.frequencies())]


def rope_diffs(ours: RopeSpec, theirs: RopeSpec, prefix: str = "rope") -> list[FieldDiff]:
    """How two specs turn keys and queries differently, as :meth:`CacheContract.diff` names it (empty:
    they compute the same rotation, however their configurations spell it)."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    _flat_rope(a, prefix, ours)
    _flat_rope(b, prefix, theirs)
    diffs: list[FieldDiff] = []
    for k in a:
        if a[k] == b[k]:
            continue
        if isinstance(a[k], Frequencies):
            diffs.extend(_frequency_diffs(prefix, ours, theirs))
        else:
            diffs.append(FieldDiff(k, a[k], b[k]))
    return diffs


def _summary_index(diffs: list[FieldDiff]) -> int:
    """Where the ``layer_ropes`` summary goes: before the first per-layer difference."""
    return next(i for i, d in enumerate(diffs) if d.field.startswith("layers."))


def _union(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return list(a) + [k for k in b if k not in a]
