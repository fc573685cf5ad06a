"""Tier-by-tier comparison of one vLLM case with ropekv's float64 reference and with vLLM's own full
forward, written for these tests (the harness's ``ropekv.check`` does the same for the report).

Every figure is measured against something the adapter did not compute: the reference decoder run on
ropekv's own reading of the checkpoint, or vLLM's ``prompt_logprobs`` request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ropekv.adapters.vllm.topk import topk_error, topk_error_vs_logits
from ropekv.models.reference import ReferenceDecoder, ReferenceOutput
from ropekv.parity.cases import Case
from ropekv.parity.compare import scaled_error
from ropekv.parity.protocol import CaseRun, FullRun
from ropekv.parity.recorder import attention_logits


@dataclass(frozen=True)
class CaseErrors:
    case: Case
    logits_ref: tuple[float, ...]  # per step: top-k log-probabilities vs the float64 reference
    logits_self: tuple[float, ...]  # per step: vs vLLM's prompt_logprobs of the same sequence
    attn_ref: tuple[tuple[float, ...], ...]  # per step, per layer: attention logits vs the reference
    attn_self: tuple[tuple[float, ...], ...]  # per step, per layer: vs vLLM's full forward
    hidden_ref: tuple[tuple[float, ...], ...]  # per step, per layer: layer input vs the reference

    @property
    def worst(self) -> dict[str, float]:
        flat = lambda rows: max(max(r) for r in rows)
        return {
            "logits_ref": max(self.logits_ref),
            "logits_self": max(self.logits_self),
            "attn_ref": flat(self.attn_ref),
            "attn_self": flat(self.attn_self),
            "hidden_ref": flat(self.hidden_ref),
        }

    def first_bad_layer(self, tol: float) -> int | None:
        for layers in self.attn_ref:
            for i, e in enumerate(layers):
                if e > tol:
                    return i
        return None


def reference(engine, tokens: torch.Tensor, rows: list[int]) -> ReferenceOutput:
    return ReferenceDecoder(engine.checkpoint).forward(tokens, probe_rows=rows)


def compare(engine, case: Case, run: CaseRun, full: FullRun, ref: ReferenceOutput) -> CaseErrors:
    cfg = engine.checkpoint.config
    scale = cfg.head_dim**-0.5
    rows = full.rows.tolist()
    l_ref, l_self, a_ref, a_self, h_ref = [], [], [], [], []
    ref_rows = ref.rows.tolist()
    ref_attn = [attention_logits(p, ref.rows, scale=scale) for p in ref.layers]  # per layer [H, R, T]
    for step in run.steps:
        t = step.position
        r = rows.index(t)
        ref_row = ref_rows.index(t)
        l_ref.append(topk_error_vs_logits(step.token_ids, step.logits, ref.logits[t]))
        l_self.append(topk_error(step.token_ids, step.logits, full.token_ids[r], full.logits[r]))
        qpos = torch.tensor([t])
        ar, asf, hr = [], [], []
        for probe, full_probe, ref_probe, ref_logits in zip(step.layers, full.layers, ref.layers, ref_attn):
            mine = attention_logits(probe, qpos, scale=scale, mask_by_position=False)[:, 0]  # [H, N]
            kpos = probe.key_positions
            ar.append(scaled_error(mine, ref_logits[:, ref_row, kpos]))
            own = attention_logits(full_probe, full.rows, scale=scale)[:, r]  # [H, T]
            asf.append(scaled_error(mine, own[:, kpos]))
            hr.append(scaled_error(probe.hidden_in[0], ref_probe.hidden_in[ref_row]))
        a_ref.append(tuple(ar)), a_self.append(tuple(asf)), h_ref.append(tuple(hr))
    return CaseErrors(case, tuple(l_ref), tuple(l_self), tuple(a_ref), tuple(a_self), tuple(h_ref))


def run_and_compare(engine, case: Case, tokens: torch.Tensor) -> tuple[CaseErrors, CaseRun]:
    run = engine.run_case(case, tokens)
    rows = case.decode_positions
    full = engine.full_forward(tokens[: case.total], rows, case)
    ref = reference(engine, tokens[: case.total], rows)
    return compare(engine, case, run, full, ref), run
