"""kv_scale_mismatch: cached keys at their positions, the query right, some rows' lengths off by a
constant per row range (and per KV head under per-head scales).

An 8-bit cache stores ``k / s`` and reads ``codes * s'``: under the wrong scale every key and value of
the rows it reads keeps its direction and takes ``s' / s``. Queries are never cached, so they stay
right (what tells it from an attention factor, which scales them too). The evidence groups the scaled
rows by their factors (per head where they differ) and names a prefix hit's rows when those are the
ones (SGLang #24198).
"""

from __future__ import annotations

import torch

from ..cache.policy import CacheOpPolicy
from ..faults.native import NativeFault
from ..models.config import Checkpoint
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.cells import Cells, rows_of, scope_of, share, span_text
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from .rope_magnitude import clean_scale, power_of

KIND = BugClass.KV_SCALE_MISMATCH
GROUP_TOL = 0.05  # relative spread of the factors of rows read under one wrong scale


def _on_e4m3_grid(x: torch.Tensor) -> bool:
    """Every entry of ``x`` is a finite e4m3fn value: what codes dequantized with scale 1 are."""
    return bool(torch.equal(x.to(torch.float8_e4m3fn).to(x.dtype), x)) and bool(x.abs().max() <= 448)


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.rope is None:
        return None
    k, q = km.keys, km.query
    if not bool(km.query_exact().all()):
        return None  # a scaled query is an attention factor, not the cache's scales
    cells_k = k.placed() & clean_scale(k.scale, k.residual, km.noise)
    if not bool(cells_k.any()):
        return None
    a = km.rope.attention_factor
    if a != 1.0 and all(power_of(float(s), a) not in (None, 0) for s in k.scale[cells_k]):
        return None  # powers of the attention factor: rope_magnitude's
    rows = torch.nonzero(cells_k.any(1)).flatten()
    groups: list[list[int]] = []
    for i in rows.tolist():
        f = k.scale[i]
        for g in groups:
            if bool(((f / k.scale[g[0]] - 1).abs() <= GROUP_TOL).all()):
                g.append(i)
                break
        else:
            groups.append([i])
    parts = []
    for g in groups:
        fac = k.scale[g].mean(0)  # [K]
        scaled_heads = cells_k[g].any(0)
        if bool(((fac / fac[0] - 1).abs() <= GROUP_TOL).all()):
            per = f"x{float(fac[0]):.4g}"
        elif not bool(scaled_heads.all()):
            per = "KV head " + ", ".join(
                f"{h} x{float(fac[h]):.4g}" for h in torch.nonzero(scaled_heads).flatten().tolist()
            )
            per += f" (heads {span_text(torch.nonzero(~scaled_heads).flatten().tolist())} right)"
        else:
            per = "per head x" + "/".join(f"{float(x):.4g}" for x in fac)
        pos = [int(k.positions[i]) for i in g]
        where = f"{len(g)} key{'' if len(g) == 1 else 's'} {per} (position{'' if len(g) == 1 else 's'} {span_text(pos)}"
        if ev.facts.prefix and sorted(pos) == list(range(ev.facts.prefix)):
            where += f": exactly the {ev.facts.prefix} rows reused from the prefix-cache hit"
        seen = ev.keys_seen
        if seen is not None and _on_e4m3_grid(seen[torch.tensor(g)].to(torch.float32)):
            where += "; they read as bare e4m3 codes: dequantized with scale 1, their scale dropped"
        parts.append(where + ")")
    right_rows = km.key_exact().all(1)
    right = int(right_rows.sum())
    if right:
        where = span_text(k.positions[right_rows].tolist())
        parts.append(f"{right} key{'' if right == 1 else 's'} right (positions {where})")
    text = (
        "query and angles right, key lengths wrong by one constant factor per row range: the cache's 8-bit codes "
        "were dequantized with another scale than the one they were written under: " + ", ".join(parts)
    )
    cells = Cells(cells_k, torch.zeros(q.heads, dtype=torch.bool))
    details = {
        "key_factors": [[float(x) for x in k.scale[g].mean(0)] for g in groups],
        "scaled_keys": int(rows.numel()),
    }
    return Match(KIND, share(km, cells), text, scope_of(km, cells), details, rows_of(cells_k))


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class ScalesDroppedOnPrefixHit(CacheOpPolicy):
    """Rows reused from a prefix-cache hit are dequantized with scale 1, the rest with their layer's."""

    name = "fp8-scales-dropped-on-prefix-hit"

    def read_scales(self, layer, scales, inherited):
        k, v = super().read_scales(layer, scales, inherited)
        one = torch.ones((), dtype=torch.float32)
        rows = inherited[:, None].to(k.device)  # [N, 1]
        return torch.where(rows, one, k[None, :]), torch.where(rows, one, v[None, :])  # [N, S]


