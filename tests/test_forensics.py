"""The forensics on synthetic decode rows: each bug class is built by rotating random raw queries and
keys (float64, seeded) to the wrong positions or under the wrong spec, and ``ropekv.diagnose_row``
(every registered bug class reading the row's key map) must name it. Specs cover both layouts, theta
1e4 and 1e5, and partial rotary (32 of 64 channels); the expected positions are computed here from the
bug's definition, never by the code under test."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from ropekv import diagnose_row
from ropekv.errors import UsageError
from ropekv.parity.bug_class import BugClass
from ropekv.parity.cases import Case
from ropekv.parity.diagnosis import Diagnosis
from ropekv.parity.keymap.spectral import effective_positions
from ropekv.rope import RopeScaling, RopeSpec, apply_rotation

H, KVH = 4, 2
SPECS = {
    "neox-1e4": RopeSpec(head_dim=64, rotary_dim=64, theta=10000.0, layout="neox"),
    "gptj-1e5": RopeSpec(head_dim=64, rotary_dim=64, theta=100000.0, layout="gptj"),
    "partial-neox-1e5": RopeSpec(head_dim=64, rotary_dim=32, theta=100000.0, layout="neox"),
    "partial-gptj-1e4": RopeSpec(head_dim=64, rotary_dim=32, theta=10000.0, layout="gptj"),
}
Positions = Callable[[torch.Tensor], torch.Tensor]


def _raw(spec: RopeSpec, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, spec.head_dim, generator=g, dtype=torch.float64)  # [H, D]
    k = torch.randn(n, KVH, spec.head_dim, generator=g, dtype=torch.float64)  # [N, KVH, D]
    return q, k


def row(
    spec: RopeSpec,
    t: int,
    key_at: Positions = lambda j: j,
    query_at: int | None = None,
    *,
    positions: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    bf16: bool = False,
    seed: int = 0,
) -> dict:
    """Keys at logical ``positions`` (default 0..t) rotated to ``key_at(positions)``, the query to ``query_at``."""
    positions = torch.arange(t + 1) if positions is None else positions
    q, k = _raw(spec, positions.numel(), seed)
    k_eff = spec.rotate(k, key_at(positions))
    q_eff = spec.rotate(q[None], torch.tensor([t if query_at is None else query_at]))[0]
    if bf16:  # the engine's tensors in bfloat16: ~2^-9 relative noise on every channel
        k_eff, q_eff = k_eff.to(torch.bfloat16).double(), q_eff.to(torch.bfloat16).double()
    slots = positions.clone() if slots is None else slots
    return dict(
        rope=spec,
        q_raw=q,
        q_eff=q_eff,
        k_raw=k,
        k_eff=k_eff,
        query_position=t,
        key_positions=positions,
        key_slots=slots,
        dtype="bfloat16" if bf16 else "float32",
    )


def check(inp: dict, kind: str, **kw) -> Diagnosis:
    d = diagnose_row(**{**inp, **kw})
    assert d.kind == kind, d.evidence
    assert d.kind in BugClass
    json.dumps(d.details)
    return d


def keys(d: Diagnosis) -> list[int | None]:
    assert d.keymap is not None
    return d.keymap.keys.agreed()


def query(d: Diagnosis) -> int | None:
    assert d.keymap is not None
    return d.keymap.query.agreed()[0]


# ---------------------------------------------------------------------- effective_positions


@pytest.mark.parametrize("name", sorted(SPECS))
def test_effective_positions_recovers_random_integers(name: str) -> None:
    spec = SPECS[name]
    g = torch.Generator().manual_seed(7)
    truth = torch.randint(-300, 2000, (50,), generator=g)
    _, k = _raw(spec, 50, 1)
    eff = spec.replace(attention_factor=1.3).rotate(k, truth)  # the attention factor cancels
    pos, fit = effective_positions(k, eff, spec.inv_freq(), spec.layout, spec.rotary_dim, torch.arange(-400, 2100))
    assert torch.equal(pos, truth)
    assert torch.allclose(fit, torch.ones(50, dtype=torch.float64), atol=1e-9)


# ---------------------------------------------------------------------- bug classes


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("bf16", [False, True])
def test_double_rotation(name: str, bf16: bool) -> None:
    d = check(row(SPECS[name], 40, lambda j: 2 * j, bf16=bf16), "double_rotation")
    assert keys(d)[37] == 74 and query(d) == 40
    assert "keys 1..40 sit at 2j" in d.evidence


@pytest.mark.parametrize("name", sorted(SPECS))
def test_missing_rotation(name: str) -> None:
    d = check(row(SPECS[name], 40, lambda j: 0 * j), "missing_rotation")
    assert set(keys(d)) == {0}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("bf16", [False, True])
def test_slot_as_position_after_the_window_wrapped(name: str, bf16: bool) -> None:
    W, t = 7, 40
    positions = torch.arange(t - W + 1, t + 1)  # the W visible keys
    slots = positions % W  # ring slots
    d = check(
        row(SPECS[name], t, lambda j: j % W, positions=positions, slots=slots, bf16=bf16),
        "slot_as_position",
        case=Case(length=t, window=W),
    )
    assert keys(d) == (positions % W).tolist()


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("query_too", [False, True])
def test_ignored_prefix_offset(name: str, query_too: bool) -> None:
    P, t = 13, 40
    inp = row(SPECS[name], t, lambda j: torch.where(j >= P, j - P, j), t - P if query_too else t)
    d = check(inp, "ignored_prefix_offset", case=Case(length=t - P, prefix=P))
    assert keys(d)[P - 1] == P - 1 and keys(d)[30] == 30 - P
    assert ("the query sits at t - 13" in d.evidence) == query_too


@pytest.mark.parametrize("name", sorted(SPECS))
def test_block_local_position(name: str) -> None:
    d = check(row(SPECS[name], 40, lambda j: j % 7), "block_local_position", case=Case(length=40, block_size=7))
    assert keys(d)[40] == 5 and "j mod 7" in d.evidence


@pytest.mark.parametrize("name", sorted(SPECS))
def test_block_start_position(name: str) -> None:
    # the prompt's last partial block rotated at the block's first position (keys 35..39 at 35)
    d = check(
        row(SPECS[name], 40, lambda j: torch.where((j >= 35) & (j < 40), 35, j)),
        "block_local_position",
        case=Case(length=40, block_size=7),
    )
    assert keys(d)[37] == 35 and "block's first position" in d.evidence and "keys 36..39" in d.evidence


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("offset", [1, -1, 5])
def test_query_position_offset(name: str, offset: int) -> None:
    d = check(row(SPECS[name], 40, query_at=40 + offset), "query_position_offset")
    assert query(d) == 40 + offset and d.details["offset"] == offset


@pytest.mark.parametrize("name", sorted(SPECS))
def test_key_position_offset(name: str) -> None:
    d = check(row(SPECS[name], 40, lambda j: j + 3), "key_position_offset")
    assert d.details["offset"] == 3
    newest = check(row(SPECS[name], 40, lambda j: torch.where(j == 40, j - 1, j)), "key_position_offset")
    assert newest.details["offset"] == -1 and keys(newest)[40] == 39


def test_global_shift_changes_no_logit() -> None:
    d = diagnose_row(**row(SPECS["neox-1e4"], 40, lambda j: j + 5, 45))
    assert d.kind != "double_rotation" and d.keymap is not None
    assert keys(d)[10] == 15 and query(d) == 45


@pytest.mark.parametrize("name", sorted(SPECS))
def test_rotate_on_transfer(name: str) -> None:
    d = check(row(SPECS[name], 40, lambda j: torch.where(j < 20, 2 * j, j)), "rotate_on_transfer", handoff_len=20)
    assert keys(d)[19] == 38 and keys(d)[20] == 20


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("factor", [1.5, 1 / 50])
def test_frequency_mismatch_at_decode_estimates_theta_within_a_percent(name: str, factor: float) -> None:
    spec, t, prompt = SPECS[name], 120, 110
    inp = row(spec, t)
    wrong = spec.replace(theta=spec.theta * factor)  # the query and the keys written at decode
    k_eff = inp["k_eff"].clone()
    k_eff[prompt:] = wrong.rotate(inp["k_raw"][prompt:], torch.arange(prompt, t + 1))
    q_eff = wrong.rotate(inp["q_raw"][None], torch.tensor([t]))[0]
    d = check({**inp, "k_eff": k_eff, "q_eff": q_eff}, "frequency_mismatch")
    assert d.details["theta_estimate"] == pytest.approx(spec.theta * factor, rel=1e-2)
    assert "keys 110..120" in d.evidence


@pytest.mark.parametrize("name", sorted(SPECS))
def test_layout_mismatch(name: str) -> None:
    spec, t = SPECS[name], 40
    other = spec.replace(layout="gptj" if spec.layout == "neox" else "neox")
    inp = row(spec, t)
    q_eff = other.rotate(inp["q_raw"][None], torch.tensor([t]))[0]
    k_eff = other.rotate(inp["k_raw"], inp["key_positions"])
    d = check({**inp, "q_eff": q_eff, "k_eff": k_eff}, "layout_mismatch")
    assert d.details["effective_layout"] == other.layout


def test_layout_mismatch_of_the_rows_one_chunk_wrote() -> None:
    # keys written during chunked prefill (chunk 2: positions 17..33) paired the other way, decode right
    spec, t = SPECS["neox-1e4"], 40
    inp = row(spec, t)
    other = spec.replace(layout="gptj")
    k_eff = inp["k_eff"].clone()
    k_eff[17:34] = other.rotate(inp["k_raw"][17:34], torch.arange(17, 34))
    d = check({**inp, "k_eff": k_eff}, "layout_mismatch", case=Case(length=40, chunk=17))
    assert "keys 17..33 (written by prefill chunk 2)" in d.evidence


def _low_precision(spec: RopeSpec, x: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rotation with the angle table computed in ``dtype`` (the bug), applied as usual."""
    ang = positions.to(dtype)[:, None] * spec.inv_freq().to(dtype)[None, :]
    return apply_rotation(x, torch.cos(ang), torch.sin(ang), spec.layout)


