"""Finding: prefilling one prompt in two chunks (60 + 40) instead of one changes the decode logits
of an mlx-lm RotatingKVCache(max_size=37, keep=4), by up to ~2.7.

``RotatingKVCache.make_mask`` builds the prefill mask over buffer indices (``offset =
min(max_size - 1, offset)``) while its buffer after the first chunk holds the 4 sink rows followed by
the 32 newest: for the second chunk's first queries the sinks fall inside the index window and part of
the true window was trimmed away. With keep=0 the buffer holds the last max_size - 1 keys in order, the
index window equals the position window, and one chunk and two agree (and match the reference).

Run from .venv-mlx:  .venv-mlx/bin/python scripts/findings/mlx_rotating_chunked_prefill.py
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


L, FIRST = 100, 60


def decode_logits(engine: MLXEngine, tokens, chunks: list[int]):
    caches = engine.new_caches(Case(length=L))
    start = 0
    for n in chunks:
        engine.forward(tokens[start : start + n], caches)
        start += n
    return [engine.forward(tokens[t : t + 1], caches)[-1] for t in range(L, L + 3)]


def main() -> None:
    engine = MLXEngine(None, max_kv_size=37, keep=4)
    tokens = token_stream(engine.config.vocab_size, L + 3)
    ref = ReferenceDecoder(engine.checkpoint).forward(tokens, window=37).logits
    for keep in (4, 0):
        variant = engine.with_options(keep=keep)
        one = decode_logits(variant, tokens, [L])
        two = decode_logits(variant, tokens, [FIRST, L - FIRST])
        diff = max(float((a - b).abs().max()) for a, b in zip(one, two))
        vs_ref = max(float((b.double() - ref[L + i]).abs().max()) for i, b in enumerate(two))
        print(
            f"RotatingKVCache(37, keep={keep}): one chunk vs {FIRST}+{L - FIRST}: max|dlogit| {diff:.3g}; "
            f"two chunks vs float64 window-37 reference: {vs_ref:.3g}"
        )
    print("\nropekv check, keep=0, chunked prefill (chunk=60):")
    show(engine.with_options(keep=0), Case(length=L, window=37, chunk=FIRST))


if __name__ == "__main__":
    main()
