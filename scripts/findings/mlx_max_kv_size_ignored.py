"""Finding: mlx-lm's make_prompt_cache(model, max_kv_size=N) ignores N for llama models.

``make_prompt_cache`` defers to ``model.make_cache()`` whenever the model has one, and mlx-lm's llama
model always has one (RotatingKVCache only for its sliding layers, none in SmolLM2). So
``mlx_lm.generate --max-kv-size 37`` on SmolLM2 keeps an unbounded KVCache: every key stays visible.
ropekv confirms it by checking the caches mlx-lm built against a 37-token window: the decode reads keys
outside the window. The same check passes with an explicit RotatingKVCache(37, keep=0).

Run from .venv-mlx:  .venv-mlx/bin/python scripts/findings/mlx_max_kv_size_ignored.py
"""

from __future__ import annotations

from ropekv import check
from ropekv.adapters.mlx import MLXEngine
from ropekv.errors import AdapterError
from ropekv.parity.cases import Case, token_stream


def show(engine, case) -> None:
    """ropekv's verdict: the table, or the validator's refusal (keys outside the case's window)."""
    try:
        print(check(engine, cases=[case]).table())
    except AdapterError as exc:
        print(f"refused by ropekv's validation: {exc}")


def main() -> None:
    engine = MLXEngine(None, max_kv_size=37)
    caches = engine.rt.cache.make_prompt_cache(engine.model, max_kv_size=37)
    print(
        f"make_prompt_cache(model, max_kv_size=37) -> {sorted({type(c).__name__ for c in caches})} "
        f"x {len(caches)} (model.make_cache exists: {hasattr(engine.model, 'make_cache')})"
    )
    case = Case(length=48, window=37, decode_steps=2)
    run = engine.run_case(case, token_stream(engine.config.vocab_size, case.total))
    print(
        f"decode at position {run.steps[0].position} reads {len(run.steps[0].layers[0].key_positions)} keys "
        f"(a 37-token window holds 37)"
    )
    print("\nropekv check, caches from make_prompt_cache(model, max_kv_size=37), case window 37:")
    show(engine, case)
    bounded = engine.with_options(keep=0)  # RotatingKVCache(max_size=37, keep=0) per layer
    print("\nropekv check, explicit RotatingKVCache(max_size=37, keep=0):")
    show(bounded, case)


if __name__ == "__main__":
    main()
