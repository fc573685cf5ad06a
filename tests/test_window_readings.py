"""The three readings of window_mismatch on rows built by hand: a ring that rolled a step early (keys by
content, under the wrong labels, and a zero slot), a cache that lost every row but the newest on a
full layer, and a windowed layer's prefill masked one key wider than its decode (seen a layer up).
Each has controls of the same shape that are no window's: they must be named otherwise.

Every expected position comes from how the rows were built here, never from the diagnosis.
"""

from __future__ import annotations

import torch

from ropekv.attention_kind import LayerAttention
from ropekv.bugs.registry import EXPLANATIONS
from ropekv.parity.bug_class import BugClass
from ropekv.parity.cases import Case
from ropekv.parity.diagnosis import Diagnosis
from ropekv.parity.explain.combine import diagnose_cases
from ropekv.parity.explain.evidence import CaseEvidence
from ropekv.parity.explain.facts import CaseFacts, ModelFacts
from ropekv.parity.keymap.fit import FitInput, Geometry, fit_keymap
from ropekv.parity.keymap.record import NOISE
from ropekv.parity.report import Divergence
from ropekv.rope import RopeSpec

SPEC = RopeSpec(head_dim=16, rotary_dim=16, theta=10000.0, layout="neox")
FULL = LayerAttention("full")


def raw_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 16, generator=g, dtype=torch.float64)  # [T, KVH, D]


def turned(rows: torch.Tensor, positions: list[int]) -> torch.Tensor:
    return SPEC.rotate(rows, torch.tensor(positions))


def diagnose(
    *,
    table: torch.Tensor,
    k_eff: torch.Tensor,
    labels: list[int],
    t: int,
    case: Case,
    layer: int = 0,
    attentions: tuple[LayerAttention, ...] = (FULL,),
) -> Diagnosis:
    """One decode row at ``layer``: the query right at ``t``, the kernel's keys ``k_eff`` under ``labels``."""
    g = torch.Generator().manual_seed(99)
    q = torch.randn(4, 16, generator=g, dtype=torch.float64)
    q_eff = SPEC.rotate(q[None], torch.tensor([t]))[0]
    att = attentions[layer]
    window = case.window if case.window is not None else att.window
    visible = torch.zeros(t + 1, dtype=torch.bool)
    lo = 0 if window is None else max(0, t - window + 1)
    visible[lo : t + 1] = True
    visible[: case.sink_tokens] = True
    pos = torch.tensor(labels)
    km = fit_keymap(
        FitInput(
            layer=layer,
            rope=SPEC,
            others=(),
            seq_len=t + 1,
            query_position=t,
            q_raw=q,
            q_eff=q_eff,
            ref_keys=table,
            k_eff=k_eff,
            key_positions=pos,
            key_slots=pos.clone(),
            visible=visible,
            noise=NOISE["float32"],
            geometry=Geometry(block_size=case.block_size, window=window, sinks=case.sink_tokens),
        )
    )
    facts = CaseFacts(
        case=case,
        model=ModelFacts(layer_ropes=(SPEC,) * len(attentions), layer_attentions=attentions),
        divergence=Divergence("reference", 0, t, layer, 0, labels[0], labels[0], 0.0, 0.0, 1.0, 0.0, True),
        layer=layer,
        query_position=t,
        step=0,
        role="decode",
        window=window,
        chunk_size=None,
        handoff_len=0,
        key_form="rotated",
        engine_dtype="float32",
        kv_dtype=None,
        self_passed=False,
        input_matched=True,
        logit_errors=(1.0,),
        self_logit_errors=(1.0,),
        attn_error=1.0,
        tolerance_attn=2e-3,
        tolerance_logits=5e-3,
    )
    return diagnose_cases([CaseEvidence(facts, keymap=km)], EXPLANATIONS)


# ---------------------------------------------------------------------- a ring that rolled a step early

RING_CASE = Case(length=5, decode_steps=3, window=8)


def test_a_ring_rolled_a_step_early_is_a_window_bug_read_by_content():
    # Window 8, query at 7: the window shows 0..7. The ring rolled one step early: the slot labelled i
    # holds token i + 1's key (turned at i + 1, its own position), slot 6 was never written (zeros).
    table = raw_rows(8, seed=1)
    k_eff = torch.cat((turned(table[1:7], list(range(1, 7))), torch.zeros(1, 2, 16), turned(table[7:8], [7])))
    d = diagnose(table=table, k_eff=k_eff, labels=list(range(8)), t=7, case=RING_CASE)
    assert d.kind == BugClass.WINDOW_MISMATCH, d.evidence
    assert "by content the kernel read the keys of positions 1..7 (under the labels 0..7)" in d.evidence
    assert "1 zero key(s)" in d.evidence and "it missed 1 visible key(s) (positions 0)" in d.evidence