@pytest.mark.parametrize(
    "name, t, dtype",
    [(name, 300, torch.float16) for name in sorted(SPECS)]
    + [("neox-1e4", 1100, torch.bfloat16), ("partial-gptj-1e4", 1100, torch.bfloat16)],
)
def test_low_precision_angles(name: str, t: int, dtype: torch.dtype) -> None:
    spec = SPECS[name]
    inp = row(spec, t)
    q_eff = _low_precision(spec, inp["q_raw"][None], torch.tensor([t]), dtype)[0]
    k_eff = _low_precision(spec, inp["k_raw"], inp["key_positions"], dtype)
    d = check({**inp, "q_eff": q_eff, "k_eff": k_eff}, "low_precision_angles", self_parity_passed=True)
    assert str(dtype).replace("torch.", "") in d.evidence


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_stale_dynamic_scaling(layout: str) -> None:
    spec = RopeSpec(64, 64, 10000.0, layout, scaling=RopeScaling("dynamic", factor=2.0), max_position_embeddings=64)
    t, prompt = 89, 70
    inp = row(spec, t)
    # HF-style: prompt keys keep inv_freq(70); each decode key the frequencies of its own step.
    k_raw = inp["k_raw"]
    k_eff = torch.cat(
        [spec.rotate(k_raw[:prompt], torch.arange(prompt), seq_len=prompt)]
        + [spec.rotate(k_raw[j : j + 1], torch.tensor([j]), seq_len=j + 1) for j in range(prompt, t + 1)]
    )
    q_eff = spec.rotate(inp["q_raw"][None], torch.tensor([t]), seq_len=t + 1)[0]
    d = check({**inp, "k_eff": k_eff, "q_eff": q_eff}, "stale_dynamic_scaling")
    assert "length 70" in d.evidence and "passes 64 tokens" in d.evidence


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("bf16", [False, True])
def test_clean_row_is_unknown_and_says_everything_fits(name: str, bf16: bool) -> None:
    d = check(row(SPECS[name], 40, bf16=bf16), "unknown")
    assert query(d) == 40 and keys(d) == list(range(41))
    assert "sit exactly where the contract puts them" in d.evidence