class ScalesOfAnotherLayer(CacheOpPolicy):
    """Layer ``i`` dequantizes with the scales of layer ``(i + 1) mod num_layers``."""

    name = "fp8-scales-of-another-layer"

    def read_scales(self, layer, scales, inherited):
        return super().read_scales((layer + 1) % len(scales), scales, inherited)


APART = 4.0  # how much larger every odd layer's keys and values are in :func:`layers_apart`


def layers_apart(ckpt: Checkpoint, factor: float = APART) -> Checkpoint:
    """The same function with every odd layer's keys and values ``factor`` times larger: its key
    projection (or key norm, where keys are normed) and value projection times ``factor``, its query
    projection (or query norm) and output projection divided by it, so every attention score and
    output is what it was. Adjacent layers' scales then differ ``factor`` times, as a trained model's do
    while a random test model's layers are alike (two layers of one init: scales within 1.4x, where
    reading the other layer's scale stays inside fp8's noise). A model whose attention weights have
    other names (latent attention) is returned unchanged."""
    w = dict(ckpt.weights)
    for i in range(1, ckpt.config.num_layers, 2):
        at = f"model.layers.{i}.self_attn."
        normed = f"{at}k_norm.weight" in w
        up = [f"{at}k_norm.weight"] if normed else [f"{at}k_proj.weight", f"{at}k_proj.bias"]
        down = [f"{at}q_norm.weight"] if normed else [f"{at}q_proj.weight", f"{at}q_proj.bias"]
        up += [f"{at}v_proj.weight", f"{at}v_proj.bias"]
        down += [f"{at}o_proj.weight"]
        if not all(n in w for n in (up[0], down[0], f"{at}v_proj.weight", f"{at}o_proj.weight")):
            return ckpt
        for names, by in ((up, factor), (down, 1.0 / factor)):
            for n in names:
                if n in w:
                    w[n] = w[n] * by
    return Checkpoint.from_tensors(ckpt.config, w, source=f"{ckpt.source} (odd layers' keys and values x{factor:g})")


# A prefix-cache hit (the earlier request wrote the scales and the prefix), a prompt past it and two
# decode steps; the prefix is not block-aligned, so the hit shares a partial block too.
_PREFIX_HIT = (Case(length=12, prefix=9, block_size=4, decode_steps=2),)


_DECODE = (Case(length=17, block_size=7, decode_steps=2),)


_WHERE = "an fp8 KV cache (float8_e4m3fn, per-tensor scales)"


FAULTS = (
    NativeFault(
        name="fp8-scales-dropped-on-prefix-hit",
        kind=KIND,
        description=f"{_WHERE}: the rows of a prefix-cache hit are dequantized with scale 1 (SGLang #24198)",
        key_form="rotated",
        shows_when="a prefix-cache hit (the request that wrote the prefix is right)",
        cache_ops=ScalesDroppedOnPrefixHit,
        kv_dtype="fp8",
        exposing=_PREFIX_HIT,
    ),
    NativeFault(
        name="fp8-scales-of-another-layer",
        kind=KIND,
        description=f"{_WHERE}: layer i dequantizes with layer i + 1's scales (odd layers' KV 4x larger, same function)",
        key_form="rotated",
        shows_when="any read of cached rows (the first decode; a model of two layers or more)",
        cache_ops=ScalesOfAnotherLayer,
        kv_dtype="fp8",
        model=layers_apart,
        exposing=_DECODE,
    ),
)
