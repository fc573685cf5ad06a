"""Full forwards for the judge: the float64 reference and the engine's own, computed once and shared.

For RoPE whose frequencies do not depend on length, one forward over the longest sequence serves every
case with the same window (row ``t`` of a causal forward is the reference for position ``t``); for
dynamic NTK and LongRoPE each decode position ``t`` gets its own forward over exactly ``t + 1``
tokens; an ``evict`` or ``shift`` case has a reference of its own (:mod:`ropekv.parity.ops`). With a
:class:`~ropekv.parity.reference_cache.ReferenceStore`, each case's reference rows are read from it
when it holds them (the decoder is then never built) and stored there when computed. A forward is
dropped after the last case that reads it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from typing import Any

import torch

from ..attention_kind import MODEL_WINDOWS
from ..contract import DTYPES
from ..errors import UsageError
from ..models.computed import computation_fingerprint
from ..models.config import ModelConfig
from ..models.reference import ReferenceDecoder, ReferenceOutput
from ..probe import LayerProbe
from . import ops
from .cases import Case, ImageGrid
from .compare import LogitsOf, NextToken, RefRow
from .progress import Progress
from .protocol import EngineAdapter, FullRun, Tier
from .reference_cache import (
    COMPUTED,
    HIT,
    RECOMPUTED,
    EntryProblem,
    ReferenceSource,
    ReferenceStore,
    RowsShape,
    StoredRows,
    entry_fields,
    fit,
    sample_mismatch,
)
from .validate import check_full_run


class References:
    """Full forwards (float64 reference and the engine's own), computed once per window and reused;
    with a :class:`ReferenceStore`, each case's reference rows are read from it when it holds them
    (the decoder is then never built) and stored there when computed."""

    def __init__(
        self,
        adapter: EngineAdapter,
        tier: Tier,
        reference: str,
        tokens: torch.Tensor,
        cases: list[Case],
        store: ReferenceStore | None = None,
    ):
        self.adapter, self.tier, self.reference, self.tokens, self.store = adapter, tier, reference, tokens, store
        self.cfg = adapter.checkpoint.config
        self._decoder: ReferenceDecoder | None = None
        self._stored: dict[Case, dict[int, RefRow]] = {}  # a case's reference rows by position, from the store
        self.sources: dict[Case, ReferenceSource] = {}
        self.notes: dict[Case, str] = {}  # why an entry was recomputed, or could not be stored
        self.cache_seconds = {"saved": 0.0, "spent": 0.0}
        self.per_position = self.cfg.rope.length_dependent
        self.bar: Progress | None = None
        # the store's key: what the model computes, so a gptj presentation (llama.cpp's) of the same
        # weights reads the rows a neox one stored (ropekv.models.computed)
        self._model_key: str | None = None
        self.seconds = {"float64_reference_forwards": 0.0, "engine_full_forwards": 0.0, "cached_runs": 0.0}
        self._rows: dict[_Group, list[int]] = {}
        self._cases: dict[_Group, Case] = {}
        for c in cases:
            # A cache operation's case reads the plain forwards at ops.self_rows (and, for evict and
            # shift, a float64 forward of its own, see ropekv.parity.ops).
            rows = c.decode_positions if c.op is None else ops.self_rows(c)
            if rows:
                self._rows.setdefault(self._group(c), []).extend(rows)
                self._cases.setdefault(self._group(c), dataclasses.replace(c, op=None))
        self._ref: dict[_Key, ReferenceOutput] = {}
        self._layer0: dict[
            tuple[_Group, tuple[int, ...]], ReferenceOutput
        ] = {}  # layer 0 of a plain forward, checking stored rows
        self._op_ref: dict[Case, ReferenceOutput] = {}  # an evict or shift case's own reference
        self._self: dict[_Key, FullRun] = {}
        # How many cases still to be judged read each forward. One is dropped after its last reader:
        # their probes hold every position's keys and values per layer (at 32,766 tokens of Gemma 3
        # 270M, 3.6 GB in float64 and 1.8 GB from the engine). Forensics reads a dropped reference
        # again by recomputing it (the same float64 forward, the same values), once per case it reads.
        self._readers: Counter[_Use] = Counter(use for c in cases for use in self._uses(c))
        self._reference_done: set[Case] = set()  # cases whose reference forwards are released
        if self.per_position:
            self.work = 2 * sum(t + 1 for rows in self._rows.values() for t in set(rows))
        else:
            self.work = 2 * sum(max(rows) + 1 for rows in self._rows.values())
        self.work += sum(max(c.decode_positions) + 1 - c.shift for c in cases if ops.needs_own_reference(c))

    @property
    def decoder(self) -> ReferenceDecoder:
        """The float64 decoder, built on first use (its weight copy is skipped when the store has every row)."""
        if self._decoder is None:
            self._decoder = ReferenceDecoder(self.adapter.checkpoint, dtype=DTYPES[self.reference])
        return self._decoder

    def prepare(self, case: Case) -> None:
        """With a store: ``case``'s reference rows from it, or computed (the forward shared with the other
        cases of its window, as without a store) and stored; the source is recorded for the report."""
        if self.store is None or case in self.sources:
            return
        if self._model_key is None:
            self._model_key = computation_fingerprint(self.adapter.checkpoint)
        fields = entry_fields(self._model_key, self.reference, case, self.tokens)
        cfg = self.cfg
        positions = tuple(sorted(set(case.decode_positions)))
        shape = RowsShape(
            positions,
            cfg.num_layers,
            cfg.num_heads,
            cfg.hidden_size,
            cfg.vocab_size,
            DTYPES[self.reference],
            origin=case.shift,
        )
        problem = None
        try:
            stored = self.store.load(fields, shape)
        except EntryProblem as exc:
            stored, problem = None, str(exc)
        if stored is not None:
            problem = self._sample_problem(case, stored)
        if stored is not None and problem is None:
            rows = {t: fit(row, self._width(case, t, stored.widths[t])) for t, row in stored.rows.items()}
            if all(r is not None for r in rows.values()):
                self._stored[case] = {t: r for t, r in rows.items() if r is not None}
                self.sources[case] = HIT
                self.cache_seconds["saved"] += stored.seconds
                return
            problem = "its attention rows are wider than this check's forwards"
        before = self.seconds["float64_reference_forwards"]
        computed = {t: self._computed_row(case, t) for t in positions}
        spent = self.seconds["float64_reference_forwards"] - before
        self.cache_seconds["spent"] += spent
        widths = {t: max((a.shape[1] for a in row.attn_logits), default=1) for t, row in computed.items()}
        self.sources[case] = COMPUTED if problem is None else RECOMPUTED
        if problem is not None:
            self.notes[case] = f"reference: recomputed, the cached entry was not valid ({problem})"
            print(f"ropekv: reference cache entry of case {case.label()} recomputed: {problem}", file=sys.stderr)
        refused = self.store.writes_refused()
        if refused is not None:
            self.notes[case] = f"reference: computed but not stored ({refused})"
        else:
            try:
                self.store.save(fields, computed, widths, spent)
            except OSError as exc:
                self.notes[case] = f"reference: computed but not stored ({exc.strerror or exc})"
        self._stored[case] = computed

    def _sample_problem(self, case: Case, stored: StoredRows) -> str | None:
        """Layer 0 of every stored row of ``case`` recomputed with the float64 reference and compared
        (:func:`~ropekv.parity.reference_cache.sample_mismatch`): rows planted in the folder, or written
        by a process whose reference was changed, differ there. None when every row agrees."""
        fresh = self._first_layer_rows(case, sorted(stored.rows))
        for t in sorted(stored.rows):
            why = sample_mismatch(stored.rows[t], fresh[t], DTYPES[self.reference])
            if why is not None:
                return f"position {t}: {why}"
        return None

    def _first_layer_rows(self, case: Case, positions: list[int]) -> dict[int, RefRow]:
        """``case``'s reference rows at ``positions`` through layer 0 only, computed as
        :meth:`_computed_row` computes them whole (their logits left empty)."""
        none = NextToken(torch.empty(0, dtype=DTYPES[self.reference]))
        t0 = time.perf_counter()
        if case.op is not None and ops.needs_own_reference(case):
            out = ops.own_reference(self.decoder, case, self.tokens, num_layers=1)
            outs = {t: out for t in positions}
        else:
            outs = {t: self._first_layer_output(case, t) for t in positions}
        self.seconds["float64_reference_forwards"] += time.perf_counter() - t0
        rows = {}
        for t, out in outs.items():
            if out.rows is None:
                raise UsageError("the reference forward was run without probed rows")
            rows[t] = ops.hide_evicted(case, _row(out.layers, out.rows, _index(out.rows, t), none, case, self.cfg))
        return rows

    def _first_layer_output(self, case: Case, t: int) -> ReferenceOutput:
        """Layer 0 of the plain forward that holds row ``t`` of ``case`` (:meth:`reference_output`'s
        forward, one layer deep), shared by the cases that read the same forward."""
        rows = self._rows_for(self._key(case, t))
        if t not in rows:  # not among its group's rows: a forward of its own
            rows = [t]
        key = (self._group(case), tuple(rows))
        if key not in self._layer0:
            self._layer0[key] = self.decoder.forward(
                self.tokens[: max(rows) + 1],
                probe_rows=rows,
                window=MODEL_WINDOWS if case.window is None else case.window,
                sink_tokens=case.sink_tokens,
                streams=case.position_streams(),
                num_layers=1,
            )
        return self._layer0[key]

    def _width(self, case: Case, t: int, stored_width: int) -> int:
        """Columns of row ``t``'s attention as this check computes them: the own forward of an evict or
        shift case is the case's alone (its stored width); a plain row spans its shared forward."""
        if case.op is not None and ops.needs_own_reference(case):
            return stored_width
        return max(self._rows_for(self._key(case, t))) + 1

    def cache_summary(self) -> dict[str, Any]:
        """The report's ``reference_cache`` block (docs/report.md)."""
        counted = list(self.sources.values())
        return {
            "folder": None if self.store is None else str(self.store.folder),
            "hits": counted.count(HIT),
            "computed": counted.count(COMPUTED),
            "recomputed": counted.count(RECOMPUTED),
            "seconds_saved": self.cache_seconds["saved"],
            "seconds_spent": self.cache_seconds["spent"],
        }

    @staticmethod
    def _group(case: Case) -> _Group:
        return (case.window, case.sink_tokens, case.image)

    def _key(self, case: Case, t: int) -> _Key:
        return (self._group(case), t if self.per_position else None)

    def _rows_for(self, key: _Key) -> list[int]:
        group, t = key
        return [t] if t is not None else sorted(set(self._rows[group]))

    def reference_output(self, case: Case, t: int) -> tuple[ReferenceOutput, int]:
        if case.op is not None and ops.needs_own_reference(case):
            if case not in self._op_ref:
                if self.bar:
                    self.bar.describe(f"float64 reference forward for {case.op.label()}")
                decoder = self.decoder  # built outside the timer: the phase times forwards only
                t0 = time.perf_counter()
                self._op_ref[case] = ops.own_reference(decoder, case, self.tokens)
                self.seconds["float64_reference_forwards"] += time.perf_counter() - t0
                if self.bar:
                    self.bar.advance(max(case.decode_positions) + 1 - case.shift)
            out = self._op_ref[case]
            return out, _index(out.rows, t)
        key = self._key(case, t)
        if key not in self._ref:
            rows = self._rows_for(key)
            n = max(rows) + 1
            if self.bar:
                self.bar.describe(f"float64 reference forward over {n} tokens")
            window = MODEL_WINDOWS if case.window is None else case.window
            decoder = self.decoder
            t0 = time.perf_counter()
            self._ref[key] = decoder.forward(
                self.tokens[:n],
                probe_rows=rows,
                window=window,
                sink_tokens=case.sink_tokens,
                logits_for="probed",
                streams=case.position_streams(),
            )
            self.seconds["float64_reference_forwards"] += time.perf_counter() - t0
            if self.bar:
                self.bar.advance(n)
        out = self._ref[key]
        return out, _index(out.rows, t)

    def reference_row(self, case: Case, t: int) -> RefRow:
        stored = self._stored.get(case)
        if stored is not None and t in stored:
            return stored[t]
        return self._computed_row(case, t)

    def done_with_reference(self, case: Case) -> None:
        """``case``'s reference rows are taken: drop the reference forwards no case still to be judged reads
        (not when its self rows are reference rows too)."""
        if not ops.self_from_reference(case):
            self._release(self._reference_uses(case))
            self._reference_done.add(case)

    def done(self, case: Case) -> None:
        """``case`` is judged: drop every forward no case still to be judged reads."""
        uses = self._uses(case)
        if case in self._reference_done:
            uses -= self._reference_uses(case)
        self._release(uses)

    def _release(self, uses: set[_Use]) -> None:
        for use in uses:
            self._readers[use] -= 1
            if self._readers[use] <= 0:
                what, key = use
                if isinstance(key, Case):
                    self._op_ref.pop(key, None)
                elif what == "reference":
                    self._ref.pop(key, None)
                else:
                    self._self.pop(key, None)

    def _uses(self, case: Case) -> set[_Use]:
        """The forwards judging ``case`` reads (as :meth:`reference_row` and :meth:`self_row` find them)."""
        ref = self._reference_uses(case)
        if ops.self_from_reference(case):
            return ref
        return ref | {("engine", self._key(case, t - case.shift)) for t in case.decode_positions}

    def _reference_uses(self, case: Case) -> set[_Use]:
        if ops.needs_own_reference(case):
            return {("op", case)}
        return {("reference", self._key(case, t)) for t in case.decode_positions}

    def _computed_row(self, case: Case, t: int) -> RefRow:
        out, i = self.reference_output(case, t)
        logits = out.logits[i] if out.probed_logits else out.logits[t - case.shift]
        if out.rows is None:
            raise UsageError("the reference forward was run without probed rows")
        return ops.hide_evicted(case, _row(out.layers, out.rows, i, NextToken(logits), case, self.cfg))

    def self_row(self, case: Case, t: int) -> RefRow:
        if ops.self_from_reference(case):
            return self.reference_row(case, t)
        if case.shift:  # the unshifted forward, relabelled (scores depend on i - j only)
            row = self._plain_self_row(case, t - case.shift, case.shift)
            return row
        return self._plain_self_row(case, t, 0)

    def _plain_self_row(self, case: Case, t: int, relabel: int) -> RefRow:
        key = self._key(case, t)
        if key not in self._self:
            rows = self._rows_for(key)
            n = max(rows) + 1
            if self.bar:
                self.bar.describe(f"engine full forward over {n} tokens")
            group_case = self._cases[self._group(case)]
            t0 = time.perf_counter()
            run = self.adapter.full_forward(self.tokens[:n], rows, group_case)
            self.seconds["engine_full_forwards"] += time.perf_counter() - t0
            self._self[key] = check_full_run(self.adapter, self.tier, self.cfg, group_case, rows, n, run)
            if self.bar:
                self.bar.advance(n)
        run = self._self[key]
        i = _index(run.rows, t)
        ids = None if run.token_ids is None else run.token_ids[i]
        layers = run.layers if self.tier >= Tier.ATTENTION else ()
        if relabel:
            layers = tuple(dataclasses.replace(p, key_positions=p.key_positions + relabel) for p in layers)
        return _row(layers, run.rows + relabel, i, NextToken(run.logits[i], ids), case, self.cfg)


