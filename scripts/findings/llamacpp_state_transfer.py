"""What llama.cpp's sequence-state transfer accepts: state of one context restored into a fresh context
with other RoPE settings, through llama.cpp's own calls (unchecked), and what ropekv's checked pair says.

Run from .venv-llamacpp (about 2-4 minutes on 2 shared cores):

    PYTHONPATH=. OMP_NUM_THREADS=2 .venv-llamacpp/bin/python scripts/findings/llamacpp_state_transfer.py

For each reader setting and prompt length: what ``llama_state_seq_set_data`` returned (bytes read; 0 is a
refusal), the reader's decode against the correct restore (the writer decoding the same token:
max |dlogit| and the change in log-probability of the writer's top token, whether the top token
changes), against the reader's own full forward (scale-aware), and the fields ropekv's
``load_state`` names when it refuses. Then the session-file pairs under the same mismatch, and
whether two contexts made with the same YaRN settings on one loaded model run the same RoPE.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from ropekv.adapters.llamacpp import LlamaCppEngine
from ropekv.adapters.llamacpp.rope_params import RopeOverrides
from ropekv.adapters.llamacpp.state import (
    StateContext,
    get_seq_state,
    load_seq_file,
    load_state,
    save_seq_file,
    save_state,
)
from ropekv.adapters.llamacpp.state_check import References, check_transfer
from ropekv.errors import ContractMismatch
from ropekv.parity.cases import token_stream

READERS = [
    ("same settings (control)", RopeOverrides()),
    ("rope_freq_base 20000", RopeOverrides(freq_base=20000.0)),
    ("rope_freq_base 1e6", RopeOverrides(freq_base=1e6)),
    ("rope_freq_scale 0.5 (linear x2)", RopeOverrides(freq_scale=0.5)),
    (
        "yarn, rope_freq_scale 0.25, yarn_orig_ctx 8192",
        RopeOverrides(scaling_type="yarn", freq_scale=0.25, yarn_orig_ctx=8192),
    ),
    (
        "yarn, rope_freq_scale 0.25, yarn_orig_ctx 2048",
        RopeOverrides(scaling_type="yarn", freq_scale=0.25, yarn_orig_ctx=2048),
    ),
]
LENGTHS = (64, 512)
STEPS = 2


def main() -> int:
    import llama_cpp

    engine = LlamaCppEngine(n_ctx=1024)
    refs = References(engine)  # float64, built per RoPE spec on first use
    tokens = token_stream(engine.config.vocab_size, max(LENGTHS) + STEPS, seed=0).tolist()
    print(f"llama-cpp-python {llama_cpp.__version__}, {engine.name}, gguf {Path(engine.gguf_path).name}")
    print(f"model RoPE (GGUF): theta {engine.config.rope.theta:g}, {engine.config.rope.scaling.rope_type}")
    print()
    print("1. llama_state_seq_get_data -> fresh context with other RoPE settings -> llama_state_seq_set_data, decode")
    print(
        f"{'reader setting':<48} {'n':>4} {'set_data':>10} {'|dlogit| vs correct':>20} {'dlogp top':>10} "
        f"{'top':>7} {'vs own full':>12} {'vs float64':>10}  ropekv load_state"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for label, rope in READERS:
            for n in LENGTHS:
                # float64 only for the control at the short length: the other rows compare the reader with
                # the correct restore and with its own full forward (a float64 forward per RoPE costs minutes)
                ref = refs if rope == RopeOverrides() and n == LENGTHS[0] else None
                c = check_transfer(engine, ref, tokens, n, STEPS, reader_rope=rope, checked=False)
                verdict = _checked(engine, rope, tokens, n, Path(tmp) / "s")
                first = c.steps[0]
                worst = max(s.vs_writer for s in c.steps)
                print(
                    f"{label:<48} {n:>4} {c.accepted_bytes:>10} {worst:>20.4g} {first.logprob_change:>+10.4f} "
                    f"{'same' if all(s.same_top_token for s in c.steps) else 'CHANGED':>7} "
                    f"{max(s.vs_self for s in c.steps):>12.3g} {_worst_ref(c):>10}  {verdict}"
                )
        print()
        print("2. the session-file pairs, writer at the model's RoPE, reader at rope_freq_base 20000, n = 64")
        _files(engine, tokens, Path(tmp))
        print()
        print("3. checked pair, writer and reader with the same non-default settings, n = 64: parity against float64")
        print("   under ropekv's RoPE spec of what the graph runs (checks the mapping of llama.cpp's RoPE arguments)")
        for label, rope in READERS[3:5]:
            c = check_transfer(
                engine, refs, tokens, 64, STEPS, writer_rope=rope, reader_rope=rope, state_path=Path(tmp) / "same"
            )
            print(
                f"   {label:<48} vs float64 {_worst_ref(c)}, vs own full {max(s.vs_self for s in c.steps):.3g}, "
                f"vs writer {max(s.vs_writer for s in c.steps):.3g}: {'parity' if c.passed else 'NO PARITY'}"
            )
    print()
    print("4. two contexts made with the same YaRN settings (rope_freq_scale 0.25, no yarn_orig_ctx) on one model")
    _yarn_history()
    return 0


def _worst_ref(c) -> str:
    values = [s.vs_reference for s in c.steps if s.vs_reference is not None]
    return f"{max(values):.3g}" if values else "-"


def _checked(engine, rope, tokens, n, path) -> str:
    writer = StateContext(engine)
    writer.prefill(tokens[:n])
    save_state(writer, path, tokens[:n])
    reader = StateContext(engine, rope=rope)
    try:
        load_state(reader, path, tokens[:n])
    except ContractMismatch as exc:
        return "refused: " + ", ".join(exc.fields) + f" (reader empty: {reader.positions() == (-1, -1)})"
    return "loaded"


def _files(engine, tokens, tmp: Path) -> None:
    import llama_cpp

    n = 64
    writer = StateContext(engine)
    writer.prefill(tokens[:n])
    base = RopeOverrides(freq_base=20000.0)
    wrote = save_seq_file(writer, tmp / "seq.bin", tokens[:n])
    reader = StateContext(engine, rope=base)
    rc, read = load_seq_file(reader, tmp / "seq.bin", n)
    print(
        f"   llama_state_seq_save_file -> {wrote} bytes; llama_state_seq_load_file into the other context -> {rc} "
        f"(tokens back: {len(read)}, positions {reader.positions()})"
    )
    arr = (llama_cpp.llama_token * n)(*tokens[:n])
    ok = llama_cpp.llama_state_save_file(writer.ctx.ctx, os.fsencode(tmp / "ctx.bin"), arr, n)
    reader2 = StateContext(engine, rope=base)
    out = (llama_cpp.llama_token * n)()
    count = llama_cpp.ctypes.c_size_t(0)
    loaded = llama_cpp.llama_state_load_file(
        reader2.ctx.ctx, os.fsencode(tmp / "ctx.bin"), out, n, llama_cpp.ctypes.byref(count)
    )
    print(
        f"   llama_state_save_file -> {bool(ok)}; llama_state_load_file into the other context -> {bool(loaded)} "
        f"(tokens back: {count.value}, positions {reader2.positions()})"
    )
    size = len(get_seq_state(writer))
    print(f"   (the sequence state itself: {size} bytes for {n} tokens)")


def _yarn_history() -> None:
    engine = LlamaCppEngine(n_ctx=256)  # a fresh model load: nothing made before on it
    rope = RopeOverrides(scaling_type="yarn", freq_scale=0.25)
    first = StateContext(engine, rope=rope)
    second = StateContext(engine, rope=rope)
    print(f"   first context:  n_ctx_orig {first.run.n_ctx_orig}, attn_factor {first.run.attn_factor:.6f}")
    print(f"   second context: n_ctx_orig {second.run.n_ctx_orig}, attn_factor {second.run.attn_factor:.6f}")
    try:
        second.contract.require_compatible(first.contract, ours="second context", theirs="first context")
        print("   contracts agree")
    except ContractMismatch as exc:
        print(f"   ropekv: {exc}")


if __name__ == "__main__":
    sys.exit(main())
