"""CacheContract: validation, for_model, diff, require_compatible messages, JSON round trip."""

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropekv.contract import CacheContract, FieldDiff, KvQuant, MlaCache, consequence
from ropekv.errors import ConfigError, ContractMismatch
from ropekv.models.config import ModelConfig
from ropekv.rope import RopeScaling, RopeSpec

ROPE = RopeSpec(head_dim=8, rotary_dim=8, theta=10000.0)


def make(**changes) -> CacheContract:
    base = dict(
        key_form="rotated",
        rope=ROPE,
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        window=5,
        window_layers=(1,),
        sink_tokens=0,
        block_size=4,
        dtype="float32",
        weights_fingerprint="m1",
        config_fingerprint="c1",
    )
    base.update(changes)
    return CacheContract(**base)


def model_config(layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=7):
    return ModelConfig(
        architecture="qwen2",
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_layers=len(layer_types),
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        rope=ROPE,
        sliding_window=sliding_window,
        layer_types=tuple(layer_types),
    )


# ---------------------------------------------------------------------- validation


def test_valid_contracts():
    c = make()
    assert c.torch_dtype == torch.float32
    raw = make(key_form="raw", rotation_index="cache", sink_tokens=2)
    assert raw.kernel_rotates and raw.rotation_index == "cache"
    assert make(window=None, window_layers=()).window is None
    assert make(dtype="bfloat16").torch_dtype == torch.bfloat16
    assert make(window_layers=[0, 2]).window_layers == (0, 2)  # a list is normalized to a tuple


def test_rotated_keys_with_length_dependent_rope_are_a_valid_description():
    dyn = ROPE.replace(scaling=RopeScaling("dynamic", factor=2.0))
    assert dyn.length_dependent
    assert make(rope=dyn).key_form == "rotated"  # HF transformers caches exactly this; the engine refuses it


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(window=None, window_layers=(), sink_tokens=2), "sink_tokens=2 needs a window"),
        (dict(rotation_index="cache"), "rotation_index='cache' needs key_form='raw'"),
        (dict(head_dim=16), "head_dim 16 != rope.head_dim 8"),
        (dict(dtype="int8"), "dtype"),
        (dict(dtype=torch.float32), "dtype"),
        (dict(key_form="Rotated"), "key_form"),
        (dict(rotation_index="slot"), "rotation_index"),
        (dict(window=0), "window must be an integer >= 1"),
        (dict(window=None), "a window needs the layers"),
        (dict(window_layers=()), "a window needs the layers"),
        (dict(window_layers=(3,)), r"not a layer index in \[0, 3\)"),
        (dict(window_layers=(-1,)), "not a layer index"),
        (dict(window_layers=(2, 1)), "sorted and unique"),
        (dict(window_layers=(1, 1)), "sorted and unique"),
        (dict(window_layers="1"), "window_layers must be a tuple"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=True), "block_size"),
        (dict(num_layers=0), "num_layers"),
        (dict(num_kv_heads=2.0), "num_kv_heads"),
        (dict(rope=ROPE.to_dict()), "rope must be a RopeSpec"),
        (dict(weights_fingerprint=None), "weights_fingerprint"),
    ],
)
def test_invalid_combinations_raise(changes, match):
    with pytest.raises(ConfigError, match=match):
        make(**changes)


def test_for_model_takes_the_model_window_and_its_sliding_layers():
    cfg = model_config()
    c = CacheContract.for_model(cfg, key_form="rotated", weights_fingerprint="abc")
    assert (c.window, c.window_layers, c.kernel_rotates) == (7, (1,), False)
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.rope, c.block_size, c.dtype) == (3, 2, 8, ROPE, 16, "float32")
    assert c.weights_fingerprint == "abc"
    raw = CacheContract.for_model(cfg, key_form="raw", window=5, sink_tokens=2, rotation_index="cache", block_size=7)
    assert (raw.window, raw.window_layers, raw.kernel_rotates, raw.sink_tokens) == (5, (0, 1, 2), True, 2)
    none = CacheContract.for_model(cfg, key_form="rotated", window=None)
    assert (none.window, none.window_layers) == (None, ())
    full = CacheContract.for_model(model_config(("full_attention",) * 2, None), key_form="rotated")
    assert (full.window, full.window_layers) == (None, ())