_Group = tuple[int | None, int, ImageGrid | None]  # (window, sink_tokens, image): cases sharing full forwards
_Key = tuple[_Group, int | None]  # a group and, for length-dependent RoPE, the one position t forwarded
_Use = tuple[str, "_Key | Case"]  # ("reference" | "engine", key) or ("op", case): a forward a case reads


def _index(rows: torch.Tensor | None, t: int) -> int:
    """Where position ``t`` is among the probed ``rows [R]``."""
    if rows is None:
        raise UsageError("the forward was run without probed rows")
    return int(torch.nonzero(torch.eq(rows, t))[0, 0])


def _row(
    layers: tuple[LayerProbe, ...], rows: torch.Tensor, i: int, logits: NextToken, case: Case, cfg: ModelConfig
) -> RefRow:
    """Row ``i`` of probed layers: per layer its input and attention logits ``[H, T]`` by position from
    the case's first position (``case.shift``: :attr:`RefRow.origin`)."""
    of = LogitsOf(cfg, case.window, case.sink_tokens)
    r = rows[i : i + 1]
    hidden = tuple(None if p.hidden_in is None else p.hidden_in[i] for p in layers)
    origin = case.shift
    attn = tuple(_dense(of.rows(layer, _at(p, i), r)[:, 0], p.key_positions, origin) for layer, p in enumerate(layers))
    return RefRow(hidden_in=hidden, attn_logits=attn, logits=logits, origin=origin)


def _at(p: LayerProbe, i: int) -> LayerProbe:
    """The probe restricted to query row ``i`` (keys unchanged)."""
    return dataclasses.replace(
        p,
        q=p.q[i : i + 1],
        hidden_in=None if p.hidden_in is None else p.hidden_in[i : i + 1],
        q_raw=None if p.q_raw is None else p.q_raw[i : i + 1],
    )


def _dense(scores: torch.Tensor, key_positions: torch.Tensor, origin: int) -> torch.Tensor:
    """``[H, N]`` scores at ``key_positions`` as ``[H, T]`` indexed by ``position - origin`` (-inf where no
    key). A key before ``origin`` is an error of the caller: every key of the case sits at or past it."""
    cols = key_positions.long() - origin
    if cols.numel() and int(cols.min()) < 0:
        raise UsageError(f"a reference key at position {int(key_positions.min())} is before the row's origin {origin}")
    T = int(cols.max()) + 1
    out = torch.full((scores.shape[0], T), float("-inf"), dtype=scores.dtype)
    out[:, cols] = scores
    return out
