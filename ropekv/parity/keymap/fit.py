"""The fit: every key the kernel read and its query, per head, explained against the reference.

For each cell (a token at a head) with raw vector ``r`` (the float64 reference's, before RoPE) and
effective vector ``c`` (what the kernel multiplied):

1. **Positions.** Under the contract's pairing and frequencies, the best position per M-RoPE section
   (:mod:`.spectral`): first the named positions (the logical one, ``2j``, 0, the slot, ``j - P``,
   ``j mod B``, the block's start, the ring index, positions wrapped in 16 or 32 bits, the case's
   operation offsets, the query's own offset), then, where none of those fits, the integer search.
   The same under the other pairing.
2. **Rotations.** Each alternative rotation (:func:`.rotations.alternatives`: other layers' specs,
   all channels turned, earlier lengths' frequencies, low-precision angles) at the cell's expected
   positions; where nothing fits, frequencies estimated from those cells (:mod:`.frequencies`) and
   tried again.
3. **Content.** Where still nothing fits: which reference row and head the content is a rotation of
   (rotation-invariant pair-length profiles, then the search against the nearest rows).
4. **Length and rest.** Against the chosen explanation ``e``, the scale ``<c, e> / <e, e>``, the
   residual, and the change of the channels RoPE leaves alone.

The explanation of a cell is its own row, at its expected positions, under the contract's rotation
whenever that fits within the engine's noise; otherwise the best fitting candidate (ties: the
earlier). Cost: every cell is tried at every named position and every alternative rotation
(``cells x candidates x D``); the integer search sweeps ``C`` integers for the cells nothing named
explains (``cells x C x rotary_dim / 2`` multiply-adds, blocked: about 2 s for 8k keys of SmolLM2
when no cell fits a named position); the content search compares at most :data:`MAX_SOURCE_CELLS`
cells with every reference row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UsageError
from ...rope import PositionStreams, RopeSpec, inv_freq_for_theta
from . import frequencies, spectral
from .record import KeyMap, TokenFits, fit_ok
from .rotations import Rotation, alternatives, frequency_rotation, spec_rotation

CLEAR = 0.25  # an explanation replaces a fitting one only where it cuts the misfit to this share
MAX_SOURCE_CELLS = 2048  # misfit cells whose content is looked for among the reference's rows
SOURCE_NEAREST = 3  # rows per cell (by pair-length profile) the search tries


@dataclass(frozen=True)
class Geometry:
    """What the case says about where keys could wrongly sit: the prefix ``P`` of a cache hit, the
    block size ``B``, the ring (``window`` + ``sinks``), and constant offsets worth trying (a case
    operation's: a rollback's draft length, an eviction's count, ...)."""

    prefix: int = 0
    block_size: int = 1
    window: int | None = None
    sinks: int = 0
    offsets: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class FitInput:
    """One decode row at one layer. Raw vectors are the float64 reference's (before RoPE), effective
    ones the kernel's; the reference's rows are by token index (``position - shift``)."""

    layer: int
    rope: RopeSpec | None  # the layer's contract spec (None: no position embedding)
    others: tuple[tuple[str, RopeSpec | None], ...]  # the other layers' specs, named
    seq_len: int  # the length the contract's frequencies are for (the decode's position + 1)
    query_position: int
    q_raw: torch.Tensor  # [H, D]
    q_eff: torch.Tensor  # [H, D]
    ref_keys: torch.Tensor  # [T, KVH, D] raw keys of every reference row
    k_eff: torch.Tensor  # [N, KVH, D]
    key_positions: torch.Tensor  # [N] int64
    key_slots: torch.Tensor  # [N] int64, -1 where unknown
    visible: torch.Tensor  # [T'] bool by position from origin: the reference's mask for this query ([0]: none given)
    noise: float
    shift: int = 0
    origin: int = 0  # the position of visible[0] (RefRow.origin: a shifted case's rows start at its shift)
    ref_values: torch.Tensor | None = None  # [T, KVH, D]
    v_eff: torch.Tensor | None = None  # [N, KVH, D]
    streams: PositionStreams | None = None
    geometry: Geometry = Geometry()

    def __post_init__(self) -> None:
        n = self.key_positions.shape[0] if self.key_positions.dim() == 1 else -1
        d = self.q_raw.shape[-1] if self.q_raw.dim() == 2 else -1
        if self.q_raw.dim() != 2 or self.q_eff.shape != self.q_raw.shape:
            raise UsageError(f"key map: q_raw/q_eff must both be [H, D], got {tuple(self.q_raw.shape)}")
        if self.k_eff.dim() != 3 or self.k_eff.shape[0] != n or n < 1 or self.k_eff.shape[2] != d:
            raise UsageError(
                f"key map: k_eff must be [N >= 1, KVH, {d}] with N positions, got {tuple(self.k_eff.shape)}"
            )
        if self.ref_keys.dim() != 3 or self.ref_keys.shape[1:] != self.k_eff.shape[1:]:
            raise UsageError(
                f"key map: reference keys {tuple(self.ref_keys.shape)} do not match the kernel's {tuple(self.k_eff.shape)}"
            )
        if tuple(self.key_slots.shape) != (n,):
            raise UsageError(f"key map: key_slots must be [{n}], got {tuple(self.key_slots.shape)}")


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(device="cpu", dtype=torch.float64)


def wrap(p: torch.Tensor, bits: int) -> torch.Tensor:
    half = 1 << (bits - 1)
    return torch.remainder(p + half, 1 << bits) - half


def _named(p: torch.Tensor, slots: torch.Tensor | None, g: Geometry, extra: tuple[int, ...]) -> torch.Tensor:
    """Named positions ``[T, Hy]`` for tokens at ``p [T]`` (and their ``slots``)."""
    cols = [p, 2 * p, 3 * p, torch.zeros_like(p), wrap(p, 16), wrap(p, 32)]
    if slots is not None:
        cols.append(torch.where(slots >= 0, slots, p))
    if g.prefix > 0:
        cols.append(p - g.prefix)
    if g.block_size > 1:
        cols += [p % g.block_size, p - p % g.block_size]
    if g.window is not None:
        s = g.sinks
        cols.append(torch.where(p < s, p, s + (p - s) % g.window))
    for o in (*g.offsets, *extra):
        cols.append(p + o)
    return torch.stack(cols, dim=1)


def _expected(p: torch.Tensor, sections: int, streams: PositionStreams | None) -> torch.Tensor:
    """``[T, S]``: the positions each section of tokens at ``p [T]`` should turn by."""
    if sections == 3 and streams is not None:
        return streams.at(p).T.contiguous()
    return p[:, None].clone()


class _Cells:
    """Raw and effective vectors of ``T`` tokens at ``K`` heads, flattened to ``T * K`` cells."""

    def __init__(self, raw: torch.Tensor, eff: torch.Tensor, positions: torch.Tensor, own: torch.Tensor):
        self.t, self.k, self.d = eff.shape
        self.raw = raw.reshape(-1, self.d)  # [T*K, D]
        self.eff = eff.reshape(-1, self.d)
        self.positions = positions  # [T]
        self.own = own  # [T]

    def per_cell(self, x: torch.Tensor) -> torch.Tensor:
        """A per-token ``[T, ...]`` tensor repeated for each head: ``[T*K, ...]``."""
        return x.repeat_interleave(self.k, dim=0)


class _Choice:
    """The explanation chosen so far for each cell, replaced by a candidate that fits better."""

    def __init__(self, cells: int, sections: int, ok: float):
        self.ok = ok
        self.fit = torch.full((cells,), -2.0, dtype=torch.float64)
        self.pos = torch.zeros(cells, sections, dtype=torch.int64)
        self.rot = torch.zeros(cells, dtype=torch.int64)
        self.src = torch.full((cells,), -1, dtype=torch.int64)
        self.src_head = torch.zeros(cells, dtype=torch.int64)
        self.expected_vec = torch.zeros(0)

    def offer(
        self, mask: torch.Tensor, fit: torch.Tensor, pos: torch.Tensor, rot: int, src: torch.Tensor, head: torch.Tensor
    ) -> None:
        """Take ``fit`` where it is better: any gain over a choice that does not fit, else a clear one
        (the misfit ``1 - fit`` cut to a quarter: the residual halved), so that noise in a row's content
        never trades its own explanation for a neighbouring one."""
        gain = (self.fit < self.ok) | (1 - fit < CLEAR * (1 - self.fit))
        self.take(mask & (fit > self.fit + 1e-12) & gain, fit, pos, rot, src, head)

    def take(
        self,
        better: torch.Tensor,
        fit: torch.Tensor,
        pos: torch.Tensor,
        rot: int,
        src: torch.Tensor,
        head: torch.Tensor,
    ) -> None:
        """Take the explanation where ``better`` [cells] holds, whatever the current choice."""
        self.fit[better] = fit[better]
        self.pos[better] = pos[better]
        self.rot[better] = rot
        self.src[better] = src[better]
        self.src_head[better] = head[better]


class _Fitter:
    """The fit of one group of cells (the query's heads, or the keys'): places them, offers them
    alternatives, and turns the chosen explanations into :class:`~.record.TokenFits`."""

    def __init__(
        self, inp: FitInput, cells: _Cells, named: torch.Tensor, expected: torch.Tensor, rotations: list[Rotation]
    ):
        self.inp, self.cells, self.named, self.expected, self.rotations = inp, cells, named, expected, rotations
        self.rope = inp.rope
        n = cells.raw.shape[0]
        self.s = expected.shape[1]
        self.heads = torch.arange(cells.k).repeat(cells.t)  # [cells]
        self.own = cells.per_cell(cells.own)
        self.exp_c = cells.per_cell(expected)  # [cells, S]
        self.ok = fit_ok(inp.noise)
        self.choice = _Choice(n, self.s, self.ok)
        self.free = torch.ones(n, dtype=torch.bool)  # cells not locked to the contract's explanation
        self.searched = torch.zeros(n, dtype=torch.bool)
        self.contract_channels, _ = _channels(self.rope, cells.d)
        rope = self.rope
        if rope is not None:
            self.sections = rope.section_axes() if self.s == 3 else torch.zeros(rope.rotary_dim // 2, dtype=torch.int64)
            self.w = rope.inv_freq(inp.seq_len)

    def offer(self, index: int, pos: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Offer rotation ``index`` at ``pos [cells, S]``; the fit is over the channels either rotation
        turns (the pass-through ones are judged apart)."""
        cells = self.cells
        e = self.rotations[index].turn(cells.raw, pos)
        spec = self.rotations[index].spec
        channels = self.contract_channels
        if spec is not None or self.rope is None:
            channels = channels | _channels(spec, cells.d)[0]
        fit = spectral.cosine(cells.eff[:, channels], e[:, channels])
        self.choice.offer(self.free if mask is None else mask & self.free, fit, pos, index, self.own, self.heads)
        return fit

    def spectra(self, layout: str, sections: int | None = None) -> spectral.Spectra:
        rope = self.rope
        assert rope is not None
        s = self.s if sections is None else sections
        return spectral.spectra(
            self.cells.raw,
            self.cells.eff,
            rotary_dim=rope.rotary_dim,
            layout=layout,
            offset=rope.rotary_offset,
            w=self.w,
            sections=self.sections if s == self.s else torch.zeros(rope.rotary_dim // 2, dtype=torch.int64),
            num_sections=s,
        )

    def place(self, search_all: bool) -> None:
        """Steps 1 and 2: the contract's rotation at the expected positions (locked where exact), the
        named positions and the search under both pairings, the alternatives at the expected positions."""
        inp, rope, exp_c, s = self.inp, self.rope, self.exp_c, self.s
        exact_fit = self.offer(0, exp_c)
        exact = 1 - inp.noise**2 / 2
        self.free &= exact_fit < exact
        if rope is None:
            for index in range(1, len(self.rotations)):
                self.offer(index, exp_c)
            return
        for index, layout in ((0, rope.layout), (1, "gptj" if rope.layout == "neox" else "neox")):
            sp = self.spectra(layout)
            # named positions: every section at one named position, or (M-RoPE) each at a stream
            hyp = self.cells.per_cell(self.named)[:, :, None].expand(-1, -1, s)
            if s == 3:
                axes = exp_c[:, None, :].expand(-1, 3, -1).clone()
                for a in range(3):
                    axes[:, a, :] = exp_c[:, a : a + 1]
                hyp = torch.cat((hyp, exp_c[:, None, :], axes), dim=1)
            scores = spectral.section_scores(sp, hyp)  # [cells, Hy, S]
            best = scores.argmax(dim=1)  # per section
            pos = torch.gather(hyp, 1, best[:, None, :])[:, 0, :]
            best_scores = torch.gather(scores, 1, best[:, None, :])[:, 0, :]
            fit_named = spectral.fit_of(sp, best_scores)
            need = self.free.clone() if search_all else self.free & (fit_named < exact)
            idx = torch.nonzero(need).flatten()
            if idx.numel():
                cand = spectral.candidate_range(
                    inp.query_position, inp.key_positions, inp.geometry.block_size, inp.key_slots
                )
                found, found_scores = spectral.search(sp, idx, cand)
                take = found_scores > best_scores[idx] + 1e-12
                pos_idx = pos[idx]
                pos_idx[take] = found[take]
                pos[idx] = pos_idx
                self.searched[idx] = True
            self.offer(index, pos)
        for index in range(2, len(self.rotations)):
            self.offer(index, exp_c)

    def lost(self) -> torch.Tensor:
        """Indices of the cells nothing explains yet."""
        return torch.nonzero(self.choice.fit < self.ok).flatten()

    def finish(self) -> TokenFits:
        """Step 4: against each cell's explanation, its scale, residual and pass-through channels."""
        cells, choice, rope = self.cells, self.choice, self.rope
        n = cells.raw.shape[0]
        src_rows = self.inp.ref_keys.reshape(-1, cells.d) if cells.k == self.inp.ref_keys.shape[1] else None
        raw_src = cells.raw.clone()
        moved = (choice.src >= 0) & ((choice.src != self.own) | (choice.src_head != self.heads))
        if src_rows is not None and bool(moved.any()):
            raw_src[moved] = _f64(src_rows[choice.src[moved] * cells.k + choice.src_head[moved]])
        e = torch.empty_like(cells.eff)
        for index in torch.unique(choice.rot).tolist():
            sel = choice.rot == index
            e[sel] = self.rotations[index].turn(raw_src[sel], choice.pos[sel])
        rotary, keep = _channels(rope, cells.d)
        scale, resid = spectral.scale_and_residual(cells.eff[:, rotary], e[:, rotary])
        passthrough = torch.zeros(n, dtype=torch.float64)
        if bool(keep.any()):
            # channels RoPE leaves alone: their direction against the raw row's (a cache's scale may
            # lengthen the whole vector; only a turn or other contents change the direction)
            _, passthrough = spectral.scale_and_residual(cells.eff[:, keep], raw_src[:, keep])
            passthrough = torch.nan_to_num(passthrough, posinf=0.0)
        shape = (cells.t, cells.k)
        return TokenFits(
            positions=cells.positions,
            own=cells.own,
            expected=self.expected,
            effective=choice.pos.reshape(cells.t, cells.k, self.s),
            fit=choice.fit.reshape(shape),
            rotation=choice.rot.reshape(shape),
            source=choice.src.reshape(shape),
            source_head=choice.src_head.reshape(shape),
            scale=scale.reshape(shape),
            residual=resid.reshape(shape),
            passthrough=passthrough.reshape(shape),
            searched=self.searched.reshape(shape),
            fit_ok=self.ok,
        )


def _estimate(inp: FitInput, groups: list[_Fitter], rotations: list[Rotation]) -> None:
    """Frequencies estimated from the cells nothing explains yet, of every group at once (the decode
    side's query and the keys it wrote share a wrong spec), offered back to those cells."""
    rope = inp.rope
    if rope is None or groups[0].s != 1:
        return
    lost = [g.lost() for g in groups]
    if not any(x.numel() for x in lost):
        return
    parts = [g.spectra(rope.layout, 1) for g in groups]
    real = torch.cat([p.real[x] for p, x in zip(parts, lost)])
    imag = torch.cat([p.imag[x] for p, x in zip(parts, lost)])
    weight = torch.cat([p.weight[x] for p, x in zip(parts, lost)])
    positions = torch.cat([g.exp_c[x, 0] for g, x in zip(groups, lost)])
    sp = spectral.Spectra(real, imag, weight, parts[0].sections, parts[0].w)
    est = frequencies.estimate(
        sp,
        torch.arange(positions.numel()),
        positions,
        rope.rotary_dim,
        theta_spec=None
        if rope.scaling.rope_type == "default"
        else lambda x: inv_freq_for_theta(rope, rope.theta * x, inp.seq_len),
    )
    if est is None or est.fit < groups[0].ok:
        return
    label = (
        f"theta ~ {rope.theta * est.x:.6g} (contract {rope.theta:.6g})"
        if est.family == "theta"
        else f"every frequency divided by ~ {est.x:.4g}"
    )
    rotations.append(
        frequency_rotation(
            rope,
            est.w,
            label,
            "estimated",
            family=est.family,
            estimate=est.x,
            theta_estimate=rope.theta * est.x if est.family == "theta" else None,
            estimate_fit=est.fit,
        )
    )
    # Offered to every cell the contract does not fit exactly, not only the lost ones: at small
    # positions a wrong spec turns a key barely off its contract rotation (a fit above the threshold,
    # not exact), and the estimate takes such a cell only where it is clearly better (CLEAR).
    # A cell the integer search placed away from its expected position, which the estimated spec also
    # explains at that position, takes the estimate: one spec for every cell, not a position of its own
    # per cell (a linear factor of 2 turns the key at 2j exactly as the contract turns it at j).
    index = len(rotations) - 1
    for g in groups:
        fit = g.offer(index, g.exp_c)
        moved = (g.choice.pos != g.exp_c).any(dim=1)
        prefer = g.free & g.searched & moved & (fit >= g.ok) & (g.choice.rot != index)
        g.choice.take(prefer, fit, g.exp_c, index, g.own, g.heads)


def _channels(rope: RopeSpec | None, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks ``[D]`` of the channels RoPE turns and of those it leaves alone."""
    rotary = torch.zeros(d, dtype=torch.bool)
    if rope is None:
        rotary[:] = True
        return rotary, ~rotary
    rotary[rope.rotary_offset : rope.rotary_offset + rope.rotary_dim] = True
    return rotary, ~rotary


def _find_sources(g: _Fitter) -> None:
    """Step 3, for key cells nothing explains: the reference row and head whose pair-length profile is
    nearest, searched for its position under the contract; taken where that fits."""
    inp, cells, choice, rope = g.inp, g.cells, g.choice, g.rope
    if rope is None or cells.k != inp.ref_keys.shape[1]:
        return
    lost = g.lost()
    if lost.numel() == 0:
        return
    if lost.numel() > MAX_SOURCE_CELLS:
        lost = lost[torch.linspace(0, lost.numel() - 1, MAX_SOURCE_CELLS).round().long()]
    a, b = spectral.pairs(rope.rotary_dim, rope.layout, rope.rotary_offset)
    rows = _f64(inp.ref_keys).reshape(-1, cells.d)  # [T*KVH, D]
    prof_rows = spectral.magnitude_profiles(rows, a, b)
    prof = spectral.magnitude_profiles(cells.eff[lost], a, b)
    dist = torch.cdist(prof, prof_rows)  # [M, T*KVH]
    # rows alike within rounding (one token id at several positions gives one raw key at layer 0): the
    # one at or before the query nearest the cell's own row first
    row_of = torch.arange(rows.shape[0]) // cells.k
    own = g.own[lost]
    after = (row_of[None, :] > inp.query_position - inp.shift).double()
    apart = (row_of[None, :] - own[:, None]).abs().double() / max(1, rows.shape[0])
    dist = dist.round(decimals=6) + 1e-7 * after + 1e-8 * apart
    k = min(SOURCE_NEAREST, rows.shape[0])
    near = dist.topk(k, dim=1, largest=False).indices  # [M, k]
    cand = spectral.candidate_range(inp.query_position, inp.key_positions, inp.geometry.block_size, inp.key_slots)
    channels, _ = _channels(rope, cells.d)
    contract = g.rotations[0]
    for j in range(k):
        src = near[:, j]
        sp = spectral.spectra(
            rows[src],
            cells.eff[lost],
            rotary_dim=rope.rotary_dim,
            layout=rope.layout,
            offset=rope.rotary_offset,
            w=g.w,
            sections=g.sections,
            num_sections=g.s,
        )
        pos, _ = spectral.search(sp, torch.arange(lost.numel()), cand)
        e = contract.turn(rows[src], pos)
        fit = spectral.cosine(cells.eff[lost][:, channels], e[:, channels])
        better = fit > choice.fit[lost] + 1e-12
        upd = lost[better]
        choice.fit[upd] = fit[better]
        choice.pos[upd] = pos[better]
        choice.rot[upd] = 0
        choice.src[upd] = src[better] // cells.k
        choice.src_head[upd] = src[better] % cells.k
    _prefer_row_at_position(g, rows, lost)


def _prefer_row_at_position(g: _Fitter, rows: torch.Tensor, cells_: torch.Tensor) -> None:
    """Among rows alike (one token id at several positions gives one raw key at layer 0), a found
    content is the row at the position the cell sits at where that row is alike: a key that is token
    16's rotated at 16 reads as row 16, not as an earlier copy of the same token rotated elsewhere."""
    choice, k, shift = g.choice, g.cells.k, g.inp.shift
    found = cells_[(choice.src[cells_] >= 0) & (choice.fit[cells_] >= g.ok)]
    at = choice.pos[found, 0] - shift  # [M] the row of the position each cell sits at
    keep = (at >= 0) & (at < rows.shape[0] // k) & (at != choice.src[found])
    cand, at = found[keep], at[keep]
    if cand.numel() == 0:
        return
    head = choice.src_head[cand]
    mine, theirs = rows[at * k + head], rows[choice.src[cand] * k + head]  # [M, D]
    alike = (mine - theirs).norm(dim=-1) <= 1e-9 * theirs.norm(dim=-1).clamp(min=1e-300)
    choice.src[cand[alike]] = at[alike]


def fit_keymap(inp: FitInput) -> KeyMap:
    """The :class:`~.record.KeyMap` of ``inp``'s decode row (see the module docstring)."""
    rope, t = inp.rope, inp.query_position
    pos = inp.key_positions.detach().cpu().long()
    slots = inp.key_slots.detach().cpu().long()
    s = 3 if rope is not None and rope.mrope_section is not None and inp.streams is not None else 1
    T = inp.ref_keys.shape[0]
    own_k = (pos - inp.shift).clamp(0, T - 1)
    k_raw = _f64(inp.ref_keys)[own_k]  # [N, KVH, D]
    q_cells = _Cells(_f64(inp.q_raw)[None], _f64(inp.q_eff)[None], torch.tensor([t]), torch.tensor([t - inp.shift]))
    k_cells = _Cells(k_raw, _f64(inp.k_eff), pos, own_k)
    rotations = list(alternatives(rope, inp.seq_len, inp.others))
    q_named = _named(torch.tensor([t]), None, inp.geometry, ())
    qf = _Fitter(inp, q_cells, q_named, _expected(torch.tensor([t]), s, inp.streams), rotations)
    qf.place(search_all=True)
    q_ok = qf.choice.fit >= qf.ok
    d_q = (qf.choice.pos[:, 0] - qf.exp_c[:, 0])[q_ok]
    q_off = int(torch.mode(d_q).values) if d_q.numel() else 0
    k_named = _named(pos, slots, inp.geometry, (q_off,) if q_off else ())
    kf = _Fitter(inp, k_cells, k_named, _expected(pos, s, inp.streams), rotations)
    kf.place(search_all=False)
    _estimate(inp, [qf, kf], rotations)
    _find_sources(kf)
    query, keys = qf.finish(), kf.finish()
    values = torch.full(keys.fit.shape, float("nan"), dtype=torch.float64)
    value_scale = torch.full(keys.fit.shape, float("nan"), dtype=torch.float64)
    if (
        inp.ref_values is not None
        and inp.v_eff is not None
        and inp.v_eff.shape == inp.k_eff.shape
        and inp.ref_values.shape[1:] == inp.v_eff.shape[1:]
    ):
        v_ref = _f64(inp.ref_values)[own_k].reshape(-1, k_cells.d)
        v_eff = _f64(inp.v_eff).reshape(-1, k_cells.d)
        vs, vr = spectral.scale_and_residual(v_eff, v_ref)
        diff = (v_eff - v_ref).norm(dim=-1) / v_ref.norm(dim=-1).clamp_min(1e-300)
        values, value_scale = diff.reshape(keys.fit.shape), vs.reshape(keys.fit.shape)
        del vr
    vis = inp.visible.detach().cpu().bool()
    if vis.numel() == 0:  # no mask given: every key read is one the query sees, none is missed
        visible, missed = torch.ones_like(pos, dtype=torch.bool), torch.zeros(0, dtype=torch.int64)
    else:
        col = pos - inp.origin
        in_range = (col >= 0) & (col < vis.numel())
        visible = torch.zeros_like(pos, dtype=torch.bool)
        visible[in_range] = vis[col[in_range]]
        read = torch.zeros(vis.numel(), dtype=torch.bool)
        read[col[in_range]] = True
        missed = torch.nonzero(vis & ~read).flatten() + inp.origin
    return KeyMap(
        layer=inp.layer,
        rope=rope,
        query_position=t,
        seq_len=inp.seq_len,
        noise=inp.noise,
        query=query,
        keys=keys,
        slots=slots,
        visible=visible,
        missed=missed,
        values=values,
        value_scale=value_scale,
        rotations=tuple(rotations),
        rotary_pairs=0 if rope is None else rope.rotary_dim // 2,
    )


def contract_rotation(rope: RopeSpec | None, seq_len: int) -> Rotation:
    """The contract's rotation alone (for callers that turn a raw row the way the contract says)."""
    return spec_rotation(rope, seq_len, "the contract's RoPE", "contract")


def fit_row(
    rope: RopeSpec,
    *,
    q_raw: torch.Tensor,
    q_eff: torch.Tensor,
    k_raw: torch.Tensor,
    k_eff: torch.Tensor,
    query_position: int,
    key_positions: torch.Tensor,
    key_slots: torch.Tensor | None = None,
    noise: float = 5e-3,
    shift: int = 0,
) -> KeyMap:
    """The key map of one row outside a parity case: ``q_raw``/``q_eff`` ``[H, D]``, ``k_raw`` the raw
    keys ``[T, KVH, D]`` by token index (``position - shift``), ``k_eff [N, KVH, D]`` at
    ``key_positions [N]`` (every key visible)."""
    n = key_positions.numel()
    origin = int(key_positions.min())  # every key given is visible: the mask spans them alone
    visible = torch.zeros(int(key_positions.max()) + 1 - origin, dtype=torch.bool)
    visible[key_positions.long() - origin] = True
    return fit_keymap(
        FitInput(
            layer=0,
            rope=rope,
            others=(),
            seq_len=query_position + 1,
            query_position=query_position,
            q_raw=q_raw,
            q_eff=q_eff,
            ref_keys=k_raw,
            k_eff=k_eff,
            key_positions=key_positions,
            key_slots=key_slots if key_slots is not None else torch.full((n,), -1, dtype=torch.int64),
            visible=visible,
            noise=noise,
            shift=shift,
            origin=origin,
            geometry=Geometry(offsets=(shift, -shift) if shift else ()),
        )
    )
