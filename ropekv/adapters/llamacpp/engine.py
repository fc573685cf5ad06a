"""``LlamaCppEngine``: llama.cpp (through llama-cpp-python) as a ropekv engine adapter.

Three contexts on one loaded model:

- the ``Llama`` object's own (public API, ``logits_all=True``): the logits tier's cached path, with
  llama-cpp-python's own prefix reuse (``n_tokens`` set back to ``P``; ``eval`` then drops the cached
  tokens past it, as ``Llama.generate`` does on a prompt-prefix match);
- a tapped context with the same ``n_batch`` (attention tier and above): the same cached path through
  ``llama_batch_init`` with explicit positions, the eval callback recording what each decode step's
  kernels saw (:mod:`.tap`);
- a tapped context whose batch holds the whole sequence: the engine's own cache-free full forward
  (one ubatch, every row computed from fresh keys).

Keys are rotated before they are cached (llama.cpp's convention), with llama.cpp's interleaved
("NORM") pairing for the llama arch: :attr:`checkpoint` is the GGUF read with ``layout="gptj"``, the
rows as stored, so ropekv's reference computes the same channel order as the engine's tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ...errors import AdapterError, CheckpointError, EngineUnavailable, UsageError
from ...models.gguf_file import file_sha256, load_gguf, open_gguf
from ...parity.cases import Case
from ...parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, StepRecord, Tier
from ...probe import LayerProbe
from .context import ContextSpec, TappedContext
from .rope_params import RopeOverrides
from .tap import Capture, GraphTap, visible_cells
from .tolerance import KV_TYPES, tolerance_for_run, weights_name

_GGML_TYPE = {"f32": 0, "f16": 1, "q8_0": 8}
# Architectures llama.cpp rotates with its "NORM" (interleaved) RoPE; every other one ropekv reads
# (qwen2, qwen3, gemma3) runs NEOX (half-split) pairs on rows stored unpermuted (llama_model_rope_type).
_NORM_ROPE_ARCHITECTURES = ("llama",)
_FILE_FINGERPRINTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256[:16]


def rope_layout(reader) -> str:
    """The Q/K layout llama.cpp computes for the GGUF's architecture: ``"gptj"`` (interleaved pairs,
    rows as stored) for llama, ``"neox"`` for the others."""
    field = reader.fields.get("general.architecture")
    arch = str(field.contents()) if field is not None else ""
    return "gptj" if arch in _NORM_ROPE_ARCHITECTURES else "neox"


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:
        raise EngineUnavailable(
            f"llama-cpp-python is not installed here (make setup-llamacpp; run from .venv-llamacpp): {exc}"
        ) from None
    return llama_cpp


class LlamaCppEngine:
    """llama.cpp on a GGUF file; ``gguf_path=None`` is the embedded default model as an all-float32 GGUF.

    ``type_k``/``type_v``: KV cache types (``"f32"``, ``"f16"``); ``n_batch``: llama.cpp's batch (logical
    and physical), so a prompt longer than it is prefilled in several ubatches; ``n_ctx``: KV cells.
    """

    name: str
    tier: Tier
    last_shifts_seen: int = 0  # KV shifts the graph tap saw in the latest shifted step (shift.py)

    def __init__(
        self,
        gguf_path: str | os.PathLike | None = None,
        *,
        type_k: str = "f32",
        type_v: str = "f32",
        n_batch: int = 512,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        tier: Tier | str = Tier.FORENSICS,
        name: str | None = None,
    ):
        for what, value in (("type_k", type_k), ("type_v", type_v)):
            if value not in KV_TYPES:
                raise UsageError(f"llama.cpp {what} must be one of {', '.join(KV_TYPES)}, got {value!r}")
        if n_batch < 1 or n_ctx < 16:
            raise UsageError(f"llama.cpp needs n_batch >= 1 and n_ctx >= 16, got {n_batch}, {n_ctx}")
        llama_cpp = _llama_cpp()
        from .f32_gguf import default_f32_gguf
        from .ggml import Ggml

        self.gguf_path = Path(gguf_path) if gguf_path is not None else default_f32_gguf()
        self.tier = Tier(tier)
        self.type_k, self.type_v, self.n_batch, self.n_ctx = type_k, type_v, n_batch, n_ctx
        # One thread by default: ggml's workers spin at barriers, and on a shared 2-core machine two
        # spinning threads ran the same case 10x slower than one (docs/engines/llamacpp.md).
        self.n_threads = n_threads or 1
        # ropekv's own loader first: a bad file is a one-line CheckpointError before llama.cpp sees it.
        reader = open_gguf(self.gguf_path)
        self.weights = weights_name(reader)
        self.layout = rope_layout(reader)
        self.checkpoint = load_gguf(self.gguf_path, layout=self.layout)
        self.dtype = torch.float32 if type_k == "f32" else torch.float16
        self.tolerance = tolerance_for_run(self.weights, type_k, type_v)
        self.name = name or f"llama.cpp ({self.weights} weights, {type_k}/{type_v} KV, n_batch {n_batch})"
        self.config = self.checkpoint.config
        try:
            self._llm = llama_cpp.Llama(
                model_path=str(self.gguf_path),
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_ubatch=n_batch,
                logits_all=True,
                type_k=_GGML_TYPE[type_k],
                type_v=_GGML_TYPE[type_v],
                flash_attn=False,
                n_threads=self.n_threads,
                n_threads_batch=self.n_threads,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{self.gguf_path}: llama.cpp cannot load it: {exc}") from None
        self._lib = Ggml(Path(llama_cpp.__file__).parent / "lib")
        self._lib.check_layout()
        layers = self.config.num_layers
        self.tap = GraphTap(self._lib, layers)  # the cached path's context
        self.full_tap = GraphTap(self._lib, layers)  # the full forward's context
        self._cached = self._context(n_batch, self.tap) if self.tier >= Tier.ATTENTION else None
        self._full: TappedContext | None = None  # made at the first full forward (its buffers fit n_ctx tokens)

    def _context(self, n_batch: int, tap: GraphTap) -> TappedContext:
        return self.context(n_batch, tap)

    def context(
        self, n_batch: int, tap: GraphTap, *, rope: RopeOverrides | None = None, swa_full: bool = True
    ) -> TappedContext:
        """A new llama.cpp context on the loaded model (this engine's KV types, cells and threads),
        observed by ``tap``; ``rope``: the context's RoPE settings (default: the model's); ``swa_full``:
        llama.cpp's sliding-layer cache size (:class:`ContextSpec`)."""
        spec = ContextSpec(
            n_ctx=self.n_ctx,
            n_batch=n_batch,
            type_k=_GGML_TYPE[self.type_k],
            type_v=_GGML_TYPE[self.type_v],
            n_threads=self.n_threads,
            rope=rope or RopeOverrides(),
            swa_full=swa_full,
        )
        return TappedContext(self._llm._model, spec, tap, self.name)

    def new_tap(self) -> GraphTap:
        """A graph tap for a context of this engine (:meth:`context`)."""
        return GraphTap(self._lib, self.config.num_layers)

    def model_file_fingerprint(self) -> str:
        """The first 16 hex digits of the GGUF file's sha256 (computed once per file version)."""
        st = self.gguf_path.stat()
        key = (str(self.gguf_path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _FILE_FINGERPRINTS:
            _FILE_FINGERPRINTS[key] = file_sha256(self.gguf_path)[:16]
        return _FILE_FINGERPRINTS[key]

    # ------------------------------------------------------------------ protocol

    def describe(self) -> EngineDescription:
        import llama_cpp

        return EngineDescription(
            key_form="rotated",
            extra={
                "engine": "llama.cpp",
                "llama_cpp_python": llama_cpp.__version__,
                "gguf": str(self.gguf_path),
                "weights": self.weights,
                "type_k": self.type_k,
                "type_v": self.type_v,
                "n_batch": self.n_batch,
                "n_ubatch": self.n_batch,
                "n_ctx": self.n_ctx,
                "flash_attn": False,
                "n_threads": self.n_threads,
                "rope_pairing": "interleaved (llama.cpp NORM = ropekv 'gptj')",
                "rope_theta": self.config.rope.theta,
                "tier": str(self.tier),
                "tolerance": self.tolerance.to_dict(),
                "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            },
        )

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        out = [Ignored("block_size")]  # llama.cpp allocates single cells, not blocks
        if case.window is not None:
            out.append(Ignored("window"))  # llama.cpp applies only the model's own sliding window (none for llama)
        if case.sink_tokens:
            out.append(Ignored("sink_tokens"))
        if case.positions_needed > self.n_ctx:  # the context's cells bound what one sequence can hold
            out.append(
                Ignored("length", f"length (the case needs {case.positions_needed} cells; n_ctx is {self.n_ctx})")
            )
        return tuple(out)

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        ids = [int(t) for t in tokens.tolist()]
        self._check_fits(case.total)
        if self.tier >= Tier.ATTENTION:
            return self._run_tapped(case, ids)
        return self._run_public(case, ids)

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        ids = [int(t) for t in tokens.tolist()]
        T = len(ids)
        self._check_fits(T)
        if self._full is None:
            self._full = self._context(self.n_ctx, self.full_tap)
        ctx, tap = self._full, self.full_tap
        ctx.clear()
        outputs = [False] * T
        for r in rows:
            outputs[r] = True
        tap.start(rows=list(rows))
        ctx.decode(ids, list(range(T)), outputs)
        cap = tap.stop()
        logits = torch.from_numpy(np.stack([ctx.logits(r) for r in rows]))
        layers: tuple[LayerProbe, ...] = ()
        if self.tier >= Tier.ATTENTION:
            layers = tuple(self._full_layer(cap, tap, i, T) for i in range(self.config.num_layers))
        return FullRun(rows=torch.as_tensor(rows, dtype=torch.int64), logits=logits, layers=layers)

    def _full_layer(self, cap: Capture, tap: GraphTap, layer: int, T: int) -> LayerProbe:
        """Layer ``layer`` of a full forward: every key of the sequence (ropekv masks by position).

        The last row of a full layer's mask sees every key; a sliding layer's sees only its window, so
        the keys are every cell this forward wrote in the layer's cache, which the mask of some row
        shows (checked: the union of the rows' visible cells)."""
        cells_map = tap.layer_cells[layer]
        cells = np.array(sorted(cells_map, key=lambda c: cells_map[c]), dtype=np.int64)
        positions = np.array([cells_map[int(c)] for c in cells], dtype=np.int64)
        if positions.tolist() != list(range(T)):
            raise AdapterError(
                self.name, f"layer {layer} cells of a full forward", f"positions 0..{T - 1}", str(positions[:8])
            )
        seen = np.isfinite(self._mask(cap, layer)[:T]).any(axis=0)
        if not seen[cells].all():
            raise AdapterError(
                self.name, f"layer {layer} full-forward mask", "every written cell visible to some row", "not"
            )
        return LayerProbe(
            q=torch.from_numpy(cap.q[layer]),
            k=torch.from_numpy(cap.k_cache[layer][cells]),
            key_positions=torch.from_numpy(positions),
            key_slots=torch.from_numpy(cells),
            hidden_in=torch.from_numpy(cap.hidden[layer]),
            q_raw=torch.from_numpy(cap.q_raw[layer]),
        )

    # ------------------------------------------------------------------ the cached path

    def _parent(self, case: Case, tokens: list[int]) -> list[int]:
        """An earlier request: the case's prefix, then a different continuation that must not leak."""
        vocab = self.config.vocab_size
        return tokens[: case.prefix] + [(t + 1) % vocab for t in tokens[:3]]

    def _chunks(self, case: Case, tokens: list[int]) -> list[list[int]]:
        prompt = tokens[case.prefix : case.prefix + case.length]
        size = case.chunk or len(prompt)
        return [prompt[i : i + size] for i in range(0, len(prompt), size)]

    def _run_public(self, case: Case, tokens: list[int]) -> CaseRun:
        llm = self._llm
        llm.reset()
        notes = []
        if case.prefix:
            llm.eval(self._parent(case, tokens))
            llm.n_tokens = case.prefix  # llama-cpp-python's prefix reuse: eval drops cached tokens past it
            notes.append(f"llama.cpp kept {case.prefix} cached prompt tokens of an earlier request (seq_rm past them)")
        for chunk in self._chunks(case, tokens):
            llm.eval(chunk)
        steps = []
        for t in case.decode_positions:
            llm.eval([tokens[t]])
            steps.append(StepRecord(position=t, logits=torch.from_numpy(np.array(llm.scores[llm.n_tokens - 1]))))
        return CaseRun(steps=tuple(steps), notes=tuple(notes))

    def _run_tapped(self, case: Case, tokens: list[int]) -> CaseRun:
        ctx = self._cached
        assert ctx is not None  # made at construction for the attention tier and above
        ctx.clear()
        notes = []
        if case.prefix:
            ctx.prefill(self._parent(case, tokens), 0)
            ctx.remove_from(case.prefix)
            notes.append(
                f"llama.cpp kept {case.prefix} cached prompt tokens of an earlier request "
                "(llama_memory_seq_rm past them)"
            )
        start = case.prefix
        for chunk in self._chunks(case, tokens):
            ctx.prefill(chunk, start)
            start += len(chunk)
        steps = [self.decode_step(ctx, tokens[t], t) for t in case.decode_positions]
        return CaseRun(steps=tuple(steps), notes=tuple(notes))

    def decode_step(self, ctx: TappedContext, token: int, position: int, *, keep_scores: bool = False) -> StepRecord:
        """Decode one token at ``position`` on ``ctx`` and return what each layer's kernel saw."""
        tap = ctx.tap
        tap.start(keep_scores=keep_scores)
        ctx.decode([token], [position], [True])
        cap = tap.stop()
        self.last_capture = cap
        if cap.positions is None or int(cap.positions[0]) != position:
            raise AdapterError(self.name, "decode position", str(position), str(cap.positions))
        layers = tuple(self._decode_layer(cap, tap, i) for i in range(self.config.num_layers))
        return StepRecord(position=position, logits=torch.from_numpy(ctx.logits(0)), layers=layers)

    def _decode_layer(self, cap: Capture, tap: GraphTap, layer: int) -> LayerProbe:
        """Layer ``layer`` of a decode step: exactly the cells its own mask let the query see, at the
        positions llama.cpp wrote there (a sliding layer's mask and cache are not a full layer's)."""
        cells = visible_cells(self._mask(cap, layer)[0])
        cells_map = tap.layer_cells[layer]
        missing = [int(c) for c in cells if int(c) not in cells_map]
        if missing:
            raise AdapterError(
                self.name, f"layer {layer} attended cells", "cells a batch wrote", f"unwritten cells {missing[:5]}"
            )
        return LayerProbe(
            q=torch.from_numpy(cap.q[layer]),
            k=torch.from_numpy(cap.k_cache[layer][cells]),
            key_positions=torch.tensor([cells_map[int(c)] for c in cells], dtype=torch.int64),
            key_slots=torch.from_numpy(cells.astype(np.int64)),
            hidden_in=torch.from_numpy(cap.hidden[layer]),
            q_raw=torch.from_numpy(cap.q_raw[layer]),
        )

    def _mask(self, cap: Capture, layer: int = 0) -> np.ndarray:
        """``[T_pad, n_kv]`` the attention mask the graph computed for ``layer`` (its ``kq_soft_max``)."""
        mask = cap.masks.get(layer)
        if mask is None:
            raise AdapterError(self.name, "attention mask", f"layer {layer}'s kq_soft_max mask", "none in the graph")
        return mask

    def _check_fits(self, total: int) -> None:
        if total > self.n_ctx:
            raise UsageError(f"a case of {total} tokens needs n_ctx >= {total} (llama.cpp n_ctx is {self.n_ctx})")
