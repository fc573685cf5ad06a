"""window_mismatch: the kernel read keys the window hides, or missed keys it shows.

A sliding layer sees key ``j`` from query ``i`` iff ``i - W < j <= i`` (plus the sinks). A cache that
ignores its window, keeps sinks where none are configured, rolls its ring a step early, or a mask off
by one reads other keys than the reference: no rotation is wrong, the set of keys is. Also a full
layer read through a window (the global layers sliding too). The evidence counts the keys read that
the window hides and those it shows that were not read.
"""

from __future__ import annotations

import torch

from ..contract import CacheContract
from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.cells import Cells, share, span_text
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.keymap.record import KeyMap

KIND = BugClass.WINDOW_MISMATCH


def window_shaped(km: KeyMap) -> bool:
    """On a layer with no window of its own: whether the kernel read a window anyway (the newest keys
    and perhaps a few first ones, missing every key between them, none the reference hides)."""
    if bool((~km.visible).any()) or km.missed.numel() == 0:
        return False
    pos = km.keys.positions
    lo, hi = int(km.missed.min()), int(km.missed.max())
    inside = (pos > lo) & (pos < hi)
    return not bool(inside.any()) and bool((pos > hi).any())


def mask_evidence(km: KeyMap, hides: str) -> tuple[str, int]:
    extra = km.keys.positions[~km.visible].tolist()
    missed = km.missed.tolist()
    parts = []
    if extra:
        parts.append(f"it read {len(extra)} key(s) {hides} (positions {span_text(extra)})")
    if missed:
        parts.append(f"it missed {len(missed)} visible key(s) (positions {span_text(missed)})")
    visible = int(km.visible.sum()) + len(missed)
    head = f"layer {km.layer}, query at {km.query_position}: the reference attends to {visible} keys, the kernel to {km.keys.num}"
    return head + "; " + "; ".join(parts), len(extra) + len(missed)


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    if km is None or f.chunk_size is not None:
        return None
    if not bool((~km.visible).any()) and km.missed.numel() == 0:
        return None
    if f.window is None and not window_shaped(km):
        return None
    text, n = mask_evidence(km, "the window hides")
    if f.window is None:
        text += f"; layer {km.layer} has no window of its own: it was read through one"
    cells = Cells(torch.zeros_like(km.keys.fit, dtype=torch.bool), torch.zeros(km.query.heads, dtype=torch.bool), n)
    details = {"extra_keys": int((~km.visible).sum()), "missed_keys": int(km.missed.numel()), "keys_read": km.keys.num}
    return Match(KIND, share(km, cells), text, "all", details)


def shows(case: Case) -> bool:
    return case.window_wrapped


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


def _has_window_and_full(cfg) -> bool:
    kinds = {a.kind for a in cfg.layer_attentions}
    return "sliding" in kinds and "full" in kinds


def _window_every_layer(contract: CacheContract) -> CacheContract:
    """The global layers slide too: every layer reads only the last ``window`` keys."""
    return contract.replace(window_layers=tuple(range(contract.num_layers)))


def _forget_windows(contract: CacheContract) -> CacheContract:
    """The sliding layers read as full ones: every cached key reaches the kernel (a window ignored)."""
    return contract.replace(window=None, window_layers=(), sink_tokens=0)


FAULTS = (
    NativeFault(
        name="window-on-global-layers",
        kind=KIND,
        description="the global (full-attention) layers slide over the window too",
        key_form="rotated",
        shows_when="a context longer than the window",
        rotation=RotationPolicy,
        needs="sliding and full layers (gemma3)",
        applies=_has_window_and_full,
        contract_change=_window_every_layer,
    ),
    NativeFault(
        name="sliding-layers-unwindowed",
        kind=KIND,
        description="the sliding layers read every cached key (their window ignored)",
        key_form="rotated",
        shows_when="a context longer than the window",
        rotation=RotationPolicy,
        needs="sliding layers of the model's own (gemma3, mistral)",
        applies=lambda cfg: any(a.kind == "sliding" for a in cfg.layer_attentions),
        contract_change=_forget_windows,
    ),
)