def test_garbage_is_unknown_and_says_no_row_fits() -> None:
    inp = row(SPECS["neox-1e4"], 40)
    g = torch.Generator().manual_seed(12345)  # not a seed row() uses: the noise must not equal the raw data
    noise = {
        **inp,
        "q_eff": torch.randn(inp["q_raw"].shape, generator=g, dtype=torch.float64),
        "k_eff": torch.randn(inp["k_raw"].shape, generator=g, dtype=torch.float64),
    }
    d = check(noise, "unknown")
    assert "no rotation of any reference row" in d.evidence


# ---------------------------------------------------------------------- scale, validation


@pytest.mark.parametrize("n", [1100, 8192])
def test_long_contexts_fit_every_key(n: int) -> None:
    spec = RopeSpec(64, 64, 500000.0)
    d = check(row(spec, n - 1, lambda j: 2 * j), "double_rotation")
    eff = keys(d)
    assert eff == [2 * j for j in range(n)]  # every key, none subsampled


def test_bad_shapes_are_refused() -> None:
    inp = row(SPECS["neox-1e4"], 10)
    with pytest.raises(UsageError):
        diagnose_row(**{**inp, "q_eff": inp["q_eff"][:, :32]})
    with pytest.raises(UsageError):
        diagnose_row(**{**inp, "key_positions": inp["key_positions"][:-1]})


