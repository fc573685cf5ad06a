"""``MLXEngine``: mlx-lm's own model and cache classes, driven through a parity case.

What is exercised is mlx-lm's real cached path: ``model(tokens, cache=caches)`` with the cache objects
mlx-lm makes (``make_prompt_cache``, ``RotatingKVCache``), its prefix reuse (``copy.deepcopy`` +
``trim_prompt_cache``, as its server's prompt cache does), ``save_prompt_cache``/``load_prompt_cache``
and ``trim_prompt_cache`` for rollback. Probes (:mod:`.probes`) only observe. See docs/engines/mlx.md.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch

from ...contract import DTYPES
from ...errors import CheckpointError, ConfigError, UsageError
from ...models.config import Checkpoint, ModelConfig, fingerprint_of
from ...models.families import canonical_weights
from ...models.hf_config import read_model_config
from ...models.safetensors_dir import read_dir_config, weights_digest
from ...parity.cases import Case, model_window
from ...parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, StepRecord, Tier
from ...parity.recorder import visible_keys
from .model_reading import check_built, embedding_scale, longrope_reading, mlx_spelling, rope_reading_note
from .probes import ForwardProbe, installed
from .runtime import BlasChoice, import_mlx
from .versions import caches_make_masks, concatenate_masks_windows, load_keywords

DType = Literal["float32", "bfloat16", "float16"]
_DTYPE_NAMES: tuple[str, ...] = get_args(DType)  # the names in ropekv.contract.DTYPES mlx-lm runs in
PARENT_EXTRA = 3  # tokens of another continuation the prefix's parent request cached (then trimmed)


class MLXEngine:
    """mlx-lm on MLX (CPU backend on Linux), at the forensics tier.

    ``max_kv_size``/``keep`` choose the caches the way an mlx-lm user does: ``max_kv_size`` alone is
    ``make_prompt_cache(model, max_kv_size)`` (what ``mlx_lm.generate --max-kv-size`` calls; llama
    models return their own unbounded ``KVCache`` from it), ``keep`` with it builds
    ``RotatingKVCache(max_kv_size, keep)`` per layer. Without them each case gets the model's own caches,
    or for a case window ``W`` with ``s`` sinks ``RotatingKVCache(max_size=W + s, keep=s)``: the decode
    semantics of that cache is ropekv's window with sinks (its prefill semantics is not: docs/engines/mlx.md).

    ``overrides`` update ``config.json`` for both mlx-lm (``load_model(path, model_config=...)``) and
    ropekv's reading of it (another ``rope_theta``, ``rope_scaling``, ``layer_types`` and
    ``sliding_window``): the same weights under another configuration.

    ``rollback=n`` feeds ``n`` rejected draft tokens in one call after the prefill and removes them with
    ``trim_prompt_cache`` (speculative decoding); ``restore=True`` saves the cache with
    ``save_prompt_cache`` and decodes from ``load_prompt_cache``'s copy. The reference is the
    uninterrupted run either way.
    """

    name = "mlx"
    tier = Tier.FORENSICS

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        max_kv_size: int | None = None,
        keep: int | None = None,
        dtype: DType = "float32",
        rollback: int = 0,
        restore: bool = False,
        blas: BlasChoice = "openblas",
        overrides: Mapping[str, Any] | None = None,
    ):
        _check_options(max_kv_size, keep, rollback)
        if dtype not in _DTYPE_NAMES:
            raise UsageError(f"mlx: dtype must be one of {', '.join(_DTYPE_NAMES)}, got {dtype!r}")
        self.rt = import_mlx(blas)
        self.max_kv_size, self.keep, self.dtype_name = max_kv_size, keep, dtype
        self.rollback, self.restore = rollback, bool(restore)
        self.dtype = DTYPES[dtype]
        self.path = model_directory(model_dir)
        self.overrides = dict(overrides or {})
        self.config: ModelConfig = _read_config(self.path, self.overrides)  # ConfigError / CheckpointError
        # ropekv's per-layer reading in mlx-lm's field names, then the caller's overrides (which win)
        self.spelling = mlx_spelling(self.config, _model_type(self.path, self.overrides))
        try:
            self.model, self.mlx_config = self.rt.utils.load_model(
                self.path, model_config={**self.spelling, **self.overrides}, **load_keywords(self.rt.utils)
            )
        except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
            raise CheckpointError(f"{self.path}: mlx-lm cannot load it: {str(exc).splitlines()[0]}") from None
        if len(self.model.layers) != self.config.num_layers:
            raise ConfigError(
                f"{self.path}: mlx-lm built {len(self.model.layers)} layers, config says {self.config.num_layers}"
            )
        built = check_built(
            self.model, self.rt.cache.make_prompt_cache(self.model), self.config, refuse_rope=bool(self.overrides)
        )
        self.file_config = self.config  # what config.json says (the fingerprint's config)
        if built:
            self.config = self.config.replace(warnings=(*self.config.warnings, rope_reading_note(built)))
        self.config = _with_engine_embedding_scale(
            self.config, embedding_scale(self.model, self.rt.mx, self.rt.nn, self.config.hidden_size)
        )
        self.config = _with_engine_longrope(self.config, longrope_reading(self.model, self.rt.mx, self.config))
        if dtype != "float32":
            self.model.set_dtype(getattr(self.rt.mx, dtype))
        self._checkpoint: Checkpoint | None = None

    def with_options(self, **changes: Any) -> MLXEngine:
        """The same loaded model under other cache options (``max_kv_size``, ``keep``, ``rollback``,
        ``restore``): no second load."""
        unknown = set(changes) - {"max_kv_size", "keep", "rollback", "restore"}
        if unknown:
            raise UsageError(f"mlx: with_options cannot change {', '.join(sorted(unknown))}")
        other = copy.copy(self)
        for name, value in changes.items():
            setattr(other, name, value)
        _check_options(other.max_kv_size, other.keep, other.rollback)
        return other

    # ------------------------------------------------------------------ the model as ropekv sees it

    @property
    def checkpoint(self) -> Checkpoint:
        """The weights mlx runs (its parameters, widened to float32) under the directory's config."""
        if self._checkpoint is None:
            from mlx.utils import tree_flatten

            params = dict(tree_flatten(self.model.parameters()))
            expected = self.config.expected_shapes()
            mx = self.rt.mx
            # mlx-lm keeps a family's fused tensors fused (Phi-3's qkv_proj): split as ropekv reads them
            every = {k: torch.from_numpy(np.array(v.astype(mx.float32), copy=True)) for k, v in params.items()}
            canonical = canonical_weights(self.config, every, f"mlx-lm {self.path}")
            weights = {k: v for k, v in canonical.items() if k in expected}
            self._checkpoint = Checkpoint(
                self.config, weights, f"mlx-lm {self.path}", fingerprint_of(self.file_config, weights_digest(weights))
            )
        return self._checkpoint

    def describe(self) -> EngineDescription:
        return EngineDescription(
            name=self.name,
            key_form="rotated (mlx-lm applies RoPE at cache.offset before update_and_fetch)",
            extra={
                "engine": "mlx-lm",
                "versions": self.rt.versions,
                "device": str(self.rt.mx.default_device()),
                "blas": self.rt.blas,
                "dtype": self.dtype_name,
                "model_class": f"{type(self.model).__module__}.{type(self.model).__name__}",
                "caches": self._cache_text(),
                "rollback": self.rollback,
                "restore": self.restore,
                "prefix_hit": f"parent request of P + {PARENT_EXTRA} tokens, copy.deepcopy, trim_prompt_cache "
                f"({PARENT_EXTRA}); a parent of exactly P tokens where the cache cannot trim",
                "key_positions": "from each cache's offset and ring write index (_idx, keep)",
                "mlx_config": dict(self.spelling) or "config.json as mlx-lm reads it",
                "embedding_scale": f"{self.config.embedding_scale:.8g} (measured on mlx-lm's forward; "
                f"config.json: {self.file_config.embedding_scale:.8g})",
            },
        )

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        out = [Ignored("block_size")]
        if case.window is not None and not caches_make_masks(self.rt.cache):
            out.append(
                Ignored(
                    "window",
                    f"window={case.window} (mlx-lm {self.rt.versions['mlx-lm']} builds its masks in "
                    "create_attention_mask from the caches alone: a full forward cannot be given a window mask)",
                )
            )
        elif self.max_kv_size is not None and (case.window is not None or case.sink_tokens):
            out.append(Ignored("window", f"window/sink_tokens (the engine's caches are fixed: {self._cache_text()})"))
        elif case.window is not None and model_window(self.config.layer_attentions) is not None:
            out.append(
                Ignored(
                    "window",
                    f"window={case.window} (mlx-lm masks a sliding layer's prefill with the model's window "
                    f"{model_window(self.config.layer_attentions)} whatever its cache holds: a case window "
                    "would hold in decode only, docs/engines/mlx.md)",
                )
            )
        return tuple(out)

    # ------------------------------------------------------------------ the protocol

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        caches = self.new_caches(case)
        notes: list[str] = [f"mlx-lm caches: {_cache_summary(caches)}"]
        if case.prefix:
            caches = self._prefix_hit(caches, tokens, case, notes)
        self.prefill(caches, tokens[case.prefix : case.prefix + case.length], case.chunk)
        if self.rollback:
            draft = (tokens[: self.rollback] + 7) % self.config.vocab_size  # rejected drafts
            self.forward(draft, caches)
            trimmed = self.rt.cache.trim_prompt_cache(caches, self.rollback)
            notes.append(f"rollback: trim_prompt_cache removed {trimmed} of {self.rollback} draft tokens")
        if self.restore:
            caches = self.save_and_load(caches)
            notes.append(
                f"restore: decoded from load_prompt_cache ({', '.join(sorted({type(c).__name__ for c in caches}))})"
            )
        steps = []
        for t in case.decode_positions:
            probe = ForwardProbe(self.config.num_layers, self.name)
            logits = self.forward(tokens[t : t + 1], caches, probe)
            steps.append(StepRecord(position=t, logits=logits[-1], layers=probe.layers()))
        return CaseRun(tuple(steps), notes=tuple(notes))

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        """mlx-lm's uncached math (``ConcatenateKVCache`` from empty: rope at offset 0, the "causal" mask a
        cache-free call uses); a case window is given to the kernel as ropekv's window-with-sinks mask."""
        T = int(tokens.shape[0])
        mask = None
        if case.window is not None:
            positions = torch.arange(T)
            visible = visible_keys(positions, positions, case.window, case.sink_tokens)  # [T, T]
            mask = self.rt.mx.array(visible.numpy())
        probe = ForwardProbe(self.config.num_layers, self.name)
        has_concatenate = hasattr(self.rt.cache, "ConcatenateKVCache")  # from 0.24 on
        if has_concatenate and (
            concatenate_masks_windows(self.rt.cache) or model_window(self.config.layer_attentions) is None
        ):
            caches = [self.rt.cache.ConcatenateKVCache() for _ in range(self.config.num_layers)]
        else:
            # Before 0.30.7 a ConcatenateKVCache ignores a sliding layer's window in a multi-token call
            # (before 0.28 the model read the window from its cache's max_size, which it lacks): it would
            # attend every key; releases without one have only the model's own caches. One prefill into
            # the model's own fresh caches is the release's windowed forward.
            caches = self.rt.cache.make_prompt_cache(self.model)
        logits = self.forward(tokens, caches, probe, mask=mask)
        return FullRun(rows=torch.as_tensor(rows, dtype=torch.int64), logits=logits[rows], layers=probe.layers(rows))

    # ------------------------------------------------------------------ mlx-lm operations

    def new_caches(self, case: Case) -> list[Any]:
        c = self.rt.cache
        if self.max_kv_size is not None:
            if self.keep is None:
                return c.make_prompt_cache(self.model, max_kv_size=self.max_kv_size)
            return [c.RotatingKVCache(max_size=self.max_kv_size, keep=self.keep) for _ in self.model.layers]
        if case.window is not None:
            return [
                c.RotatingKVCache(max_size=case.window + case.sink_tokens, keep=case.sink_tokens)
                for _ in self.model.layers
            ]
        return c.make_prompt_cache(self.model)

    def forward(
        self, tokens: torch.Tensor, caches: list[Any], probe: ForwardProbe | None = None, mask: Any = None
    ) -> torch.Tensor:
        """``model(tokens [S], cache=caches)``; logits ``[S, vocab]`` float32. With ``probe`` the caches are
        seen through :class:`~.probes.CacheProbe` and the layers' rope/norm are wrapped for this call only."""
        mx = self.rt.mx
        x = mx.array(tokens.to(torch.int64).numpy().astype(np.int32))[None]  # [1, S]
        arg = caches if probe is None else probe.caches(caches, mask)
        with installed(self.model, probe, self.rt.nn):
            out = self.model(x, cache=arg)
        out = out[0].astype(mx.float32)
        mx.eval(out)
        return torch.from_numpy(np.array(out, copy=True))

    def prefill(self, caches: list[Any], tokens: torch.Tensor, chunk: int | None) -> None:
        step = chunk or int(tokens.shape[0])
        for start in range(0, int(tokens.shape[0]), step):
            self.forward(tokens[start : start + step], caches)

    def save_and_load(self, caches: list[Any]) -> list[Any]:
        c = self.rt.cache
        with tempfile.TemporaryDirectory(prefix="ropekv-mlx-") as tmp:
            file = str(Path(tmp) / "prompt_cache.safetensors")
            c.save_prompt_cache(file, caches, {"ropekv": "parity restore"})
            return c.load_prompt_cache(file)

    def _prefix_hit(self, caches: list[Any], tokens: torch.Tensor, case: Case, notes: list[str]) -> list[Any]:
        """An earlier request cached ``tokens[:P]`` plus another continuation; this one reuses a copy
        trimmed back to ``P`` (a parent of exactly ``P`` tokens where the cache could not trim)."""
        other = (tokens[:PARENT_EXTRA] + 1) % self.config.vocab_size
        trimmable_after = all(
            type(c).__name__ != "RotatingKVCache" or case.prefix + PARENT_EXTRA < c.max_size for c in caches
        )
        extra = PARENT_EXTRA if trimmable_after else 0
        if not extra:
            notes.append(
                f"prefix hit: a parent of exactly {case.prefix} tokens (a RotatingKVCache holding "
                f"{case.prefix + PARENT_EXTRA} tokens could not be trimmed back)"
            )
        parent = torch.cat([tokens[: case.prefix], other[:extra]])
        self.prefill(caches, parent, None)
        child = copy.deepcopy(caches)
        if extra:
            trimmed = self.rt.cache.trim_prompt_cache(child, extra)
            if trimmed != extra:
                notes.append(f"prefix hit: trim_prompt_cache removed {trimmed} of {extra} tokens")
        return child

    def _cache_text(self) -> str:
        if self.max_kv_size is not None:
            return (
                f"make_prompt_cache(model, max_kv_size={self.max_kv_size})"
                if self.keep is None
                else f"RotatingKVCache(max_size={self.max_kv_size}, keep={self.keep}) per layer"
            )
        return (
            "make_prompt_cache(model) (the model's make_cache); a case window W with s sinks: "
            "RotatingKVCache(max_size=W+s, keep=s) per layer"
        )


