"""Fuzzing of config parsing: only RopeKVError may escape, and what is accepted is consistent.

Inputs are mutated from valid transformers configs (llama, mistral with a window, qwen2 with bias,
qwen3) the way half-converted checkpoints and other frameworks get them wrong: fields dropped, wrong
types, zero / negative / huge / NaN numbers, strings where numbers belong, random ``rope_parameters``
and legacy ``rope_scaling`` dicts of every scaling type, and per-layer-type nested RoPE parameters.
They go to ``read_model_config`` and ``rope_from_hf_config``; serialized cache contracts
mutated as JSON text (and as parsed JSON) go to ``CacheContract.from_json``.

Any exception that is not a :class:`ropekv.errors.RopeKVError` (KeyError, TypeError, ValueError,
ZeroDivisionError, OverflowError ...) fails the test; so does an accepted value that breaks an
invariant (frequencies not finite and positive, heads that do not divide, a contract that does not
round-trip through its own JSON).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ropekv.contract import CacheContract
from ropekv.errors import ConfigError, RopeKVError
from ropekv.models.config import LAYER_TYPES, ModelConfig
from ropekv.models.hf_config import read_model_config
from ropekv.models.rope_config import rope_from_hf_config
from ropekv.rope import SCALING_TYPES, RopeScaling, RopeSpec

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
BASES = [
    _LLAMA,
    {**_LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 5},
    {
        **_LLAMA,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 7,
        "max_window_layers": 1,
    },
    {**_LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 48},
    {
        **_LLAMA,
        "rope_parameters": None,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
]

FIELDS = sorted(
    {k for base in BASES for k in base}
    | {
        "layer_types",
        "partial_rotary_factor",
        "rope_theta",
        "original_max_position_embeddings",
        "auto_map",
        "_name_or_path",
        "use_sliding_window",
        "max_window_layers",
        "sliding_window",
        "num_key_value_heads",
    }
)
SCALING_FIELDS = [
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "short_factor",
    "long_factor",
    "attention_factor",
    "partial_rotary_factor",
]

huge_ints = st.sampled_from([0, -1, -(2**31), 2**31, 2**63, 2**64, 10**30, 10**400])
numbers = st.one_of(
    st.integers(-3, 600),
    huge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 1e-300, 5e-324, 1e300]),
)
scalars = st.one_of(
    st.none(), st.booleans(), numbers, st.text(max_size=8), numbers.map(str)
)  # strings where numbers belong
weird = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
factor_lists = st.one_of(st.lists(st.floats(0.5, 4.0), min_size=8, max_size=8), st.lists(numbers, max_size=9), weird)


@st.composite
def rope_dicts(draw) -> dict[str, Any]:
    """A RoPE parameter dict: a plausible one of a random type, then some fields made weird or dropped."""
    kind = draw(st.sampled_from(SCALING_TYPES + ("ntk", "su", "")))
    d: dict[str, Any] = {"rope_type": kind, "rope_theta": draw(st.sampled_from([10000.0, 1e6, 500000]))}
    if kind in ("linear", "dynamic", "yarn", "llama3", "longrope"):
        d["factor"] = draw(st.sampled_from([2.0, 4.0, 8.0, 0.5, 32]))
    if kind in ("yarn", "llama3", "longrope"):
        d["original_max_position_embeddings"] = draw(st.sampled_from([64, 128, 256, 1, 4096]))
    if kind == "llama3":
        d.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if kind == "yarn" and draw(st.booleans()):
        d.update(beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707, truncate=True)
    if kind == "longrope":
        d.update(short_factor=draw(factor_lists), long_factor=draw(factor_lists))
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from(SCALING_FIELDS + ["bogus"]))
        if draw(st.booleans()) and field in d:
            del d[field]
        else:
            d[field] = draw(weird)
    return d


@st.composite
def configs(draw) -> dict[str, Any]:
    """A valid config with 1-4 mutations."""
    config = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["drop", "weird", "number", "string", "rope", "legacy", "nested", "layer_types"]))
        if op == "drop" and config:
            config.pop(draw(st.sampled_from(sorted(config))))
        elif op == "weird":
            config[draw(st.sampled_from(FIELDS))] = draw(weird)
        elif op == "number":
            config[draw(st.sampled_from(FIELDS))] = draw(numbers)
        elif op == "string":  # a number written as a string
            field = draw(st.sampled_from(FIELDS))
            config[field] = str(config.get(field, draw(numbers)))
        elif op == "rope":
            config["rope_parameters"] = draw(rope_dicts())
        elif op == "legacy":
            config.pop("rope_parameters", None)
            config["rope_scaling"] = draw(st.none() | rope_dicts())
        elif op == "nested":
            names = draw(
                st.lists(st.sampled_from(LAYER_TYPES + ("chunked_attention",)), min_size=1, max_size=3, unique=True)
            )
            config["rope_parameters"] = {name: draw(st.none() | rope_dicts()) for name in names}
        else:
            n = config.get("num_hidden_layers", 2)
            n = n if isinstance(n, int) and 0 <= n <= 8 else 2
            config["layer_types"] = draw(
                st.lists(
                    st.sampled_from(LAYER_TYPES + ("chunked_attention",)) | weird,
                    min_size=max(0, n - 1),
                    max_size=n + 1,
                )
            )
    return config


# ----------------------------------------------------------------------------------- invariants


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_rope(rope: RopeSpec) -> None:
    assert _positive_int(rope.head_dim) and rope.head_dim % 2 == 0
    assert _positive_int(rope.rotary_dim) and rope.rotary_dim % 2 == 0 and 2 <= rope.rotary_dim <= rope.head_dim
    assert math.isfinite(rope.theta) and rope.theta > 1
    assert math.isfinite(rope.attention_factor) and rope.attention_factor > 0
    assert _positive_int(rope.max_position_embeddings)
    assert isinstance(rope.scaling, RopeScaling) and rope.scaling.rope_type in SCALING_TYPES
    lengths = [None, 1, rope.max_position_embeddings, rope.max_position_embeddings + 1]
    for seq_len in lengths:
        inv_freq = rope.inv_freq(seq_len)
        assert inv_freq.dtype == torch.float64 and inv_freq.shape == (rope.rotary_dim // 2,)
        assert bool(torch.isfinite(inv_freq).all()) and bool((inv_freq > 0).all()), (seq_len, inv_freq)
    cos, sin = rope.cos_sin(torch.tensor([0, 1, rope.max_position_embeddings - 1]))
    assert bool(torch.isfinite(cos).all()) and bool(torch.isfinite(sin).all())
    text = json.dumps(rope.to_dict(), allow_nan=False)  # serializable, no NaN/inf anywhere
    assert RopeSpec.from_dict(json.loads(text)) == rope
    assert len(rope.fingerprint()) == 16


# Upper bounds a read config keeps (docs/architectures.md, "Bounds"); the rest: 2**40, the position limit.
_BOUNDS = {
    "vocab_size": 2**24,
    "hidden_size": 2**20,
    "intermediate_size": 2**20,
    "num_layers": 4096,
    "num_heads": 4096,
    "num_kv_heads": 4096,
    "head_dim": 65536,
}


def check_model(cfg: ModelConfig) -> None:
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        assert _positive_int(getattr(cfg, name)), name
        assert getattr(cfg, name) <= _BOUNDS.get(name, 2**40), name  # nothing a file gives sizes memory unbounded
    assert cfg.sliding_window is None or cfg.sliding_window <= 2**40
    assert cfg.attention_chunk_size is None or cfg.attention_chunk_size <= 2**40
    assert cfg.num_heads % cfg.num_kv_heads == 0
    assert cfg.head_dim == cfg.rope.head_dim
    assert isinstance(cfg.layer_types, tuple) and len(cfg.layer_types) == cfg.num_layers
    assert set(cfg.layer_types) <= set(LAYER_TYPES)
    sliding = "sliding_attention" in cfg.layer_types
    assert (cfg.sliding_window is not None) == sliding
    assert cfg.sliding_window is None or _positive_int(cfg.sliding_window)
    assert all(
        cfg.layer_window(i) == (cfg.sliding_window if t == "sliding_attention" else None)
        for i, t in enumerate(cfg.layer_types)
    )
    assert math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps >= 0
    assert all(
        isinstance(v, bool)
        for v in (cfg.tie_word_embeddings, cfg.attention_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm)
    )
    assert _positive_int(cfg.position_limit) and cfg.position_limit >= cfg.max_position_embeddings
    shapes = cfg.expected_shapes()
    assert all(all(_positive_int(d) for d in shape) for shape in shapes.values())
    json.dumps(cfg.to_dict(), allow_nan=False)
    check_rope(cfg.rope)
    for key_form in ("rotated", "raw"):  # a valid model has a valid cache contract, which round-trips
        contract = CacheContract.for_model(cfg, key_form=key_form)
        assert CacheContract.from_json(contract.to_json()) == contract


# ----------------------------------------------------------------------------------- tests


@FUZZ
@given(configs())
def test_model_config_parsing(config):
    try:
        cfg = read_model_config(config, source="fuzz/config.json")
    except RopeKVError as exc:
        assert str(exc).startswith("fuzz/config.json: ") and str(exc).count("fuzz/config.json") == 1, str(exc)
        return
    check_model(cfg)
    assert read_model_config(copy.deepcopy(config), source="again") == cfg  # deterministic


@FUZZ
@given(
    configs(),
    st.sampled_from([None, "full_attention", "sliding_attention", "chunked_attention"]),
    st.sampled_from(["neox", "gptj", "half"]),
)
def test_rope_spec_parsing(config, layer_type, layout):
    try:
        rope = rope_from_hf_config(config, layer_type=layer_type, layout=layout)
    except RopeKVError:
        return
    check_rope(rope)
    assert rope.layout == layout


@FUZZ
@given(rope_dicts(), st.integers(1, 8).map(lambda n: 2 * n), st.sampled_from([1, 64, 256, 10**6]))
def test_rope_parameters_alone(rope, head_dim, max_pos):
    config = {"head_dim": head_dim, "max_position_embeddings": max_pos, "rope_parameters": rope}
    try:
        spec = rope_from_hf_config(config)
    except RopeKVError:
        return
    check_rope(spec)


def _int_fields(base: dict[str, Any]) -> list[tuple[str, ...]]:
    """Paths of the integer fields a base config gives (top level and inside its RoPE dicts)."""
    paths: list[tuple[str, ...]] = [(k,) for k, v in base.items() if isinstance(v, int) and not isinstance(v, bool)]
    for key in ("rope_parameters", "rope_scaling"):
        rope = base.get(key)
        if isinstance(rope, dict):
            paths += [(key, k) for k, v in rope.items() if isinstance(v, int) and not isinstance(v, bool)]
    return paths


out_of_range = st.one_of(st.integers(2**40 + 1, 2**200), st.integers(-(2**200), -1))


@FUZZ
@given(st.data(), out_of_range)
def test_every_config_integer_is_bounded_at_read_time(data, value):
    """An integer field the architecture reads, set far out of range (2**64 as a window overflowed the
    paged cache once), is refused when the config is read: a ConfigError naming the field."""
    base = data.draw(st.sampled_from(BASES))
    path = data.draw(st.sampled_from(_int_fields(base)))
    config = copy.deepcopy(base)
    target = config
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    try:
        cfg = read_model_config(config, source="fuzz/config.json")
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith("fuzz/config.json: ") and "\n" not in message, message
        assert path[-1] in message or ("head_dim" in message and path[-1] == "hidden_size"), message
        return
    raise AssertionError(f"{'.'.join(path)} = {value} was accepted: {cfg}")


# ----------------------------------------------------------------------------------- contract JSON

_BASE_CONFIGS = [read_model_config(b) for b in BASES]
CONTRACTS = [
    CacheContract.for_model(_BASE_CONFIGS[0], key_form="rotated", weights_fingerprint="abc123"),
    CacheContract.for_model(_BASE_CONFIGS[1], key_form="raw", block_size=7, dtype="bfloat16"),
    CacheContract.for_model(_BASE_CONFIGS[0], key_form="raw", window=5, sink_tokens=2, rotation_index="cache"),
    CacheContract.for_model(_BASE_CONFIGS[4], key_form="rotated"),
]


@st.composite
def text_mutations(draw) -> str | bytes:
    text = draw(st.sampled_from(CONTRACTS)).to_json()
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["delete", "insert", "replace", "truncate", "duplicate"]))
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 12)))
        if op == "delete":
            text = text[:i] + text[j:]
        elif op == "insert":
            text = text[:i] + draw(st.text(alphabet='{}[]",:0123456789.-eE+ntrufalsNIy', max_size=6)) + text[i:]
        elif op == "replace":
            text = text[:i] + draw(st.text(max_size=3)) + text[j:]
        elif op == "truncate":
            text = text[:i]
        else:
            text = text[:j] + text[i:j] + text[j:]
    return text.encode("utf-8", "surrogatepass") if draw(st.booleans()) else text


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def structural_mutations(draw) -> str:
    data = json.loads(draw(st.sampled_from(CONTRACTS)).to_json())
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(data)[1:]))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["set", "delete", "add"]))
        if op == "set":
            parent[path[-1]] = draw(weird)
        elif op == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(weird)
    return json.dumps(data)  # allow_nan: NaN / Infinity tokens are part of the fuzz


def _check_contract_json(text: str | bytes) -> None:
    try:
        contract = CacheContract.from_json(text)
    except RopeKVError:
        return
    check_rope(contract.rope)
    assert CacheContract.from_json(contract.to_json()) == contract
    assert contract.kernel_rotates == (contract.key_form == "raw")
    assert (contract.window is None) == (not contract.window_layers)
    assert all(0 <= i < contract.num_layers for i in contract.window_layers)


@FUZZ
@given(text_mutations())
def test_contract_json_text_mutations(text):
    _check_contract_json(text)


@FUZZ
@given(structural_mutations())
def test_contract_json_structural_mutations(text):
    _check_contract_json(text)


@FUZZ
@given(st.binary(max_size=64) | st.text(max_size=64))
def test_contract_json_from_noise(data):
    _check_contract_json(data)


def test_deep_nesting_and_huge_numbers_in_contract_json():
    for text in [
        "[" * 100_000,
        '{"a":' * 100_000,
        "1" * 5000,
        CONTRACTS[0].to_json().replace("16,", "1" + "0" * 400 + ","),
    ]:
        try:
            CacheContract.from_json(text)
        except RopeKVError:
            pass
