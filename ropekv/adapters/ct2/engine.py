"""``CT2Engine``: CTranslate2 (CPU, float32) as a logits-tier ropekv engine adapter.

The model is ``ct2-transformers-converter``'s conversion of a transformers folder (once per folder,
:mod:`ropekv.adapters.converted`), run by ``ctranslate2.Generator``. CTranslate2 exposes no attention
internals, no KV cache and no positions, so ropekv sees next-token logits only:

- each decode step at position ``t`` is one ``generate_batch`` request over ``tokens[P : t + 1]`` with
  ``include_prompt_in_result=False``: CTranslate2 forwards the prompt but its last token at once
  (filling its KV cache), then decodes that last token as its first step, whose logits
  (``return_logits_vocab``) are compared. A prefix hit (``P > 0``) is CTranslate2's static-prompt
  cache: an earlier request with ``static_prompt=tokens[:P]`` and ``cache_static_prompt=True`` leaves
  the prefix's state cached, and every step reuses it;
- the full forward is ``forward_batch``: every row's logits without a cache.

What it cannot show: consecutive decode steps through one cache (each step is a request of its own),
chunked prefill (no API splits a prompt), windows a case sets (none to set), and anything below the
logits: a divergence is localized to a step, never to a layer or a bug class.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from ...errors import EngineUnavailable, UsageError
from ...models import load_checkpoint
from ...models.config import Checkpoint
from ...parity.cases import Case
from ...parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, StepRecord, Tier
from ..converted import converted


def _ct2():
    try:
        import ctranslate2
    except ImportError as exc:
        raise EngineUnavailable(
            f"ctranslate2 is not installed here (make setup-ct2; run from .venv-ct2): {exc}"
        ) from None
    return ctranslate2


def checkpoint_folder(model: str | Path | None) -> Path:
    """An embedded model's converted folder (None: the default) or the transformers folder ``model``."""
    from ...models.embedded import is_embedded_name

    if model is None or is_embedded_name(model):
        from ...models.default import default_checkpoint_dir

        return default_checkpoint_dir(None if model is None else str(model))
    path = Path(model)
    if not path.is_dir():
        raise UsageError(f"--engine ct2 converts a transformers folder (config.json + safetensors); {model} is not one")
    return path


class CT2Engine:
    """CTranslate2 on the conversion of ``model`` (None: the embedded default model)."""

    tier = Tier.LOGITS

    def __init__(self, model: str | Path | None = None, *, threads: int = 2, name: str | None = None):
        if not isinstance(threads, int) or threads < 1 or threads > 256:
            raise UsageError(f"--ct2-threads must be an integer in [1, 256], got {threads!r}")
        ct2 = _ct2()
        self.folder = checkpoint_folder(model)
        self.checkpoint: Checkpoint = load_checkpoint(model)
        self.config = self.checkpoint.config
        self.dtype = torch.float32
        self.converted = converted(
            self.folder,
            engine="ct2",
            version=ct2.__version__,
            command=lambda src, out: [
                sys.executable,
                "-m",
                "ctranslate2.converters.transformers",
                "--model",
                str(src),
                "--output_dir",
                str(out),
                "--force",
            ],
            done="model.bin",
        )
        vocab = json.loads((self.converted / "vocabulary.json").read_text())
        if len(vocab) < self.config.vocab_size:
            raise UsageError(f"CTranslate2's vocabulary has {len(vocab)} tokens, the model {self.config.vocab_size}")
        self._vocab: list[str] = vocab
        self._ct2 = ct2
        self.threads = threads
        self._generator = ct2.Generator(
            str(self.converted), device="cpu", compute_type="float32", intra_threads=threads
        )
        self.name = name or f"CTranslate2 {ct2.__version__} (CPU, float32)"

    def describe(self) -> EngineDescription:
        return EngineDescription(
            name=self.name,
            key_form="rotated",
            extra={
                "engine": "ctranslate2",
                "ctranslate2": self._ct2.__version__,
                "model": str(self.converted),
                "compute_type": "float32",
                "intra_threads": self.threads,
                "tier": str(self.tier),
            },
        )

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        out = [Ignored("block_size", "block_size (CTranslate2 keeps its own cache)")]
        if case.window is not None:
            out.append(Ignored("window", "window (CTranslate2 applies only the model's own windows)"))
        if case.sink_tokens:
            out.append(Ignored("sink_tokens"))
        if case.chunk is not None:
            out.append(Ignored("chunk", "chunk (CTranslate2 forwards a prompt at once)"))
        return tuple(out)

    def _strings(self, ids: list[int]) -> list[str]:
        return [self._vocab[i] for i in ids]

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        ids = [int(t) for t in tokens.tolist()]
        prefix = self._strings(ids[: case.prefix])
        kwargs: dict = {}
        notes = []
        if case.prefix:
            kwargs = {"static_prompt": prefix, "cache_static_prompt": True}
            vocab = self.config.vocab_size
            other = self._strings([(t + 1) % vocab for t in ids[:3]])
            self._generator.generate_batch([other], max_length=1, **kwargs)  # the earlier request
            notes.append(f"prefix: {case.prefix} tokens from CTranslate2's static-prompt cache of an earlier request")
        notes.append("each decode step is a request of its own: prefill, then one cached decode step")
        steps = []
        for t in case.decode_positions:
            result = self._generator.generate_batch(
                [self._strings(ids[case.prefix : t + 1])],
                max_length=1,
                return_logits_vocab=True,
                include_prompt_in_result=False,
                **kwargs,
            )
            logits = torch.from_numpy(np.array(result[0].logits[0], dtype=np.float32).reshape(-1))
            steps.append(StepRecord(position=t, logits=logits))
        return CaseRun(steps=tuple(steps), notes=tuple(notes))

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        ids = [int(t) for t in tokens.tolist()]
        logits = np.array(self._generator.forward_batch([self._strings(ids)]), dtype=np.float32)[0]  # [T, vocab]
        return FullRun(rows=torch.as_tensor(rows, dtype=torch.int64), logits=torch.from_numpy(logits[rows]))