def test_a_ring_that_holds_one_row_twice_is_no_window_bug():
    # The same ring, but the never-written slot holds token 5's key again: a row read twice, which no
    # mask does.
    table = raw_rows(8, seed=1)
    k_eff = torch.cat(
        (turned(table[1:7], list(range(1, 7))), turned(table[5:6], [5]), turned(table[7:8], [7])),
    )
    d = diagnose(table=table, k_eff=k_eff, labels=list(range(8)), t=7, case=RING_CASE)
    assert d.kind != BugClass.WINDOW_MISMATCH, d.evidence


# ---------------------------------------------------------------------- a cache that lost its rows

LOST_CASE = Case(length=10, decode_steps=7)


def test_a_full_layer_that_reads_only_its_newest_key_lost_the_rest():
    # A full layer, query at 16: the reference shows 0..16. The cache was reset before the step, so the
    # kernel read one key, token 16's own (turned at 16), under the label 0. Tokens 15 and 16 are one
    # token id (greedy decoding repeats tokens), so their raw keys are alike: the key is row 16's.
    table = raw_rows(17, seed=2)
    table[15] = table[16]
    d = diagnose(table=table, k_eff=turned(table[16:17], [16]), labels=[0], t=16, case=LOST_CASE)
    assert d.kind == BugClass.WINDOW_MISMATCH, d.evidence
    assert "read the keys of positions 16 (under the labels 0)" in d.evidence
    assert "missed 16 visible key(s) (positions 0..15)" in d.evidence and "newest 1 key(s)" in d.evidence


def test_a_full_layer_that_lost_its_newest_rows_is_no_window_shape():
    # The kernel read rows 0..7 (each under its own label) and nothing after: the newest keys, its own
    # included, are what is missing. No window drops the query's own key.
    table = raw_rows(17, seed=2)
    d = diagnose(table=table, k_eff=turned(table[:8], list(range(8))), labels=list(range(8)), t=16, case=LOST_CASE)
    assert d.kind != BugClass.WINDOW_MISMATCH, d.evidence


# ---------------------------------------------------------------------- a prefill masked wider than its window

TWO_LAYERS = (LayerAttention("sliding", 8), FULL)
PREFILL_CASE = Case(length=12, decode_steps=1)


def _rows_changed_from(start: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Layer 1's keys: the prompt rows from ``start`` on hold other contents (their layer-0 output changed),
    # every other row right.
    table = raw_rows(13, seed=3)
    g = torch.Generator().manual_seed(4)
    other = table.clone()
    other[start:12] += 0.3 * torch.randn(12 - start, 2, 16, generator=g, dtype=torch.float64)
    return table, turned(other, list(range(13)))


def test_prompt_rows_changed_from_the_window_below_are_a_prefill_window_bug():
    # Layer 0 slides over 8 keys: its prefill query at 8 is the first whose window hides a key (0).
    table, k_eff = _rows_changed_from(8)
    d = diagnose(
        table=table, k_eff=k_eff, labels=list(range(13)), t=12, case=PREFILL_CASE, layer=1, attentions=TWO_LAYERS
    )
    assert d.kind == BugClass.WINDOW_MISMATCH, d.evidence
    assert "keys 8..11" in d.evidence and "exactly the prompt rows from position 8 on" in d.evidence
    assert "layer 0's window of 8" in d.evidence


def test_prompt_rows_changed_elsewhere_or_without_a_window_below_are_not():
    # The same rows changed from 5 (no window boundary), or from 8 over a full layer 0: a prefill bug
    # below, not a window's.
    table, k_eff = _rows_changed_from(5)
    d = diagnose(
        table=table, k_eff=k_eff, labels=list(range(13)), t=12, case=PREFILL_CASE, layer=1, attentions=TWO_LAYERS
    )
    assert d.kind == BugClass.PREFILL_ROWS_DIVERGED, d.evidence
    table, k_eff = _rows_changed_from(8)
    d = diagnose(
        table=table, k_eff=k_eff, labels=list(range(13)), t=12, case=PREFILL_CASE, layer=1, attentions=(FULL, FULL)
    )
    assert d.kind == BugClass.PREFILL_ROWS_DIVERGED, d.evidence