def _cache_summary(caches: list[Any]) -> str:
    """``30 x KVCache`` / ``30 x RotatingKVCache(max_size=37, keep=4)``: what mlx-lm really built."""

    def one(c: Any) -> str:
        kind = type(c).__name__
        return f"{kind}(max_size={c.max_size}, keep={c.keep})" if kind == "RotatingKVCache" else kind

    kinds = [one(c) for c in caches]
    return ", ".join(f"{kinds.count(k)} x {k}" for k in dict.fromkeys(kinds))


def _check_options(max_kv_size: Any, keep: Any, rollback: Any) -> None:
    if max_kv_size is not None and (
        isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int) or max_kv_size < 1
    ):
        raise UsageError(f"mlx: max_kv_size must be a positive integer, got {max_kv_size!r}")
    if keep is not None and (max_kv_size is None or not isinstance(keep, int) or not 0 <= keep < max_kv_size):
        raise UsageError(f"mlx: keep needs max_kv_size and 0 <= keep < max_kv_size, got keep={keep!r}")
    if isinstance(rollback, bool) or not isinstance(rollback, int) or rollback < 0:
        raise UsageError(f"mlx: rollback must be a non-negative integer, got {rollback!r}")


def _model_type(path: Path, overrides: dict[str, Any]) -> str:
    """``model_type`` as mlx-lm picks its model class: config.json's, or the overrides'."""
    if "model_type" in overrides:
        return str(overrides["model_type"])
    return str(json.loads((path / "config.json").read_text()).get("model_type", ""))


