"""What a loaded mlx-lm model computes where its reading of ``config.json`` and ropekv's can differ.

mlx-lm builds a model from ``ModelArgs.from_dict(config)``, which keeps only the field names its
``ModelArgs`` declares and fills the rest with its defaults. Its ``gemma3_text`` reads
``rope_theta`` (global layers), ``rope_local_base_freq`` (sliding layers), ``sliding_window`` and
``sliding_window_pattern`` (every ``p``-th layer global); transformers 5 writes ``rope_parameters``
per layer type and ``layer_types`` instead, so on a transformers folder mlx-lm runs its defaults
(which happen to be Gemma 3's: 1e6, 1e4, 6). Three things here keep the float64 reference on the
model mlx-lm really runs:

- :func:`mlx_spelling`: the per-layer RoPE bases, window and layer pattern ropekv read, in mlx-lm's
  field names, handed to ``load_model(model_config=...)`` (a conversion at load; the folder is untouched);
- :func:`check_built`: each layer's RoPE read back from the module mlx-lm calls and each layer's window
  from the cache ``make_prompt_cache`` gives it, against ropekv's config (ConfigError on a difference);
- :func:`embedding_scale`: the factor mlx-lm multiplies the embeddings by, measured on the model
  (gemma3_text: ``sqrt(hidden_size)`` rounded to bfloat16 whatever the dtype, 25.25 for 640 where
  transformers uses 25.2982).

Attribute reads and one small forward; mlx is used only through the objects passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import ConfigError
from ...models.config import ModelConfig
from .cache_contract import layer_rope
from .probes import _LayerCalls, _module_wrapper

# model_type -> how its ModelArgs spell the per-layer-type RoPE bases and layer pattern
_GEMMA3 = ("gemma3_text",)


def mlx_spelling(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """``config.json`` entries in mlx-lm's spelling for ``model_type`` (empty where mlx-lm reads
    transformers' names): gemma3_text's ``rope_theta``, ``rope_local_base_freq``, ``sliding_window``
    and ``sliding_window_pattern``, from ropekv's per-layer reading. A layer pattern mlx-lm cannot
    express (global layers not exactly every ``p``-th) is refused."""
    if model_type not in _GEMMA3:
        return {}
    kinds = [config.layer_attention(i).kind for i in range(config.num_layers)]
    full = [i for i, k in enumerate(kinds) if k == "full"]
    if not full or any(k not in ("full", "sliding") for k in kinds):
        raise ConfigError(f"{model_type}: mlx-lm needs sliding and global layers only, with a global one; got {kinds}")
    pattern = full[0] + 1
    expected = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(config.num_layers)]
    if kinds != expected:
        raise ConfigError(
            f"{model_type}: mlx-lm makes every layer i with (i + 1) % sliding_window_pattern == 0 global; "
            f"layer_types {kinds} has no such pattern"
        )
    out: dict[str, Any] = {"sliding_window_pattern": pattern, "sliding_window": config.sliding_window}
    for kind, name in (("full", "rope_theta"), ("sliding", "rope_local_base_freq")):
        thetas = {config.layer_rope(i).theta for i in range(config.num_layers) if kinds[i] == kind}  # type: ignore[union-attr]
        if len(thetas) != 1:
            raise ConfigError(
                f"{model_type}: mlx-lm gives all {kind} layers one RoPE base; config has {sorted(thetas)}"
            )
        out[name] = thetas.pop()
    return out


def check_built(model: Any, caches: Sequence[Any], config: ModelConfig, *, refuse_rope: bool) -> tuple[str, ...]:
    """Every layer mlx-lm built against ropekv's reading of ``config.json``: its RoPE (base, rotary
    dims, pairing, scaling) and its window (a ``RotatingKVCache(max_size=W)`` where the layer slides
    with window W, a ``KVCache`` where it attends to every key). Rope classes that keep only a
    frequency array (``Llama3RoPE``, ``YarnRoPE``, ...) are not read back.

    A window that differs is refused (ConfigError: the adapter describes the cache mlx-lm builds for the
    window the config gives). A RoPE that differs is what the check is for: returned, one line per
    layer, so that the check judges mlx-lm's rotation against ``config.json``'s and names the
    difference; refused only where ``refuse_rope`` (the caller's own overrides, in spellings ropekv
    may not read, built it: then it is not this folder's model)."""
    problems: list[str] = []
    rope_problems: list[str] = []
    for i, layer in enumerate(model.layers):
        spec = config.layer_rope(i)
        try:
            built = layer_rope(
                layer.self_attn.rope,
                head_dim=config.head_dim,
                max_position_embeddings=config.max_position_embeddings,
                where=f"layers[{i}].self_attn.rope",
            )
        except ConfigError:
            built = None
        if built is not None and spec is not None:
            for field in ("theta", "rotary_dim", "layout"):
                if getattr(built, field) != getattr(spec, field):
                    rope_problems.append(
                        f"layer {i} RoPE {field} {getattr(built, field)} (ropekv: {getattr(spec, field)})"
                    )
            if (built.scaling.rope_type, built.scaling.factor) != (spec.scaling.rope_type, spec.scaling.factor):
                rope_problems.append(
                    f"layer {i} RoPE scaling {_scaling_text(built.scaling)} (ropekv: {_scaling_text(spec.scaling)})"
                )
        kind = type(caches[i]).__name__
        window = int(caches[i].max_size) if kind == "RotatingKVCache" else None
        if window != config.layer_window(i):
            problems.append(f"layer {i} cache {kind} window {window} (ropekv: {config.layer_window(i)})")
    if refuse_rope:
        problems = rope_problems + problems
        rope_problems = []
    if problems:
        raise ConfigError(f"mlx-lm built another model than ropekv reads from config.json: {_listed(problems)}")
    return tuple(rope_problems)


def _listed(problems: Sequence[str]) -> str:
    return "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")