# ---------------------------------------------------------------------- tiny heads, rings, block boundaries

SMALL = {  # the head of the tiny test models (head_dim 16: 8 channel pairs)
    "neox-16": RopeSpec(head_dim=16, rotary_dim=16, theta=10000.0, layout="neox"),
    "gptj-16": RopeSpec(head_dim=16, rotary_dim=16, theta=10000.0, layout="gptj"),
}


@pytest.mark.parametrize("name", sorted(SMALL) + ["neox-1e4"])
@pytest.mark.parametrize("t", [300, 513])
def test_bf16_angles_past_256_round_the_positions_themselves(name: str, t: int) -> None:
    spec = {**SPECS, **SMALL}[name]
    inp = row(spec, t)
    q_eff = _low_precision(spec, inp["q_raw"][None], torch.tensor([t]), torch.bfloat16)[0]
    k_eff = _low_precision(spec, inp["k_raw"], inp["key_positions"], torch.bfloat16)
    d = check({**inp, "q_eff": q_eff, "k_eff": k_eff}, "low_precision_angles", self_parity_passed=True)
    assert "bfloat16" in d.evidence
    if t == 513:
        assert "513 -> 512" in d.evidence


@pytest.mark.parametrize("name", sorted(SMALL))
def test_a_clean_row_at_a_block_boundary_is_not_block_local(name: str) -> None:
    # t = B: every key below the boundary sits at j = j mod B whatever the bug; the key at B decides.
    case = Case(length=16, block_size=16)
    check(row(SMALL[name], 16), "unknown", case=case)
    bug = check(row(SMALL[name], 16, lambda j: j % 16), "block_local_position", case=case)
    assert keys(bug)[16] == 0


def _ring(t: int, window: int, sinks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[N]`` a wrapped ring of ``window`` slots after ``sinks`` kept ones holds at ``t``, and their slots."""
    positions = torch.cat((torch.arange(sinks), torch.arange(t - window + 1, t + 1)))
    slots = torch.cat((torch.arange(sinks), sinks + (positions[sinks:] - sinks) % window))
    return positions, slots


@pytest.mark.parametrize("name", sorted(SMALL) + ["gptj-1e5"])
@pytest.mark.parametrize("window,t", [(37, 48), (8, 30)])
def test_rotation_at_the_ring_fill_count_names_the_new_key_too(name: str, window: int, t: int) -> None:
    # The decode step turns its query and the key it writes at the ring's fill count (the rows it
    # keeps, min(t, W)) instead of t: the older keys are right, the new one sits where the query does.
    spec = {**SPECS, **SMALL}[name]
    positions, slots = _ring(t, window)
    inp = row(spec, t, lambda j: torch.where(j == t, window, j), window, positions=positions, slots=slots)
    d = check(inp, "query_position_offset")
    assert query(d) == window and keys(d)[-1] == window
    assert f"the query sits at t {window - t:+d} (effective {window}) and so does the key its step wrote" in d.evidence
    assert f"the {window - 1} older keys are right" in d.evidence
    assert f"= the {window} keys the kernel read" in d.evidence


@pytest.mark.parametrize("name", sorted(SMALL))
def test_fill_count_rotation_through_a_chunked_prefill_that_wrapped(name: str) -> None:
    # A ring of 2 sinks + 13, prefilled in chunks of 9: each step turns from min(start, 15), so the keys
    # of the chunks at 27 and 36 sit at j - 12 and j - 21, the decoded key and its query at 15.
    t, cap = 40, 15
    positions, slots = _ring(t, 13, sinks=2)
    start = torch.where(positions == t, t, positions // 9 * 9)

    def at(j: torch.Tensor) -> torch.Tensor:
        return j - start + torch.clamp(start, max=cap)

    d = check(row(SMALL[name], t, at, cap, positions=positions, slots=slots), "query_position_offset")
    assert query(d) == cap and keys(d)[-1] == cap and keys(d)[:2] == [0, 1]
    assert "the query sits at t -25 (effective 15) and the 13 newest keys are off too, at j -12, -21, -25" in d.evidence
    assert "the 2 older keys are right" in d.evidence and "= the 15 keys the kernel read" in d.evidence


def test_a_query_off_with_keys_ahead_of_it_is_described_not_named() -> None:
    # Keys off by a growing amount (a later step turning further ahead) are no stuck or constant offset.
    spec = SMALL["neox-16"]
    d = check(row(spec, 30, lambda j: torch.where(j > 25, j + (j - 25), j), 35), "unknown")
    assert "sit at j +" in d.evidence and "query heads at 35" in d.evidence
