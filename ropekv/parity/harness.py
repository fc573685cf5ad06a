"""``ropekv.check``: cached prefill + decode against full forwards, layer by layer.

For every case the adapter runs the cached path; each decode step's per-layer inputs and attention
logits are compared with (a) the engine's own full forward (self-parity) and (b) ropekv's independent
float64 reference decoder on the same checkpoint. For RoPE whose frequencies do not depend on length,
one full forward over the longest sequence serves every case with the same window (row ``t`` of a
causal forward is the reference for position ``t``); for dynamic NTK and LongRoPE each decode position
``t`` gets its own full forward over exactly ``t + 1`` tokens.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from ..adapters.base import CaseRun, EngineAdapter, FullRun
from ..errors import UsageError
from ..models.config import Checkpoint
from ..models.reference import ReferenceDecoder, ReferenceOutput
from . import forensics  # noqa: F401  (written in parallel)
from .cases import Case, build_matrix, token_stream
from .compare import (RefRow, StepErrors, Tolerance, compare_step, first_failure, scaled_error, tolerance_for,
                      worst_entry)
from .progress import Progress
from .report import CaseResult, Diagnosis, Divergence, ParityReport

_MAX_FORENSIC_CASES = 6
_REFERENCE_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def check(engine: EngineAdapter | Checkpoint, *, lengths=None, block_sizes=None, prefix_offsets=None, window=None,
          sink_tokens: int = 0, chunk=None, decode_steps=None, dtype: str | None = None, reference: str = "float64",
          key_form: str | None = None, backend: str | None = None, seed: int = 0, cases: list[Case] | None = None,
          progress: bool = False) -> ParityReport:
    """Run the parity matrix on ``engine`` and return a :class:`ParityReport`.

    ``engine`` is an adapter (see ``ropekv.adapters.base.EngineAdapter``) or a checkpoint, for which
    ropekv's own engine is used with ``key_form``/``backend``/``dtype``. The other keywords mean what
    the CLI flags of the same name mean; None means the default matrix.
    """
    adapter = _as_adapter(engine, dtype=dtype, key_form=key_form, backend=backend)
    if reference not in _REFERENCE_DTYPES:
        raise UsageError(f"reference must be one of {', '.join(_REFERENCE_DTYPES)}, got {reference!r}")
    cfg = adapter.checkpoint.config
    if cases is None:
        cases = build_matrix(lengths=lengths, block_sizes=block_sizes, prefix_offsets=prefix_offsets, window=window,
                             sink_tokens=sink_tokens, chunk=chunk, decode_steps=decode_steps,
                             max_positions=cfg.position_limit)
    if not cases:
        raise UsageError("no parity cases to run")
    started = time.perf_counter()
    tokens = token_stream(cfg.vocab_size, max(c.total for c in cases), seed)
    refs = _References(adapter, ReferenceDecoder(adapter.checkpoint, dtype=_REFERENCE_DTYPES[reference]), tokens, cases)
    tol_ref = tolerance_for(adapter.dtype, _REFERENCE_DTYPES[reference])
    tol_self = tolerance_for(adapter.dtype, adapter.dtype)

    results, failed = [], []
    with Progress(total=refs.work + sum(c.total for c in cases), enabled=progress) as bar:
        refs.bar = bar
        for case in cases:
            bar.describe(f"case {case.label()}")
            t0 = time.perf_counter()
            run = adapter.run_case(case, tokens)
            bar.advance(case.total)
            ref_rows = [refs.reference_row(case, s.position) for s in run.steps]
            self_rows = [refs.self_row(case, s.position) for s in run.steps]
            err_ref = [compare_step(s, r) for s, r in zip(run.steps, ref_rows)]
            err_self = [compare_step(s, r) for s, r in zip(run.steps, self_rows)]
            full_err = max(_rows_error(a, b) for a, b in zip(self_rows, ref_rows))
            fail_ref, fail_self = first_failure(err_ref, tol_ref), first_failure(err_self, tol_self)
            divergence = None
            if fail_ref is not None:
                divergence = _divergence("reference", fail_ref, run, ref_rows, err_ref, tol_ref)
            elif fail_self is not None:
                divergence = _divergence("self", fail_self, run, self_rows, err_self, tol_self)
            result = CaseResult(
                case=case, passed=fail_ref is None and fail_self is None, reference_passed=fail_ref is None,
                self_passed=fail_self is None, max_abs_logit_diff=max(e.max_abs_logit_diff for e in err_ref),
                max_attn_error=_max(err_ref), max_self_attn_error=_max(err_self), first_divergence=divergence,
                positions=tuple(s.position for s in run.steps),
                attn_errors=tuple(e.attn for e in err_ref), self_attn_errors=tuple(e.attn for e in err_self),
                ignored=tuple(adapter.ignored(case)), full_forward_error=full_err,
                seconds=time.perf_counter() - t0)
            results.append(result)
            if not result.passed and len(failed) < _MAX_FORENSIC_CASES:
                failed.append((result, run))
        diagnosis = None
        # Forensics reads phases, and a query at position 1 or 2 has hardly turned (with theta = 1e5
        # most channel pairs stay put, so a wrong pairing looks like no rotation at all). The failing
        # case that diverged at the highest position carries the most evidence; the others follow.
        failed.sort(key=lambda item: -item[0].first_divergence.query_position if item[0].first_divergence else 0)
        for result, run in failed:
            bar.describe("forensics")
            found = _diagnose(adapter, refs, result, run)
            if diagnosis is None or diagnosis.kind == "unknown":
                diagnosis = found if diagnosis is None or found.kind != "unknown" else diagnosis
            if diagnosis.kind != "unknown":
                break
    ckpt = adapter.checkpoint
    return ParityReport(
        passed=all(r.passed for r in results),
        model={"name": cfg.name, "architecture": cfg.architecture, "fingerprint": ckpt.fingerprint,
               "source": ckpt.source, "rope": cfg.rope.to_dict(), "rope_fingerprint": cfg.rope.fingerprint()},
        engine=adapter.describe(), reference=reference,
        tolerances={"reference": tol_ref.to_dict(), "self": tol_self.to_dict()},
        cases=tuple(results), diagnosis=diagnosis, seconds=time.perf_counter() - started, seed=seed)


def _as_adapter(engine: Any, *, dtype, key_form, backend) -> EngineAdapter:
    if isinstance(engine, Checkpoint):
        from ..adapters.native import NativeAdapter

        return NativeAdapter(engine, key_form=key_form or "rotated", backend=backend, dtype=dtype or "float32")
    if not isinstance(engine, EngineAdapter):
        raise UsageError(f"check() needs an engine adapter or a checkpoint, got {type(engine).__name__}")
    given = {"dtype": dtype, "key_form": key_form, "backend": backend}
    for name, value in given.items():
        have = getattr(engine, name if name != "dtype" else "dtype_name", None)
        if value is not None and have is not None and value != have:
            raise UsageError(f"{name}={value!r} conflicts with the adapter's {name} {have!r}")
    return engine


def _rows_error(engine_row: RefRow, ref_row: RefRow) -> float:
    """Cross-engine parity without any cache: the engine's own full forward against the float64
    reference at the same row, worst over layers (attention logits) and the final logits."""
    errs = [scaled_error(a, b) for a, b in zip(engine_row.attn_logits, ref_row.attn_logits)]
    return max(errs + [scaled_error(engine_row.logits, ref_row.logits)])


def _max(errors: list[StepErrors]) -> float:
    return max((max(e.attn) for e in errors), default=0.0)


class _References:
    """Full forwards (float64 reference and the engine's own), computed once per window and reused."""

    def __init__(self, adapter: EngineAdapter, decoder: ReferenceDecoder, tokens: torch.Tensor, cases: list[Case]):
        self.adapter, self.decoder, self.tokens = adapter, decoder, tokens
        self.per_position = adapter.checkpoint.config.rope.length_dependent
        self.bar = None
        self._rows: dict[tuple, list[int]] = {}
        self._cases: dict[tuple, Case] = {}
        for c in cases:
            self._rows.setdefault(self._group(c), []).extend(c.decode_positions)
            self._cases.setdefault(self._group(c), c)
        self._ref: dict[tuple, ReferenceOutput] = {}
        self._self: dict[tuple, FullRun] = {}
        if self.per_position:
            self.work = 2 * sum(t + 1 for rows in self._rows.values() for t in set(rows))
        else:
            self.work = 2 * sum(max(rows) + 1 for rows in self._rows.values())

    @staticmethod
    def _group(case: Case) -> tuple:
        return (case.window, case.sink_tokens)

    def _key(self, case: Case, t: int) -> tuple:
        return self._group(case) + ((t,) if self.per_position else ())

    def _rows_for(self, key: tuple) -> list[int]:
        return [key[-1]] if self.per_position else sorted(set(self._rows[key]))

    def reference_output(self, case: Case, t: int) -> tuple[ReferenceOutput, int]:
        key = self._key(case, t)
        if key not in self._ref:
            rows = self._rows_for(key)
            n = max(rows) + 1
            if self.bar:
                self.bar.describe(f"float64 reference over {n} tokens")
            window = "model" if case.window is None else case.window
            self._ref[key] = self.decoder.forward(self.tokens[:n], probe_rows=rows, window=window,
                                                  sink_tokens=case.sink_tokens)
            if self.bar:
                self.bar.advance(n)
        out = self._ref[key]
        return out, int((out.layers[0].rows == t).nonzero()[0, 0])

    def reference_row(self, case: Case, t: int) -> RefRow:
        out, i = self.reference_output(case, t)
        return RefRow(hidden_in=tuple(l.hidden_in[i] for l in out.layers),
                      attn_logits=tuple(l.attn_logits[:, i] for l in out.layers), logits=out.logits[t])

    def self_row(self, case: Case, t: int) -> RefRow:
        key = self._key(case, t)
        if key not in self._self:
            rows = self._rows_for(key)
            n = max(rows) + 1
            if self.bar:
                self.bar.describe(f"engine full forward over {n} tokens")
            self._self[key] = self.adapter.full_forward(self.tokens[:n], rows, self._cases[self._group(case)])
            if self.bar:
                self.bar.advance(n)
        run = self._self[key]
        i = int((run.rows == t).nonzero()[0, 0])
        return RefRow(hidden_in=tuple(h[i] for h in run.hidden_in),
                      attn_logits=tuple(a[:, i] for a in run.attn_logits), logits=run.logits[i])


def _divergence(against: str, where: tuple[int, int], run: CaseRun, rows: list[RefRow], errors: list[StepErrors],
                tol: Tolerance) -> Divergence:
    s, layer = where
    view = run.steps[s].layers[layer]
    ref_attn = rows[s].attn_logits[layer][:, view.key_positions]
    head, k, cached, refv = worst_entry(view.attn_logits, ref_attn)
    input_err = errors[s].hidden[layer]
    return Divergence(against=against, step=s, query_position=run.steps[s].position, layer=layer, head=head,
                      key_position=int(view.key_positions[k]), key_slot=int(view.key_slots[k]),
                      reference_logit=refv, cached_logit=cached, attn_error=errors[s].attn[layer],
                      input_error=input_err, input_matched=input_err <= tol.hidden)


def _diagnose(adapter: EngineAdapter, refs: _References, result: CaseResult, run: CaseRun) -> Diagnosis:
    fd = result.first_divergence
    if fd is None:
        return Diagnosis("unknown", "the final logits diverged but no layer's attention did")
    view = run.steps[fd.step].layers[fd.layer]
    if view.q_eff is None or view.k_eff is None:
        return Diagnosis("unknown", f"{adapter.name} does not expose the query and keys its kernel used")
    out, i = refs.reference_output(result.case, fd.query_position)
    probe = out.layers[fd.layer]
    case = result.case
    inp = forensics.ForensicInput(
        rope=adapter.checkpoint.config.rope, q_raw=probe.q_raw[i], q_eff=view.q_eff,
        k_raw=probe.k_raw[view.key_positions], k_eff=view.k_eff, query_position=fd.query_position,
        key_positions=view.key_positions, key_slots=view.key_slots, fork_offset=case.prefix,
        # Even where the adapter ignores block sizes, the case's block size is the hypothesis to test:
        # an engine with its own blocks may still rotate keys by their offset inside one.
        block_size=case.block_size,
        handoff_len=run.handoff_len, self_parity_passed=result.self_passed, seq_len=fd.query_position + 1)
    d = forensics.diagnose(inp)
    kind, evidence = d.kind, d.evidence
    if kind == "unknown" and inp.rope.length_dependent and fd.layer > 0:
        # Layer 0 matched and this layer's rotations are right: what differs is the cached prefix itself,
        # whose deeper keys and values were computed under an earlier length's frequencies. A full
        # forward over t + 1 tokens recomputes them; no cache can (docs/contract.md).
        kind = "stale_dynamic_scaling"
        evidence = (f"layer 0 matches and layer {fd.layer} turns keys at the current frequencies, but its cached "
                    f"keys and values come from hidden states computed under an earlier length's frequencies "
                    f"(inherent to caching {inp.rope.scaling.rope_type} RoPE past position "
                    f"{inp.rope.max_position_embeddings}); {evidence}")
    details = dict(d.details)
    details.update({"case": case.label(), "layer": fd.layer, "query_position": fd.query_position,
                    "query_effective": d.query_effective, "fit": _finite(d.fit)})
    return Diagnosis(kind, evidence, details)


def _finite(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