def _scaling_text(scaling: Any) -> str:
    return scaling.rope_type if scaling.factor is None else f"{scaling.rope_type} x{scaling.factor:g}"


def rope_reading_note(problems: Sequence[str]) -> str:
    """The report's warning for RoPE that mlx-lm built otherwise than ``config.json`` says."""
    return (
        f"mlx-lm turns otherwise than config.json says ({_listed(problems)}): the float64 reference follows "
        "config.json, so the check judges mlx-lm's rotation against it"
    )


def embedding_scale(model: Any, mx: Any, nn: Any, hidden_size: int) -> float | None:
    """The factor mlx-lm's forward multiplies input embeddings by, measured: a forward of one
    all-ones embedding (``input_embeddings``, float32), recording what the first layer's
    ``input_layernorm`` receives (:class:`~.probes.NormProbe`). None when the model takes no
    ``input_embeddings`` or that input is not constant (then nothing is claimed)."""
    NormProbe = _module_wrapper(nn)[1]
    layer = model.layers[0]
    norm = layer.input_layernorm
    calls = _LayerCalls()
    layer.input_layernorm = NormProbe(norm, calls)
    try:
        ones = mx.ones((1, 1, hidden_size), dtype=mx.float32)
        out = model(mx.zeros((1, 1), dtype=mx.int32), input_embeddings=ones)
        mx.eval(out)
    except TypeError:
        return None
    finally:
        layer.input_layernorm = norm
    if calls.hidden_in is None:
        return None
    row = calls.hidden_in.astype(mx.float32).reshape(-1).tolist()
    if max(row) != min(row):
        return None
    return float(row[0])


def longrope_reading(model: Any, mx: Any, config: ModelConfig) -> str | None:
    """How mlx-lm's LongRoPE module turns a short sequence, measured: ``"per-length"`` (short factors up
    to ``original_max_position_embeddings``, long past it: transformers' reading) or ``"long"`` (the long
    factors at every length: mlx-lm's ``SuScaledRoPE`` from 0.30.2, and before 0.29). None where the
    model's RoPE is not LongRoPE or the measurement fits neither (then nothing is claimed).

    Layer 0's rope turns a one-token query at offset 1 (a 2-token sequence, below any original length)
    whose first half of channels is 1 and second half 0: pair ``m`` comes back as ``a (cos w_m, sin w_m)``,
    and ``w_m`` is compared with ropekv's short- and long-factor frequencies for the same config."""
    import torch

    spec = config.layer_rope(0)
    if spec is None or spec.scaling.rope_type != "longrope":
        return None
    half = spec.rotary_dim // 2
    heads = int(model.layers[0].self_attn.n_heads) if hasattr(model.layers[0].self_attn, "n_heads") else 1
    x = mx.concatenate([mx.ones((1, heads, 1, half)), mx.zeros((1, heads, 1, config.head_dim - half))], axis=-1)
    out = model.layers[0].self_attn.rope(x.astype(mx.float32), offset=1)
    row = torch.tensor(out.astype(mx.float32).reshape(-1, config.head_dim)[0].tolist(), dtype=torch.float64)
    measured = torch.atan2(row[half : 2 * half], row[:half])  # [half] angles at position 1
    original = spec.scaling.original_max_position_embeddings or spec.max_position_embeddings
    short, long = spec.inv_freq(seq_len=2), spec.inv_freq(seq_len=int(original) + 1)

    def error(freqs: torch.Tensor) -> float:
        return float((torch.remainder(measured - freqs + torch.pi, 2 * torch.pi) - torch.pi).abs().max())

    errors = {"per-length": error(short), "long": error(long)}
    best = min(errors, key=lambda k: errors[k])
    return best if errors[best] < 1e-4 else None
