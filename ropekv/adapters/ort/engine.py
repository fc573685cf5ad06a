"""``OrtEngine``: ONNX Runtime GenAI (CPU) as a ropekv engine adapter.

The model is the graph onnxruntime-genai's builder makes from a transformers folder (:mod:`.builder_main`),
run through its own ``Generator``: one static KV buffer per layer shared between steps
(``past_present_share_buffer``), which the attention kernel fills with keys it turned itself
(``GroupQueryAttention`` with ``do_rotary=1``: the contract's ``"kernel_write"`` site, read from the
graph by :mod:`.graph_contract`). The graph it runs is the probed copy of :mod:`.graph`: the same nodes
plus outputs for each layer's pre-RoPE query and key and the kernel's own scores, and an explicit
``position_ids`` input, which the Generator fills with the tokens' positions.

- cached path: a prefix hit is the Generator's ``rewind_to``: an earlier request (the prefix, then a
  different continuation) is appended and rewound to the prefix, so its first ``P`` tokens' keys stay
  in the buffer and the rest is overwritten; prefill chunk by chunk with ``append_tokens``; then one
  token per decode step. The logits are the Generator's; the keys each step's kernel read are the
  layer's buffer slots ``0..t`` (``present.N.key``), at the positions the Generator fed for them.
- the query the kernel multiplied is the pre-RoPE query turned by the factor the kernel gave the
  token's own key (:mod:`.turn`), checked against the kernel's scores where it returns them.
- full forward: a fresh Generator given the whole sequence in one ``append_tokens`` (every key fresh).

Tiers: forensics where every layer returns its scores; a graph with windowed layers kept in a sliding
buffer (``sliding_window_cache=1``: Gemma 3's local layers) runs at the logits tier: the CPU kernel
refuses ``qk_output`` there, and the buffer's slot-to-position map is not exposed. ``full_buffers=True``
runs those layers' kernels with the same window over full-length buffers (``sliding_window_cache=0``,
genai_config.json without its sliding-window section): the forensics tier, on a graph that is not the
one the builder wrote (``--ort-full-buffers``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...contract import CacheContract
from ...errors import EngineUnavailable, UsageError
from ...models import load_checkpoint
from ...models.config import Checkpoint
from ...parity.cases import Case
from ...parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, StepRecord, Tier
from ...probe import LayerProbe
from ..converted import converted
from .graph import POSITION_IDS, ConfigPatch, GqaLayer, GraphPatch, initializer, load_graph, output_names, write_probed
from .graph_contract import graph_contract
from .turn import apply_turn, check_scores, measured_turn, pairs, table_turn


def _og():
    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        raise EngineUnavailable(
            f"onnxruntime-genai is not installed here (make setup-ort; run from .venv-ort): {exc}"
        ) from None
    return og


def checkpoint_folder(model: str | Path | None) -> Path:
    """The transformers folder to build from: an embedded model's converted folder (None: the default)
    or ``model`` itself."""
    from ...models.embedded import is_embedded_name

    if model is None or is_embedded_name(model):
        from ...models.default import default_checkpoint_dir

        return default_checkpoint_dir(None if model is None else str(model))
    path = Path(model)
    if not path.is_dir():
        raise UsageError(
            f"--engine ort builds from a transformers folder (config.json + safetensors); {model} is not one"
        )
    return path


def full_length_buffers(model: Any) -> None:
    """Windowed layers keep their window but a full-length buffer (``sliding_window_cache=0``)."""
    from onnx import helper

    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention" and any(a.name == "sliding_window_cache" for a in node.attribute):
            kept = [a for a in node.attribute if a.name != "sliding_window_cache"]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("sliding_window_cache", 0)])


def no_sliding_buffers(config: dict[str, Any]) -> None:
    """genai_config.json without its ``sliding_window`` section: every layer gets a full-length buffer."""
    config["model"]["decoder"].pop("sliding_window", None)


def graph_vs_model(model: CacheContract, graph: CacheContract) -> str:
    """The fields where the graph's contract differs from the model's, in one line: each contract-wide
    field with both values, each per-layer field with the number of layers (``""`` where none differ)."""
    parts: list[str] = []
    per_layer: dict[str, list[tuple[object, object]]] = {}
    for d in model.diff(graph):
        if d.field.startswith("layers."):
            per_layer.setdefault(d.field.split(".", 2)[2], []).append((d.theirs, d.ours))
        elif d.field not in ("layer_ropes", "window_layers"):  # summaries of the per-layer fields below
            parts.append(f"{d.field} (graph {d.theirs!r}, model {d.ours!r})")
    for field, values in per_layer.items():
        graph_value, model_value = values[0]
        parts.append(f"{field} on {len(values)} layer(s) (graph {graph_value!r}, model {model_value!r})")
    return "; ".join(parts)


class OrtEngine:
    """ONNX Runtime GenAI on the graph built from ``model`` (None: the embedded default model; an embedded
    model's name; or a transformers folder). ``patches`` edit the graph before it runs and
    ``config_patches`` its genai_config.json (graph faults, named ``patch_name``);
    ``tier`` (default: the highest the graph allows) may be lowered, never raised."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        tier: Tier | str | None = None,
        patches: Sequence[GraphPatch] = (),
        config_patches: Sequence[ConfigPatch] = (),
        patch_name: str = "",
        full_buffers: bool = False,
        name: str | None = None,
    ):
        og = _og()
        if full_buffers:  # the windowed layers' own kernel windows over full-length buffers (module docstring)
            patches = (*patches, full_length_buffers)
            config_patches = (*config_patches, no_sliding_buffers)
            patch_name = "+".join(p for p in (patch_name, "full-buffers") if p)
        self.folder = checkpoint_folder(model)
        self.checkpoint: Checkpoint = load_checkpoint(model)
        self.config = self.checkpoint.config
        self.dtype = torch.float32
        self.built = converted(
            self.folder,
            engine="ort",
            version=og.__version__,
            command=lambda src, out: [
                sys.executable,
                "-m",
                "ropekv.adapters.ort.builder_main",
                str(src),
                str(out),
                str(out / "cache"),
            ],
            done="genai_config.json",
        )
        shutil.rmtree(self.built / "cache", ignore_errors=True)  # the builder's scratch folder
        # The probed copy is this engine's own (hard links, ~0.2 MB of graph), removed with the engine.
        self.probed = Path(tempfile.mkdtemp(prefix=f".{self.built.name}.probe-", dir=self.built.parent))
        weakref.finalize(self, shutil.rmtree, self.probed, True)
        self.layers: tuple[GqaLayer, ...] = write_probed(self.built, self.probed, patches, config_patches)
        allowed = Tier.LOGITS if any(la.sliding_window_cache for la in self.layers) else Tier.FORENSICS
        self.tier = allowed if tier is None else Tier(tier)
        if allowed < self.tier:
            raise UsageError(
                f"the ONNX Runtime graph of {self.folder.name} allows the {allowed} tier at most: its windowed "
                "layers keep a sliding buffer (sliding_window_cache=1), where the CPU kernel returns no scores"
            )
        self.contract = graph_contract(
            load_graph(self.probed),
            self.probed,
            self.layers,
            self.config,
            weights_fingerprint=self.checkpoint.weights_fingerprint,
        )
        self.model_contract = CacheContract.for_model(
            self.config, key_form="rotated", block_size=1, weights_fingerprint=self.checkpoint.weights_fingerprint
        )
        # The keys a windowed layer's sliding buffer holds at least (the kernel refuses a smaller buffer).
        self._min_length = max((la.local_window_size for la in self.layers if la.sliding_window_cache), default=1)
        self._model = og.Model(str(self.probed))
        self._og = og
        self.name = name or "onnxruntime-genai" + (f" with graph fault {patch_name}" if patch_name else "")
        self.graph_differences = graph_vs_model(self.model_contract, self.contract)
        self._tables: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_score_error = 0.0  # the worst query check against the kernel's own scores in the last run

    # ------------------------------------------------------------------ protocol

    def describe(self) -> EngineDescription:
        import onnxruntime as ort

        return EngineDescription(
            name=self.name,
            key_form="rotated",
            extra={
                "engine": "onnxruntime-genai",
                "onnxruntime_genai": self._og.__version__,
                "onnxruntime": ort.__version__,
                "graph": str(self.built),
                "rotation": "inside GroupQueryAttention, before the cache write (do_rotary=1)",
                "contract": self.contract.to_dict(),
                "graph_vs_model": self.graph_differences,
                "tier": str(self.tier),
            },
        )

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        out = [Ignored("block_size", "block_size (one static buffer per layer)")]
        if case.window is not None:
            out.append(Ignored("window", "window (the graph applies only the model's own windows)"))
        if case.sink_tokens:
            out.append(Ignored("sink_tokens"))
        context = self.config.max_position_embeddings
        if case.positions_needed > context:
            out.append(
                Ignored("length", f"length (the case needs {case.positions_needed} positions; the graph {context})")
            )
        return tuple(out)

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        ids = [int(t) for t in tokens.tolist()]
        gen = self._generator(case.total + 1)
        notes = (
            [f"the graph's contract differs from the model's: {self.graph_differences}"]
            if self.graph_differences
            else []
        )
        if case.prefix:
            vocab = self.config.vocab_size
            self._append(gen, ids[: case.prefix] + [(t + 1) % vocab for t in ids[:3]])
            gen.rewind_to(case.prefix)
            del self._positions[case.prefix :]
            notes.append(f"prefix: an earlier request's first {case.prefix} tokens kept by Generator.rewind_to")
        prompt = ids[case.prefix : case.prefix + case.length]
        size = case.chunk or len(prompt)
        for i in range(0, len(prompt), size):
            self._append(gen, prompt[i : i + size])
        self.last_score_error = 0.0
        steps = []
        for t in case.decode_positions:
            self._append(gen, [ids[t]])
            logits = torch.from_numpy(np.array(gen.get_logits()[0, -1], dtype=np.float32))
            layers = self._decode_layers(gen, t) if self.tier >= Tier.ATTENTION else ()
            steps.append(StepRecord(position=t, logits=logits, layers=layers))
        return CaseRun(steps=tuple(steps), notes=tuple(notes))

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        ids = [int(t) for t in tokens.tolist()]
        T = len(ids)
        gen = self._generator(T)
        self._append(gen, ids)
        logits = torch.from_numpy(np.array(gen.get_output("logits")[0], dtype=np.float32))  # [T, vocab]
        layers: tuple[LayerProbe, ...] = ()
        if self.tier >= Tier.ATTENTION:
            layers = tuple(self._full_layer(gen, la, T, rows) for la in self.layers)
        return FullRun(rows=torch.as_tensor(rows, dtype=torch.int64), logits=logits[rows], layers=layers)

    # ------------------------------------------------------------------ the Generator

    def _generator(self, length: int):
        params = self._og.GeneratorParams(self._model)
        params.set_search_options(max_length=max(length, self._min_length))
        self._positions: list[int] = []  # by buffer slot: the position the Generator fed for that token
        return self._og.Generator(self._model, params)

    def _append(self, gen, ids: list[int]) -> None:
        gen.append_tokens(ids)
        fed = np.asarray(gen.get_input(POSITION_IDS)).reshape(-1).tolist()
        if len(fed) != len(ids):
            raise UsageError(f"the Generator fed {len(fed)} position ids for {len(ids)} tokens")
        self._positions.extend(int(p) for p in fed)

    def _inputs(self, gen, la: GqaLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """The node's pre-RoPE query ``[n, H, D]`` and new keys ``[n, KVH, D]`` of the latest append."""
        names, D = output_names(la), self.config.head_dim
        qin = torch.from_numpy(np.array(gen.get_output(names["q"]), dtype=np.float32)).reshape(
            -1, (la.num_heads + (2 * la.kv_num_heads if la.packed else 0)) * D
        )
        q = qin[:, : la.num_heads * D].reshape(-1, la.num_heads, D)
        if la.packed:
            k = qin[:, la.num_heads * D : (la.num_heads + la.kv_num_heads) * D]
        else:
            k = torch.from_numpy(np.array(gen.get_output(names["k"]), dtype=np.float32)).reshape(
                -1, la.kv_num_heads * D
            )
        return q, k.reshape(-1, la.kv_num_heads, D)

    def _keys(self, gen, la: GqaLayer, n: int) -> torch.Tensor:
        """``[n, KVH, D]``: the layer's buffer slots ``0..n-1`` as the kernel reads them."""
        present = np.array(gen.get_output(f"present.{la.index}.key"), dtype=np.float32)[0]  # [KVH, S, D]
        return torch.from_numpy(present[:, :n]).transpose(0, 1).contiguous()

    def _turn(
        self, la: GqaLayer, q_raw: torch.Tensor, k_raw: torch.Tensor, k_rot: torch.Tensor, position: int
    ) -> torch.Tensor:
        """``q_raw [H, D]`` turned as the kernel turned the token's key (:mod:`.turn`)."""
        spec = self.contract.layer_rope(la.index)
        rd = self.config.head_dim if spec is None else spec.rotary_dim
        a, b = pairs(self.config.head_dim, rd, la.interleaved)
        factor = measured_turn(k_raw, k_rot, a, b)
        unseen = torch.isnan(factor.real)
        if bool(unseen.any()):
            cos, sin = self._table(la)
            factor = torch.where(unseen, table_turn(cos, sin, position), factor)
        return apply_turn(q_raw, factor, a, b)

    def _table(self, la: GqaLayer) -> tuple[torch.Tensor, torch.Tensor]:
        key = (la.cos_cache, la.sin_cache)
        if key not in self._tables:
            graph = load_graph(self.probed)
            self._tables[key] = tuple(torch.from_numpy(initializer(graph, n, self.probed).copy()) for n in key)  # type: ignore[assignment]
        return self._tables[key]

    def _scores(self, gen, la: GqaLayer) -> torch.Tensor | None:
        names = output_names(la)
        if "qk" not in names:
            return None
        return torch.from_numpy(np.array(gen.get_output(names["qk"]), dtype=np.float32))[0]  # [H, n, T]

    def _decode_layers(self, gen, t: int) -> tuple[LayerProbe, ...]:
        """Each layer of a decode step at ``t``: the keys its kernel attended to (slots ``0..t``; on a
        windowed layer the last ``local_window_size`` of them), at the positions the Generator fed."""
        n = t + 1
        out = []
        for la in self.layers:
            q_raw, k_new = self._inputs(gen, la)  # [1, H, D], [1, KVH, D]
            keys = self._keys(gen, la, n)
            q = self._turn(la, q_raw[0], k_new[0], keys[t], self._positions[t])[None]
            first = 0 if la.local_window_size < 0 else max(0, n - la.local_window_size)
            scores = self._scores(gen, la)
            if scores is not None:
                err = check_scores(self.name, la.index, q, keys[first:], la.scale, scores[:, :, first:n])
                self.last_score_error = max(self.last_score_error, err)
            out.append(
                LayerProbe(
                    q=q,
                    k=keys[first:],
                    key_positions=torch.tensor(self._positions[first:n], dtype=torch.int64),
                    key_slots=torch.arange(first, n, dtype=torch.int64),
                    q_raw=q_raw,
                )
            )
        return tuple(out)

    def _full_layer(self, gen, la: GqaLayer, T: int, rows: list[int]) -> LayerProbe:
        q_raw, k_raw = self._inputs(gen, la)  # [T, H, D], [T, KVH, D]
        keys = self._keys(gen, la, T)
        q = torch.stack([self._turn(la, q_raw[r], k_raw[r], keys[r], self._positions[r]) for r in rows])  # [R, H, D]
        scores = self._scores(gen, la)
        if scores is not None:
            for i, r in enumerate(rows):  # the keys each row sees (the scores past them are masked)
                first = 0 if la.local_window_size < 0 else max(0, r + 1 - la.local_window_size)
                check_scores(
                    self.name,
                    la.index,
                    q[i : i + 1],
                    keys[first : r + 1],
                    la.scale,
                    scores[:, r : r + 1, first : r + 1],
                )
        return LayerProbe(
            q=q,
            k=keys,
            key_positions=torch.tensor(self._positions[:T], dtype=torch.int64),
            key_slots=torch.arange(T, dtype=torch.int64),
            q_raw=q_raw[rows],
        )
