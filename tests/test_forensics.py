"""ropekv.parity.forensics on synthetic decode rows: each bug class is built by rotating random raw
queries and keys (float64, seeded) to the wrong positions or under the wrong spec, and diagnose() must
name it. Specs cover both layouts, theta 1e4 and 1e5, and partial rotary (32 of 64 channels)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from ropekv.errors import UsageError
from ropekv.parity.bug_class import BugClass
from ropekv.parity.diagnosis import Diagnosis
from ropekv.parity.forensics import ForensicInput, diagnose, effective_positions
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


def make_case(
    spec: RopeSpec,
    t: int,
    key_at: Positions = lambda j: j,
    query_at: int | None = None,
    *,
    positions: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    bf16: bool = False,
    seed: int = 0,
    **kwargs,
) -> ForensicInput:
    """Keys at logical ``positions`` (default 0..t) rotated to ``key_at(positions)``, the query to ``query_at``."""
    positions = torch.arange(t + 1) if positions is None else positions
    q, k = _raw(spec, positions.numel(), seed)
    k_eff = spec.rotate(k, key_at(positions))
    q_eff = spec.rotate(q[None], torch.tensor([t if query_at is None else query_at]))[0]
    if bf16:  # the engine's tensors in bfloat16: ~2^-9 relative noise on every channel
        k_eff, q_eff = k_eff.to(torch.bfloat16).double(), q_eff.to(torch.bfloat16).double()
    slots = positions.clone() if slots is None else slots
    return ForensicInput(spec, q, q_eff, k, k_eff, t, positions, slots, **kwargs)


def check(inp: ForensicInput, kind: str) -> Diagnosis:
    d = diagnose(inp)
    assert d.kind == kind, d.evidence
    assert d.kind in BugClass
    assert len(d.key_effective) == inp.key_positions.numel()
    assert 0.0 <= d.fit <= 1.0
    json.dumps(d.details)
    return d


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
    d = check(make_case(SPECS[name], 40, lambda j: 2 * j, bf16=bf16), "double_rotation")
    assert d.key_effective[37] == 74 and d.query_effective == 40
    assert "logical 40, slot 40, effective 80" in d.evidence


@pytest.mark.parametrize("name", sorted(SPECS))
def test_missing_rotation(name: str) -> None:
    d = check(make_case(SPECS[name], 40, lambda j: 0 * j), "missing_rotation")
    assert set(d.key_effective) == {0}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("bf16", [False, True])
def test_slot_as_position_after_the_window_wrapped(name: str, bf16: bool) -> None:
    W, t = 7, 40
    positions = torch.arange(t - W + 1, t + 1)  # the W visible keys
    slots = positions % W  # ring slots
    d = check(
        make_case(SPECS[name], t, lambda j: j % W, positions=positions, slots=slots, bf16=bf16), "slot_as_position"
    )
    assert d.key_effective == tuple((positions % W).tolist())
    assert "slot 5, effective 5" in d.evidence


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("query_too", [False, True])
def test_ignored_prefix_offset(name: str, query_too: bool) -> None:
    P, t = 13, 40
    inp = make_case(SPECS[name], t, lambda j: torch.where(j >= P, j - P, j), t - P if query_too else t, fork_offset=P)
    d = check(inp, "ignored_prefix_offset")
    assert d.key_effective[P - 1] == P - 1 and d.key_effective[30] == 30 - P


@pytest.mark.parametrize("name", sorted(SPECS))
def test_block_local_position(name: str) -> None:
    d = check(make_case(SPECS[name], 40, lambda j: j % 7, block_size=7), "block_local_position")
    assert d.key_effective[40] == 5


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("offset", [1, -1])
def test_query_position_offset(name: str, offset: int) -> None:
    d = check(make_case(SPECS[name], 40, query_at=40 + offset), "query_position_offset")
    assert d.query_effective == 40 + offset
    assert d.details["query_offset"] == offset


@pytest.mark.parametrize("name", sorted(SPECS))
def test_key_position_offset(name: str) -> None:
    d = check(make_case(SPECS[name], 40, lambda j: j + 3), "key_position_offset")
    assert d.details["offset"] == 3
    newest = check(make_case(SPECS[name], 40, lambda j: torch.where(j == 40, j - 1, j)), "key_position_offset")
    assert newest.details["offset"] == -1 and newest.key_effective[40] == 39


def test_global_shift_changes_no_logit() -> None:
    d = check(make_case(SPECS["neox-1e4"], 40, lambda j: j + 5, 45), "unknown")
    assert "global shift" in d.evidence


@pytest.mark.parametrize("name", sorted(SPECS))
def test_rotate_on_transfer(name: str) -> None:
    d = check(make_case(SPECS[name], 40, lambda j: torch.where(j < 20, 2 * j, j), handoff_len=20), "rotate_on_transfer")
    assert d.key_effective[19] == 38 and d.key_effective[20] == 20


@pytest.mark.parametrize("name", sorted(SPECS))
def test_frequency_mismatch_at_decode(name: str) -> None:
    spec, t, prompt = SPECS[name], 120, 110
    inp = make_case(spec, t)
    wrong = spec.replace(theta=spec.theta * 1.5)  # query and the keys written at decode
    k_eff = inp.k_eff.clone()
    k_eff[prompt:] = wrong.rotate(inp.k_raw[prompt:], torch.arange(prompt, t + 1))
    q_eff = wrong.rotate(inp.q_raw[None], torch.tensor([t]))[0]
    d = check(
        ForensicInput(spec, inp.q_raw, q_eff, inp.k_raw, k_eff, t, inp.key_positions, inp.key_slots),
        "frequency_mismatch",
    )
    assert d.details["theta_estimate"] == pytest.approx(spec.theta * 1.5, rel=2e-3)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_layout_mismatch(name: str) -> None:
    spec, t = SPECS[name], 40
    other = spec.replace(layout="gptj" if spec.layout == "neox" else "neox")
    inp = make_case(spec, t)
    d = check(
        ForensicInput(
            spec,
            inp.q_raw,
            other.rotate(inp.q_raw[None], torch.tensor([t]))[0],
            inp.k_raw,
            other.rotate(inp.k_raw, inp.key_positions),
            t,
            inp.key_positions,
            inp.key_slots,
        ),
        "layout_mismatch",
    )
    assert d.details["effective_layout"] == other.layout and d.key_effective[33] == 33


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
    # bf16 at ~1100 breaks integer fits (caught by the bf16 angle model); fp16 at 300 keeps the right
    # integers and is caught by the residual phase growing with position.
    spec = SPECS[name]
    inp = make_case(spec, t)
    q_eff = _low_precision(spec, inp.q_raw[None], torch.tensor([t]), dtype)[0]
    k_eff = _low_precision(spec, inp.k_raw, inp.key_positions, dtype)
    check(
        ForensicInput(
            spec, inp.q_raw, q_eff, inp.k_raw, k_eff, t, inp.key_positions, inp.key_slots, self_parity_passed=True
        ),
        "low_precision_angles",
    )


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_stale_dynamic_scaling(layout: str) -> None:
    spec = RopeSpec(64, 64, 10000.0, layout, scaling=RopeScaling("dynamic", factor=2.0), max_position_embeddings=64)
    t, prompt = 89, 70
    inp = make_case(spec, t)
    # HF-style: prompt keys keep inv_freq(70); each decode key the frequencies of its own step.
    k_eff = torch.cat(
        [spec.rotate(inp.k_raw[:prompt], torch.arange(prompt), seq_len=prompt)]
        + [spec.rotate(inp.k_raw[j : j + 1], torch.tensor([j]), seq_len=j + 1) for j in range(prompt, t + 1)]
    )
    q_eff = spec.rotate(inp.q_raw[None], torch.tensor([t]), seq_len=t + 1)[0]
    d = check(
        ForensicInput(spec, inp.q_raw, q_eff, inp.k_raw, k_eff, t, inp.key_positions, inp.key_slots),
        "stale_dynamic_scaling",
    )
    assert d.details["key_seq_len"] == prompt and d.details["first_position"] == 64
    assert "length 70" in d.evidence


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("bf16", [False, True])
def test_clean_row_is_unknown_with_a_perfect_fit(name: str, bf16: bool) -> None:
    inp = make_case(SPECS[name], 40, bf16=bf16)
    d = check(inp, "unknown")
    assert d.fit > 0.999 and d.query_effective == 40
    assert d.key_effective == tuple(range(41))
    assert "logical positions" in d.evidence


def test_garbage_is_unknown() -> None:
    inp = make_case(SPECS["neox-1e4"], 40)
    g = torch.Generator().manual_seed(12345)  # not a seed make_case uses: the noise must not equal the raw data
    noise = ForensicInput(
        inp.rope,
        inp.q_raw,
        torch.randn(inp.q_raw.shape, generator=g, dtype=torch.float64),
        inp.k_raw,
        torch.randn(inp.k_raw.shape, generator=g, dtype=torch.float64),
        40,
        inp.key_positions,
        inp.key_slots,
    )
    d = check(noise, "unknown")
    assert d.fit < 0.5


# ---------------------------------------------------------------------- scale, subsampling, validation


@pytest.mark.parametrize("n", [1100, 8192])
def test_long_contexts_are_subsampled(n: int) -> None:
    spec = RopeSpec(64, 64, 500000.0)
    d = check(make_case(spec, n - 1, lambda j: 2 * j), "double_rotation")
    assert d.details["examined_keys"] <= 256
    assert d.key_effective[n // 3] == 2 * (n // 3)  # keys outside the sample come from the hypotheses


def test_bad_shapes_are_refused() -> None:
    inp = make_case(SPECS["neox-1e4"], 10)
    with pytest.raises(UsageError):
        ForensicInput(
            inp.rope, inp.q_raw, inp.q_eff[:, :32], inp.k_raw, inp.k_eff, 10, inp.key_positions, inp.key_slots
        )
    with pytest.raises(UsageError):
        ForensicInput(inp.rope, inp.q_raw, inp.q_eff, inp.k_raw, inp.k_eff, 10, inp.key_positions[:-1], inp.key_slots)


# ---------------------------------------------------------------------- tiny heads, rings, block boundaries

SMALL = {  # the head of the tiny test models (head_dim 16: 8 channel pairs)
    "neox-16": RopeSpec(head_dim=16, rotary_dim=16, theta=10000.0, layout="neox"),
    "gptj-16": RopeSpec(head_dim=16, rotary_dim=16, theta=10000.0, layout="gptj"),
}


@pytest.mark.parametrize("name", sorted(SMALL) + ["neox-1e4"])
@pytest.mark.parametrize("t", [300, 513])
def test_bf16_angles_past_256_round_the_positions_themselves(name: str, t: int) -> None:
    # bf16 holds integers exactly only up to 256: 513 turns as 512, 259 as 260; the integer search finds
    # those rounded positions, offsets of -1..+1 no position bug explains.
    spec = {**SPECS, **SMALL}[name]
    inp = make_case(spec, t)
    q_eff = _low_precision(spec, inp.q_raw[None], torch.tensor([t]), torch.bfloat16)[0]
    k_eff = _low_precision(spec, inp.k_raw, inp.key_positions, torch.bfloat16)
    d = check(
        ForensicInput(
            spec, inp.q_raw, q_eff, inp.k_raw, k_eff, t, inp.key_positions, inp.key_slots, self_parity_passed=True
        ),
        "low_precision_angles",
    )
    assert "bfloat16" in d.evidence
    if t == 513:
        assert d.query_effective == 512 and "513 -> 512" in d.evidence
        assert d.key_effective[259] == 260 and d.key_effective[258] == 258


@pytest.mark.parametrize("name", sorted(SMALL))
def test_a_clean_row_at_a_block_boundary_is_not_block_local(name: str) -> None:
    # t = B: every key below the boundary sits at j = j mod B whatever the bug; the key at B decides.
    d = check(make_case(SMALL[name], 16, block_size=16), "unknown")
    assert "logical positions" in d.evidence
    bug = check(make_case(SMALL[name], 16, lambda j: j % 16, block_size=16), "block_local_position")
    assert bug.key_effective[16] == 0


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
    inp = make_case(spec, t, lambda j: torch.where(j == t, window, j), window, positions=positions, slots=slots)
    d = check(inp, "query_position_offset")
    assert d.query_effective == window and d.key_effective[-1] == window
    assert not d.evidence.startswith("keys are right")  # the new key is off too
    assert f"the query sits at t {window - t:+d} (effective {window}) and so does the key its step wrote" in d.evidence
    assert f"the {window - 1} older keys are right" in d.evidence
    assert f"logical {t}, slot {int(slots[-1])}, effective {window}" in d.evidence
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

    d = check(make_case(SMALL[name], t, at, cap, positions=positions, slots=slots), "query_position_offset")
    assert d.query_effective == cap and d.key_effective[-1] == cap and d.key_effective[:2] == (0, 1)
    assert "the query sits at t -25 (effective 15) and the 13 newest keys are off too, at j -12, -21, -25" in d.evidence
    assert "the 2 older keys are right" in d.evidence and "= the 15 keys the kernel read" in d.evidence
    assert "query logical 40, effective 15" in d.evidence


def test_a_query_off_with_keys_ahead_of_it_is_not_a_step_offset() -> None:
    # Keys off by a growing amount (a later step turning further ahead) are no stuck or constant offset.
    spec = SMALL["neox-16"]
    d = check(make_case(spec, 30, lambda j: torch.where(j > 25, j + (j - 25), j), 35), "unknown")
    assert "no single pattern" in d.evidence
