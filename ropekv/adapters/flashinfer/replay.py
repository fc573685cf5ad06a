"""FlashInfer's recorded GPU runs, served to ``ropekv.check`` on CPU at the forensics tier.

A recording (:mod:`~ropekv.adapters.flashinfer.bundle`) holds, per case, decode step and layer, what
the kernel was handed and what it returned. This adapter turns it into the harness's records:

- the keys as the kernel multiplied them come from the isolated-key probe
  (:func:`~ropekv.adapters.flashinfer.probe.recover_keys`). With ``ROPE_LLAMA`` they come back
  relative to the query (the kernel turns both); they are placed at the query's logical position
  ``t`` with the model's RoPE (``k = R(t) r``, ``q = R(t) q_in``), which leaves every score the kernel
  computed unchanged. Scores fix only the difference of the two phases: a kernel that put its query
  at ``t + c`` would show here as every key moved by ``-c``. With ``NONE`` the recovered keys are
  absolute and the query is the one handed in;
- logits: the run's last hidden state through the model's final norm and (tied) head, in float32 on
  CPU (the head's 28 M weights did not travel to the GPU);
- the full forward: the uncached run, its keys probed at its last row.

Each case's notes say how well the probe reproduces the kernel: the kernel's own output and
log-sum-exp against those recomputed from the recovered keys and the stored values.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ...contract import CacheContract
from ...errors import UsageError
from ...models.config import Checkpoint
from ...parity.bug_class import BugClass
from ...parity.cases import Case
from ...parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, LayerProbe, StepRecord, Tier
from .bundle import DTYPE_NAMES, BundleCase, load_recording
from .driver import SETUPS
from .pack import as_case
from .probe import RecoveredKeys, recover_keys

# The verdict each setup must get: None passes; a BugClass fails and is named so.
EXPECTED: dict[str, BugClass | None] = {
    "raw-keys": None,
    "rotated-before-append": BugClass.DOUBLE_ROTATION,
    "rotated-keys": None,
}


class FlashInferReplayAdapter:
    """An :class:`~ropekv.parity.protocol.EngineAdapter` over one recording (one dtype, one setup)."""

    tier = Tier.FORENSICS

    def __init__(self, checkpoint: Checkpoint, recording: str | os.PathLike[str]):
        tensors, meta = load_recording(recording)
        if meta.get("fingerprint") != checkpoint.fingerprint:
            raise UsageError(
                f"{recording}: recorded on model {meta.get('fingerprint')!r}, not this checkpoint "
                f"({checkpoint.fingerprint}); rebuild the truncated model the bundle was packed from"
            )
        try:
            self.setup = SETUPS[meta["setup"]]
            self.dtype = DTYPE_NAMES[meta["dtype"]]
            self.cases = tuple(BundleCase(**c) for c in meta["cases"])
        except (KeyError, TypeError) as exc:
            raise UsageError(f"{recording}: malformed metadata ({exc})") from None
        self.checkpoint = checkpoint
        self.meta = meta
        self._t = tensors
        self.tokens = tensors["tokens"]
        self.file = Path(recording).name
        self.name = f"FlashInfer {meta.get('flashinfer', '?')} paged decode ({self.setup.describe()}; {meta['dtype']})"
        self._last: BundleCase | None = None

    # ------------------------------------------------------------------ protocol

    def describe(self) -> EngineDescription:
        case = self._last or self.cases[0]
        contract = self.contract(as_case(case))
        keep = ("flashinfer", "torch", "cuda", "device", "recorded", "seconds", "compile_seconds")
        return EngineDescription(
            name=self.name,
            key_form=contract.key_form,
            backend="flashinfer-decode-rope-llama" if self.setup.kernel_rotates else "flashinfer-decode-none",
            extra={
                "dtype": self.meta["dtype"],
                "setup": self.setup.name,
                "recording": self.file,
                **{k: self.meta[k] for k in keep if k in self.meta},
                "contract": contract.to_dict(),
            },
        )

    def contract(self, case: Case) -> CacheContract:
        """What the engine declares: raw keys rotated in the kernel on read, by their index in the
        request's KV sequence (``rotation_index="cache"``), or rotated keys the kernel reads as they are.
        ``rotated-before-append`` declares the first and writes rotated keys: that is its bug."""
        raw = self.setup.kernel_rotates
        return CacheContract.for_model(
            self.checkpoint.config,
            key_form="raw" if raw else "rotated",
            block_size=case.block_size,
            dtype=self.meta["dtype"],
            window=None,
            rotation_index="cache" if raw else "logical",
            weights_fingerprint=self.checkpoint.weights_fingerprint,
        )

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        return ()

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        i, bc = self._find(case)
        self._check_tokens(tokens, bc.total)
        self._last = bc
        cfg = self.checkpoint.config
        finals = self._t[f"c{i}.cached.final_hidden"]
        steps, out_err, lse_err, calib = [], 0.0, 0.0, 0.0
        for s in range(bc.decode_steps):
            t = bc.length + s
            layers = []
            for layer in range(cfg.num_layers):
                probe, errs = self._decode_probe(f"c{i}.cached", s, layer, t)
                out_err, lse_err, calib = max(out_err, errs[0]), max(lse_err, errs[1]), max(calib, errs[2])
                layers.append(probe)
            steps.append(StepRecord(position=t, logits=self._head(finals[s : s + 1])[0], layers=tuple(layers)))
        notes = (
            f"replayed from {self.file}: {self.meta.get('flashinfer', '?')} on {self.meta.get('device', '?')}",
            f"probe: kernel output vs recomputed from the recovered keys {out_err:.2e} max abs, "
            f"log-sum-exp {lse_err:.2e}; zero-query calibration {calib:.2e}",
        )
        return CaseRun(tuple(steps), notes=notes)

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        T = tokens.shape[0]
        recorded = self._t["full.rows"].tolist()
        missing = sorted(set(rows) - set(recorded))
        k_in = self._t["full.l0.k_in"]
        if missing or k_in.shape[0] < T:
            raise UsageError(
                f"{self.file}: the full forward was recorded over {k_in.shape[0]} tokens at rows {recorded}"
            )
        self._check_tokens(tokens, T)
        at = [recorded.index(r) for r in rows]
        spec = self.checkpoint.config.rope
        n = k_in.shape[0]
        layers = []
        for layer in range(self.checkpoint.config.num_layers):
            p = f"full.l{layer}"
            keys = self._recovered(p, n).keys
            q_in = self._t[f"{p}.q_in"][at].double()
            if self.setup.kernel_rotates:  # relative to the probe's query at n - 1: placed there
                keys = spec.rotate(keys, torch.full((n,), n - 1))
                q = spec.rotate(q_in, torch.as_tensor(rows))
            else:
                q = q_in
            layers.append(
                LayerProbe(
                    q=q,
                    k=keys[:T],
                    key_positions=torch.arange(T),
                    hidden_in=self._t[f"{p}.hidden_in"][at].float(),
                    q_raw=q_in if self.setup.kernel_rotates else None,
                    v=self._t[f"{p}.v_in"][:T].double(),
                )
            )
        logits = self._head(self._t["full.final_hidden"][at])
        return FullRun(rows=torch.as_tensor(rows), logits=logits, layers=tuple(layers))

    # ------------------------------------------------------------------ pieces

    def _find(self, case: Case) -> tuple[int, BundleCase]:
        for i, bc in enumerate(self.cases):
            if as_case(bc) == case:
                return i, bc
        recorded = ", ".join(as_case(c).label() for c in self.cases)
        raise UsageError(f"{self.file} has no recording of case {case.label()} (recorded: {recorded})")

    def _check_tokens(self, tokens: torch.Tensor, n: int) -> None:
        if tokens.shape[0] < n or not torch.equal(tokens[:n].cpu(), self.tokens[:n]):
            raise UsageError(f"{self.file}: the check's token stream is not the one recorded (another seed?)")

    def _recovered(self, prefix: str, n: int) -> RecoveredKeys:
        cfg = self.checkpoint.config
        alpha = float(self._t[f"{prefix}.probe_alpha"])
        return recover_keys(self._t[f"{prefix}.probe_lse"], alpha, n, cfg.num_kv_heads, cfg.head_dim)

    def _decode_probe(self, run: str, step: int, layer: int, t: int) -> tuple[LayerProbe, tuple[float, float, float]]:
        cfg = self.checkpoint.config
        n = t + 1
        prefix = f"{run}.s{step}.l{layer}"
        rec = self._recovered(prefix, n)
        q_in = self._t[f"{prefix}.q_in"].double()  # [1, H, D]
        v = self._t[f"{run}.l{layer}.v_stored"][:n].double()
        errs = self._consistency(prefix, q_in, rec.keys, v)
        spec = cfg.rope
        if self.setup.kernel_rotates:
            keys = spec.rotate(rec.keys, torch.full((n,), t))
            q = spec.rotate(q_in, torch.tensor([t]))
        else:
            keys, q = rec.keys, q_in
        probe = LayerProbe(
            q=q,
            k=keys,
            key_positions=torch.arange(n),
            key_slots=self._t[f"{run}.slots"][:n].long(),
            hidden_in=self._t[f"{prefix}.hidden_in"].float(),
            q_raw=q_in if self.setup.kernel_rotates else None,
            v=v,
        )
        return probe, (errs[0], errs[1], rec.calibration)

    def _consistency(self, prefix: str, q_in: torch.Tensor, keys: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
        """The kernel's output and log-sum-exp against those of the recovered keys: how faithful the probe is."""
        cfg = self.checkpoint.config
        group = cfg.num_heads // cfg.num_kv_heads
        k = keys.repeat_interleave(group, dim=1)  # [n, H, D]
        vv = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q_in[0], k) * cfg.head_dim**-0.5
        out = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), vv)
        lse2 = torch.logsumexp(scores, dim=-1) / math.log(2.0)
        out_err = float((out - self._t[f"{prefix}.out"][0].double()).abs().max())
        lse_err = float((lse2 - self._t[f"{prefix}.lse"][0].double()).abs().max())
        return out_err, lse_err

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` -> ``[R, vocab]`` float32: the final RMSNorm and the LM head."""
        cfg = self.checkpoint.config
        w = self.checkpoint.weights
        h = hidden.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w["model.norm.weight"]
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return h @ head.T
