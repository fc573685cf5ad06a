"""window_mismatch: the kernel read keys the window hides, or missed keys it shows.

A sliding layer sees key ``j`` from query ``i`` iff ``i - W < j <= i`` (plus the sinks). A cache that
ignores its window, keeps sinks where none are configured, rolls its ring a step early, or a mask off
by one reads other keys than the reference: no rotation is wrong, the set of keys is. Also a full
layer read through a window (the global layers sliding too). The evidence counts the keys read that
the window hides and those it shows that were not read.

Three readings, first to last: the keys by the positions the engine labelled them with; the keys by
their contents (a ring that rolled early holds token ``i + 1``'s key under the label ``i`` and a zero
slot; a cache that lost its rows holds only the newest); and, a layer up, the prompt rows a windowed
layer's prefill wrote from where its window first hides a key (a prefill mask off by one).
"""

from __future__ import annotations

import torch

from ..contract import CacheContract
from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.cells import Cells, share, span_text, which_keys
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.facts import CaseFacts
from ..parity.keymap.record import KeyMap

KIND = BugClass.WINDOW_MISMATCH
ZERO_KEY = 1e-6  # a key this short against its row's length is a slot never written (zeros)


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
    return by_labels(km, f) or by_content(km, f) or prefill_window(km, f)


def by_labels(km: KeyMap, f: CaseFacts) -> Match | None:
    """The keys as the engine labelled them: read where the window hides them, or missed where it shows them."""
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


def content_read(km: KeyMap, shift: int) -> tuple[list[int], int] | None:
    """By content: the positions of the rows whose keys the kernel read, and how many keys it read that
    are zero (a slot never written). None where a key is anything else: its heads on different rows,
    its row turned elsewhere than at that row's own position, or no row at all (a rotation or content
    bug, which other classes read, not a set of keys)."""
    k = km.keys
    zero = (k.scale.abs() <= ZERO_KEY).all(1)  # [N]
    src = k.source  # [N, K]
    pos = src[:, 0] + shift  # [N] the position of each key's row
    exact = (
        k.ok
        & (k.rotation == 0)
        & (k.source_head == torch.arange(k.heads))
        & (k.residual <= km.noise)
        & (src == src[:, :1])
        & (src >= 0)
        & (k.effective[..., 0] == pos[:, None])
    ).all(1)
    if not bool((exact | zero).all()):
        return None
    return pos[~zero].tolist(), int(zero.sum())


def by_content(km: KeyMap, f: CaseFacts) -> Match | None:
    """The keys by what they hold: a ring that rolled early reads token ``i + 1``'s key under the label
    ``i`` and a slot never written; a cache that lost its rows reads only the newest. Every key is a
    right key of some row (or zero), so no rotation is wrong: the set of rows is, and it is the set a
    window picks (the newest rows up to the query, after the sinks), only not this layer's."""
    if f.op is not None or f.role != "decode" or not bool(km.query_exact().all()):
        return None
    got = content_read(km, f.shift)
    if got is None:
        return None
    rows, zero = got
    read = set(rows)
    if len(read) != len(rows):
        return None  # a row read twice: no mask reads a key twice
    shown = set(km.keys.positions[km.visible].tolist()) | set(km.missed.tolist())
    extra, missed = sorted(read - shown), sorted(shown - read)
    if not extra and not missed and not zero:
        return None
    q = km.query_position
    sinks = {r for r in read if r < f.shift + f.sinks}
    newest = sorted(read - sinks)
    if not newest or newest != list(range(newest[0], q + 1)) or any(m > newest[0] for m in missed):
        return None  # not the newest rows up to the query: not a window's shape
    if f.window is None and (extra or not missed):
        return None
    labels = km.keys.positions.tolist()
    head = (
        f"layer {km.layer}, query at {q}: by content the kernel read the keys of positions {span_text(rows)}"
        + (f" (under the labels {span_text(labels)})" if sorted(rows) != sorted(labels) else "")
        + (f" and {zero} zero key(s) (slots never written)" if zero else "")
    )
    parts = []
    if extra:
        parts.append(f"it read {len(extra)} key(s) the window hides (positions {span_text(extra)})")
    if missed:
        parts.append(f"it missed {len(missed)} visible key(s) (positions {span_text(missed)})")
    if f.window is None:
        parts.append(
            f"layer {km.layer} has no window of its own, yet it read only the newest {len(newest)} key(s): the "
            f"keys before position {newest[0]} were lost or hidden, as through a window"
        )
    else:
        parts.append(f"the window of {f.window} shows positions {span_text(sorted(shown))}")
    cells = Cells(
        km.wrong_keys(),
        torch.zeros(km.query.heads, dtype=torch.bool),
        int((~km.visible).sum()) + int(km.missed.numel()),
    )
    details = {"extra_keys": len(extra), "missed_keys": len(missed), "zero_keys": zero, "keys_read": km.keys.num}
    return Match(KIND, share(km, cells), head + "; " + "; ".join(parts), "all", details)


def prefill_window(km: KeyMap, f: CaseFacts) -> Match | None:
    """A windowed layer below that the prefill masked otherwise than the decode: the prompt rows it
    wrote hold other contents at this layer exactly from the first position its window hides a key at
    (``W``, or ``W - 1`` for a window one short), every row before it and every decode row right. A
    prefill that attends ``W + 1`` keys, or ignores its window, changes those rows and no other."""
    if km.layer == 0 or f.op is not None or f.role != "decode" or f.prefix or not bool(km.query_exact().all()):
        return None
    c = f.case
    if c.chunk is not None and c.length > c.chunk:
        return None  # chunked: a chunk's own bug changes rows from a chunk's start
    wrong = km.wrong_keys().any(1)
    pos = km.keys.positions
    if not bool(wrong.any()) or bool((pos[wrong] >= f.prompt_end).any()):
        return None
    start = int(pos[wrong].min())
    prompt = (pos >= f.shift) & (pos < f.prompt_end)
    if not bool((wrong == (prompt & (pos >= start))).all()) or not bool((prompt & (pos < start)).any()):
        return None  # not exactly the prompt rows from one position on
    rel = start - f.shift - f.sinks
    below = [
        (i, c.window if c.window is not None else a.window)
        for i, a in enumerate(f.model.layer_attentions[: km.layer])
        if a.kind == "sliding"
    ]
    hit = next(((i, w) for i, w in below if w is not None and rel in (w - 1, w)), None)
    if hit is None:
        return None
    i, w = hit
    cells = Cells(km.wrong_keys(), torch.zeros(km.query.heads, dtype=torch.bool))
    worst = float(km.keys.fit[wrong].min())
    text = (
        f"{which_keys(km, cells.keys, f)} hold other contents at layer {km.layer} (fit {worst:.2f} at worst), "
        f"exactly the prompt rows from position {start} on, while every row before it, the query and the keys "
        f"the decode steps wrote are right: {start} is where layer {i}'s window of {w} first hides a key from "
        f"the prompt, so the prefill masked layer {i} otherwise than the decode does (a window off by one in "
        "the prefill, or ignored there)"
    )
    return Match(KIND, share(km, cells), text, "all", {"layer_below": i, "window_below": w, "from_position": start})


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