def _with_engine_embedding_scale(config: ModelConfig, measured: float | None) -> ModelConfig:
    """``config`` with the embedding scale mlx-lm really applies, when it differs from the config's (and
    a warning the CLI prints): gemma3_text rounds ``sqrt(hidden_size)`` to bfloat16 in every dtype
    (``mx.array(hidden_size**0.5, mx.bfloat16)``), 25.25 for 640 where transformers and ropekv's
    reading use 25.2982; the reference then runs mlx-lm's model, the RoPE and the caches are judged on it
    (scripts/findings/mlx_gemma3_embedding_scale.py measures what the difference costs)."""
    if measured is None or abs(measured - config.embedding_scale) <= 1e-6 * abs(config.embedding_scale):
        return config
    note = (
        f"mlx-lm scales the embeddings by {measured:.6g}, config.json by {config.embedding_scale:.6g} "
        f"(x{measured / config.embedding_scale:.6f}); the reference uses mlx-lm's factor"
    )
    return config.replace(embedding_scale=measured, warnings=(*config.warnings, note))


def _with_engine_longrope(config: ModelConfig, reading: str | None) -> ModelConfig:
    """``config`` with the LongRoPE reading mlx-lm really computes, when it is not transformers': a
    ``SuScaledRoPE`` that turns every length with the long factors (mlx-lm 0.30.2 and later, and before
    0.29) is a reading of the config, not a cache bug, so the reference runs it and the report says so
    (a warning the CLI prints), as for the embedding scale."""
    if reading != "long":
        return config
    spec = config.rope
    scaling = dataclasses.replace(spec.scaling, short_factor=spec.scaling.long_factor)
    note = (
        "mlx-lm turns LongRoPE with its long factors at every length; transformers uses the short factors up to "
        f"original_max_position_embeddings ({spec.scaling.original_max_position_embeddings}): the reference uses "
        "mlx-lm's reading"
    )
    return config.replace(rope=dataclasses.replace(spec, scaling=scaling), warnings=(*config.warnings, note))


def _read_config(path: Path, overrides: dict[str, Any]) -> ModelConfig:
    """ropekv's reading of ``config.json`` updated with ``overrides`` (what ``load_model(path,
    model_config=overrides)`` does to the dict mlx-lm builds its model from), so that the float64
    reference runs the model mlx-lm runs."""
    config = read_dir_config(path)  # validates the file first (size, JSON, fields)
    if not overrides:
        return config
    data = json.loads((path / "config.json").read_text())
    data.update(overrides)
    return read_model_config(data, source=f"{path / 'config.json'} with {sorted(overrides)} overridden")


def model_directory(model_dir: str | Path | None) -> Path:
    """The directory mlx-lm loads: the given one, or ropekv's converted embedded model (config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json: all ``mlx_lm.load`` needs, offline)."""
    from ...models import resolve_model_dir

    path = resolve_model_dir(model_dir)  # None or an embedded model's name: its converted folder
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: mlx-lm needs a directory with config.json and *.safetensors")
    return path
