"""Finding: RotatingKVCache(max_size=37, keep=4) is a plain 37-token window during prefill but
4 sinks + the 33 newest keys during decode; no single windowed forward matches it.

Evidence from ropekv: (1) the keys the decode kernel reads (positions from the cache's own ring
bookkeeping) are 0..3 plus the 33 newest; (2) the prompt's last prefill row matches the float64
reference with a plain window of 37 and not the one with 4 sinks + 33; (3) the decode steps match
neither reference, because the layers above 0 read keys whose hidden states were computed under the
prefill's semantics. ropekv's check of both readings fails; with keep=0 it passes.

Run from .venv-mlx:  .venv-mlx/bin/python scripts/findings/mlx_rotating_keep_semantics.py
"""

from __future__ import annotations

from ropekv import check
from ropekv.adapters.mlx import MLXEngine
from ropekv.errors import AdapterError
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import Case, token_stream


def show(engine, case) -> None:
    """ropekv's verdict: the table, or the validator's refusal (keys outside the case's window)."""
    try:
        print(check(engine, cases=[case]).table())
    except AdapterError as exc:
        print(f"refused by ropekv's validation: {exc}")


L = 60


def main() -> None:
    engine = MLXEngine(None, max_kv_size=37, keep=4)
    tokens = token_stream(engine.config.vocab_size, L + 3)
    case = Case(length=L, decode_steps=3)
    caches = engine.new_caches(case)
    prefill_logits = engine.forward(tokens[:L], caches)  # [L, vocab], one chunk
    run_steps = []
    from ropekv.adapters.mlx.probes import ForwardProbe

    for t in case.decode_positions:
        probe = ForwardProbe(engine.config.num_layers, "mlx")
        logits = engine.forward(tokens[t : t + 1], caches, probe)
        run_steps.append((t, logits[-1], probe.layers()[0].key_positions))
    t0, _, keys0 = run_steps[0]
    print(f"decode at {t0} reads {len(keys0)} keys: {sorted(keys0.tolist())}")

    ref = ReferenceDecoder(engine.checkpoint)
    plain = ref.forward(tokens, window=37).logits
    sinks = ref.forward(tokens, window=33, sink_tokens=4).logits
    print(
        f"last prefill row ({L - 1}): max|dlogit| vs window 37: "
        f"{(prefill_logits[-1].double() - plain[L - 1]).abs().max():.2e}; "
        f"vs 4 sinks + 33: {(prefill_logits[-1].double() - sinks[L - 1]).abs().max():.2e}"
    )
    for t, logits, _ in run_steps:
        print(
            f"decode {t}: max|dlogit| vs window 37: {(logits.double() - plain[t]).abs().max():.2e}; "
            f"vs 4 sinks + 33: {(logits.double() - sinks[t]).abs().max():.2e}"
        )
    for c in (Case(length=L, window=37), Case(length=L, window=33, sink_tokens=4)):
        print(f"\nropekv check, RotatingKVCache(max_size=37, keep=4), reference {c.label()}:")
        show(engine, c)
    keep0 = engine.with_options(keep=0)
    print("\nropekv check, RotatingKVCache(max_size=37, keep=0), reference window 37:")
    show(keep0, Case(length=L, window=37))


if __name__ == "__main__":
    main()