@pytest.mark.parametrize("window", ["all", 2.5, True])
def test_for_model_rejects_bad_window(window):
    with pytest.raises(ConfigError, match="window"):
        CacheContract.for_model(model_config(), key_form="rotated", window=window)


def test_for_model_refuses_cache_index_with_rotated_keys():
    with pytest.raises(ConfigError, match="rotation_index='cache' needs key_form='raw'"):
        CacheContract.for_model(model_config(), key_form="rotated", rotation_index="cache")


def test_with_key_form_adjusts_kernel_rotates():
    raw = make().with_key_form("raw")
    assert (raw.key_form, raw.kernel_rotates) == ("raw", True)
    assert raw.with_key_form("rotated") == make()
    with pytest.raises(ConfigError):
        make(key_form="raw", rotation_index="cache").with_key_form("rotated")


def test_fingerprint_is_stable_and_covers_the_rope():
    assert make().fingerprint() == make().fingerprint()
    assert len(make().fingerprint()) == 16
    assert make().fingerprint() != make(rope=ROPE.replace(theta=10001.0)).fingerprint()
    assert make().fingerprint() != make(block_size=5).fingerprint()


# ---------------------------------------------------------------------- diff / require_compatible

# field -> (their contract, every field that differs from make(), a phrase of the field's consequence)
VARIANTS = {
    "key_form": (make().with_key_form("raw"), {"key_form"}, "position 0"),
    "rotation_index": (
        make(key_form="raw", rotation_index="cache"),
        {"key_form", "rotation_index"},
        "slot used as position",
    ),
    "rope.head_dim": (
        make(rope=ROPE.replace(head_dim=16), head_dim=16),
        {"rope.head_dim", "head_dim"},
        "size per head",
    ),
    "rope.rotary_dim": (make(rope=ROPE.replace(rotary_dim=4)), {"rope.rotary_dim"}, "partial rotary"),
    "rope.theta": (
        make(rope=ROPE.replace(theta=500000.0)),
        {"rope.theta"},
        "different frequencies: the error grows with position",
    ),
    "rope.layout": (
        make(rope=ROPE.replace(layout="gptj")),
        {"rope.layout"},
        "channel pairs would not match: wrong from the first layer",
    ),
    "rope.scaling.rope_type": (
        make(rope=ROPE.replace(scaling=RopeScaling("linear", factor=2.0))),
        {"rope.scaling.rope_type", "rope.scaling.factor"},
        "different frequencies",
    ),
    "rope.scaling.factor": (
        make(rope=ROPE.replace(scaling=RopeScaling("linear", factor=2.0))),
        {"rope.scaling.rope_type", "rope.scaling.factor"},
        "different frequencies",
    ),
    "rope.attention_factor": (
        make(rope=ROPE.replace(attention_factor=1.2)),
        {"rope.attention_factor"},
        "attention factor",
    ),
    # max_position_embeddings takes part only under dynamic NTK (tests/test_contract_rotation.py)
    # per layer too: the layer whose attention kind differs is named (layers.1.attention)
    "rope.mrope_section": (
        make(rope=ROPE.replace(mrope_section=(ROPE.rotary_dim // 2,))),
        {"rope.mrope_section"},
        "three position streams",
    ),
    "window": (
        make(window=7),
        {"window", "layers.1.attention"},
        "the reader would see keys the writer dropped, or miss keys",
    ),
    "window_layers": (make(window_layers=(0, 1)), {"window_layers", "layers.0.attention"}, "keys the writer dropped"),
    "chunk_size": (
        make(window=None, window_layers=(), chunk_size=8, chunk_layers=(1,)),
        {"window", "window_layers", "chunk_size", "chunk_layers", "layers.1.attention"},
        "chunks would start",
    ),
    "chunk_layers": (
        make(window=None, window_layers=(), chunk_size=8, chunk_layers=(1,)),
        {"window", "window_layers", "chunk_size", "chunk_layers", "layers.1.attention"},
        "a layer chunked on one side",
    ),
    "sink_tokens": (make(sink_tokens=4), {"sink_tokens"}, "keys the writer dropped"),
    "block_size": (make(block_size=16), {"block_size"}, "token boundaries"),
    "dtype": (make(dtype="bfloat16"), {"dtype"}, "another precision"),
    # the block tensor's memory order in a transfer (not RoPE's channel-pair layout)
    "block_layout": (make(block_layout="blocks,2,heads,block,dim"), {"block_layout"}, "heads and tokens swapped"),
    "kv_quant": (
        make(dtype="float8_e4m3fn", kv_quant=KvQuant("per_tensor", "after_rope")),
        {"dtype", "kv_quant"},
        "codes would be read as numbers",
    ),
    "num_layers": (make(num_layers=4), {"num_layers"}, "wrong layer"),
    "num_kv_heads": (make(num_kv_heads=4), {"num_kv_heads"}, "head counts differ"),
    "head_dim": (make(rope=ROPE.replace(head_dim=16), head_dim=16), {"rope.head_dim", "head_dim"}, "head sizes differ"),
    "weights_fingerprint": (make(weights_fingerprint="m2"), {"weights_fingerprint"}, "keys come from another model"),
    "config_fingerprint": (make(config_fingerprint="c2"), {"config_fingerprint"}, "another configuration"),
    # per layer: the summary plus the layer's own fields (tests/test_architectures_contract.py)
    "layer_ropes": (make(layer_ropes=(ROPE, None, ROPE)), {"layer_ropes", "layers.1.rope"}, "other RoPE spec"),
    "rope.rotary_offset": (
        make(rope=ROPE.replace(rotary_dim=4, rotary_offset=4)),
        {"rope.rotary_dim", "rope.rotary_offset"},
        "another slice of each key would rotate",
    ),
    # multi-head latent attention on one side only (tests/test_architectures_contract.py compares two MLA forms)
    "mla": (
        make(rope=ROPE.replace(rotary_dim=4, rotary_offset=4), mla=MlaCache("expanded", 4, 4, 4, 16)),
        {"rope.rotary_dim", "rope.rotary_offset", "mla"},
        "multi-head latent attention and the other is not",
    ),
}


def test_variants_cover_every_contract_field():
    # rotation_sites differ as key_form or not at all (tests/test_contract_rotation_sites.py)
    top = {f.name for f in dataclasses.fields(CacheContract)} - {"rope", "rotation_sites"}
    # max_position_embeddings: by what it computes, only under dynamic NTK (tests/test_contract_rotation.py)
    rope = {f"rope.{f.name}" for f in dataclasses.fields(RopeSpec)} - {"rope.scaling", "rope.max_position_embeddings"}
    assert top | rope <= set(VARIANTS)


def test_every_field_has_a_consequence():
    names = [f.name for f in dataclasses.fields(CacheContract) if f.name != "rope"]
    names += [f"rope.{f.name}" for f in dataclasses.fields(RopeSpec) if f.name != "scaling"]
    names += [f"rope.scaling.{f.name}" for f in dataclasses.fields(RopeScaling)]
    for name in names:
        text = consequence(FieldDiff(name, "raw", "rotated"))
        assert text and "agree" not in text, name


def test_identical_contracts_are_compatible():
    assert make().diff(make()) == []
    make().require_compatible(CacheContract.from_json(make().to_json()))


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_diff_lists_each_field(field):
    theirs, expected, _ = VARIANTS[field]
    diffs = make().diff(theirs)
    assert {d.field for d in diffs} == expected
    d = next(d for d in diffs if d.field == field)
    ours_flat = {x.field: x.ours for x in diffs}
    assert d.ours == ours_flat[field] and d.ours != d.theirs


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_require_compatible_names_every_field_and_its_consequence(field):
    theirs, expected, phrase = VARIANTS[field]
    with pytest.raises(ContractMismatch) as info:
        make().require_compatible(theirs, ours="decode", theirs="prefill")
    err = info.value
    assert set(err.fields) == expected
    msg = str(err)
    for d in make().diff(theirs):
        assert f"{d.field}: decode={d.ours!r}, prefill={d.theirs!r}" in msg
    assert phrase in msg


def test_key_form_consequence_depends_on_the_direction():
    rotated, raw = make(), make().with_key_form("raw")
    with pytest.raises(
        ContractMismatch, match="stored keys are rotated, reader rotates again: keys would sit at twice their position"
    ):
        raw.require_compatible(rotated)  # rotated keys written, reader rotates
    with pytest.raises(ContractMismatch, match="every key would sit at position 0"):
        rotated.require_compatible(raw)  # raw keys written, reader expects rotated


def test_require_compatible_names_all_fields_at_once():
    theirs = make(
        rope=ROPE.replace(theta=5e5, layout="gptj"), block_size=8, dtype="float16", weights_fingerprint="x"
    ).with_key_form("raw")
    with pytest.raises(ContractMismatch) as info:
        make().require_compatible(theirs)
    fields = {"key_form", "rope.theta", "rope.layout", "block_size", "dtype", "weights_fingerprint"}
    assert set(info.value.fields) == fields
    assert "differ in 6 field(s)" in str(info.value)
    assert "\n" not in str(info.value)  # one line for the CLI


# ---------------------------------------------------------------------- JSON


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_older_versions_are_refused_naming_the_version(version):
    """Versions before 5 held one fingerprint of weights and configuration together: refused by
    version, with a typed error, whatever else the document holds."""
    data = json.loads(make().to_json())
    data.update(version=version, weights_fingerprint="ignored")
    with pytest.raises(ConfigError, match=f"version {version} is not supported .*fingerprint of weights and config"):
        CacheContract.from_json(json.dumps(data))


def test_json_has_format_and_version_and_round_trips():
    c = make(
        rope=ROPE.replace(scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=512, beta_fast=16.0))
    )
    data = json.loads(c.to_json())
    assert data["format"] == "ropekv.cache_contract" and data["version"] == 5 and "kernel_rotates" not in data
    assert CacheContract.from_json(c.to_json()) == c
    assert CacheContract.from_json(c.to_json().encode()) == c


finite = dict(allow_nan=False, allow_infinity=False)


@st.composite
def rope_specs(draw):
    half = draw(st.integers(1, 64))
    head_dim = 2 * draw(st.integers(half, 64))
    rotary_dim = 2 * half
    kind = draw(st.sampled_from(["default", "linear", "dynamic", "yarn", "llama3", "longrope"]))
    if kind == "dynamic" and rotary_dim <= 2:
        kind = "linear"
    factor = st.floats(0.01, 1000.0, **finite)
    orig = st.integers(1, 1_000_000)
    opt = lambda s: st.none() | s
    if kind == "default":
        scaling = RopeScaling()
    elif kind in ("linear", "dynamic"):
        scaling = RopeScaling(kind, factor=draw(factor))
    elif kind == "yarn":
        scaling = RopeScaling(
            kind,
            factor=draw(factor),
            original_max_position_embeddings=draw(orig),
            beta_fast=draw(opt(factor)),
            beta_slow=draw(opt(factor)),
            mscale=draw(opt(factor)),
            mscale_all_dim=draw(opt(factor)),
            truncate=draw(opt(st.booleans())),
        )
    elif kind == "llama3":
        low = draw(factor)
        high = draw(factor.filter(lambda x: x != low))
        scaling = RopeScaling(
            kind,
            factor=draw(factor),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=draw(orig),
        )
    else:
        lists = st.lists(factor, min_size=half, max_size=half).map(tuple)
        scaling = RopeScaling(
            kind,
            short_factor=draw(lists),
            long_factor=draw(lists),
            original_max_position_embeddings=draw(orig),
            factor=draw(opt(factor)),
        )
    return RopeSpec(
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        theta=draw(st.floats(1.0001, 1e9, **finite)),
        layout=draw(st.sampled_from(["neox", "gptj"])),
        scaling=scaling,
        attention_factor=draw(st.floats(1e-3, 10.0, **finite)),
        max_position_embeddings=draw(st.integers(1, 10**7)),
    )


@st.composite
def contracts(draw):
    rope = draw(rope_specs())
    num_layers = draw(st.integers(1, 6))
    key_form = draw(st.sampled_from(["raw", "rotated"]))
    window = draw(st.none() | st.integers(1, 10_000))
    layers = () if window is None else tuple(sorted(draw(st.sets(st.integers(0, num_layers - 1), min_size=1))))
    return CacheContract(
        key_form=key_form,
        rotation_index=draw(st.sampled_from(["logical", "cache"])) if key_form == "raw" else "logical",
        rope=rope,
        window=window,
        window_layers=layers,
        sink_tokens=0 if window is None else draw(st.integers(0, 8)),
        block_size=draw(st.integers(1, 256)),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16", "float64"])),
        num_layers=num_layers,
        num_kv_heads=draw(st.integers(1, 16)),
        head_dim=rope.head_dim,
        weights_fingerprint=draw(st.text(max_size=20)),
    )


@settings(max_examples=200, deadline=None)
@given(contracts())
def test_json_round_trip_is_exact(c):
    s = c.to_json()
    back = CacheContract.from_json(s)
    assert back == c
    assert back.to_json() == s
    assert back.fingerprint() == c.fingerprint()
    assert back.diff(c) == []


def _v1(**changes):
    """A version-1 document (which wrote kernel_rotates) with ``changes``."""
    d = json.loads(make().to_json())
    d.update(version=1, **changes)
    return json.dumps(d)


def _mutated(**changes):
    d = json.loads(make().to_json())
    for k, v in changes.items():
        if v is _DELETE:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d)


_DELETE = object()
_GOOD_ROPE = ROPE.to_dict()


@pytest.mark.parametrize(
    "text, match",
    [
        ("not json", "does not parse"),
        ("", "does not parse"),
        ("[1, 2]", "must be an object"),
        ("null", "must be an object"),
        ('{"version": 1}', "format"),
        (_mutated(format="ropekv.payload"), "format"),
        (_mutated(version=6), "version 6"),
        (_mutated(version=3), "version 3 is not supported"),
        (_mutated(chunk_size=8, chunk_layers=[1]), "both sliding"),
        (_mutated(config_fingerprint=_DELETE), r"missing field\(s\) \['config_fingerprint'\]"),
        (_mutated(version=True), "version True"),
        (_mutated(version="1"), "version"),
        (_mutated(block_size=_DELETE), r"missing field\(s\) \['block_size'\]"),
        (_mutated(colour="blue"), r"unexpected field\(s\) \['colour'\]"),
        (_mutated(window_layers="1"), "window_layers must be a list"),
        (_mutated(window_layers=[[1]]), "window_layers"),
        (_mutated(rope="neox"), "rope must be an object"),
        (_mutated(rope={**_GOOD_ROPE, "scaling": "default"}), "rope must be an object"),
        (_mutated(rope={**_GOOD_ROPE, "head_dim": "8"}), "rope.head_dim must be an integer"),
        (_mutated(rope={**_GOOD_ROPE, "theta": "big"}), "wrong type"),
        (_mutated(rope={**_GOOD_ROPE, "colour": 1}), "RoPE spec must have exactly the fields"),
        (_mutated(rope={**_GOOD_ROPE, "scaling": {"rope_type": "ntk"}}), "unknown RoPE scaling type"),
        (_mutated(rope={**_GOOD_ROPE, "scaling": {"rope_type": "linear", "factor": "2"}}), "wrong type"),
        (
            _mutated(
                rope={
                    **_GOOD_ROPE,
                    "scaling": {
                        "rope_type": "longrope",
                        "short_factor": 3,
                        "long_factor": [1.0] * 4,
                        "original_max_position_embeddings": 8,
                    },
                }
            ),
            "wrong type",
        ),
        (_mutated(block_size="16"), "block_size"),
        (_mutated(kernel_rotates=False), r"unexpected field\(s\) \['kernel_rotates'\]"),  # derived in version 2
        (_v1(kernel_rotates=True), "version 1 is not supported"),
        (_mutated(dtype=None), "dtype"),
        (_mutated(window=2.5), "window"),
    ],
)
def test_malformed_json_raises_config_error(text, match):
    with pytest.raises(ConfigError, match=match):
        CacheContract.from_json(text)
