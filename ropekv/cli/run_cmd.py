"""``ropekv run``: load a checkpoint, show what was loaded, and predict with the reference decoder and
the cached engine side by side (a quick smoke test of a model before a full ``ropekv check``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..argtypes import split_ints
from ..errors import UsageError
from .options import add_model_argument, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="load a model and predict the next tokens for a prompt",
        description="Loads a checkpoint, prints what it loaded and the next-token prediction of the "
        "float64 reference decoder, then greedy-decodes with ropekv's cached engine.",
    )
    add_model_argument(p)
    p.add_argument("--prompt", help="prompt text (needs a tokenizer: the default model or a tokenizer.json)")
    p.add_argument("--token-ids", help="comma-separated prompt token ids instead of text")
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=8,
        help="tokens to generate greedily (default 8; then bounded by the model's positions)",
    )
    p.add_argument(
        "--key-form",
        choices=("raw", "rotated"),
        default="rotated",
        help="cache key form of ropekv's engine (default rotated)",
    )
    p.set_defaults(handler=run)


def _tokenizer(model: str | None):
    from ..models.embedded import is_embedded_name
    from ..models.tokenizer import Tokenizer

    if model is None or is_embedded_name(model):
        from ..models.default import default_tokenizer

        return default_tokenizer(model)
    path = Path(model)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(path / "tokenizer.json")
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    return None


def run(args: argparse.Namespace) -> int:
    import torch

    from ..adapters.native import NativeAdapter
    from ..models import load_checkpoint, load_config
    from ..models.embedded import EMBEDDED
    from ..models.reference import ReferenceDecoder
    from ..parity.cases import Case

    cfg = load_config(args.model)  # names a missing or bad model before anything else; reads no weights
    tok = _tokenizer(args.model)
    if args.token_ids:
        parsed = split_ints(args.token_ids)  # ASCII digits only, no empty entry
        if parsed is None:
            raise UsageError(f"--token-ids: expected comma-separated integers, got {args.token_ids!r}")
        ids = parsed
    else:
        if tok is None:
            raise UsageError("this model has no tokenizer.json: pass --token-ids")
        ids = tok.encode(
            args.prompt or EMBEDDED.get(args.model or "smollm2-135m", EMBEDDED["smollm2-135m"]).default_prompt
        )
    if not ids:
        raise UsageError("the prompt is empty")
    if max(ids) >= cfg.vocab_size or min(ids) < 0:
        raise UsageError(f"token ids must be in [0, {cfg.vocab_size})")
    if len(ids) + args.max_new_tokens > cfg.max_position_embeddings:
        raise UsageError(f"prompt + new tokens exceed the model's {cfg.max_position_embeddings} positions")
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.model)
    cfg = ckpt.config
    print(f"loaded {cfg.name} from {ckpt.source} in {time.perf_counter() - t0:.1f} s")
    print(
        f"  architecture {cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads x {cfg.head_dim}, vocab {cfg.vocab_size}, "
        f"{cfg.max_position_embeddings} positions"
    )
    r = cfg.rope
    where = f" from channel {r.rotary_offset}" if r.rotary_offset else ""  # MLA: the trailing rope part
    print(
        f"  RoPE: theta {r.theta:g}, rotary_dim {r.rotary_dim}{where}, layout {r.layout}, scaling "
        f"{r.scaling.rope_type}, attention factor {r.attention_factor:g} (fingerprint {r.fingerprint()})"
    )
    if not cfg.uniform_rope:  # per-layer RoPE (gemma3's sliding and global layers)
        groups: dict[str, list[int]] = {}
        for i in range(cfg.num_layers):
            spec = cfg.layer_rope(i)
            groups.setdefault(
                "NoPE" if spec is None else f"theta {spec.theta:g} ({spec.scaling.rope_type})", []
            ).append(i)
        for what, layers in groups.items():
            print(f"    layers {','.join(map(str, layers))}: {what}")
    print(f"  model fingerprint {ckpt.fingerprint}")
    prompt = torch.tensor(ids)
    text = tok.decode(ids) if tok else str(ids)
    print(f"prompt ({len(ids)} tokens): {text!r}")

    t0 = time.perf_counter()
    ref = ReferenceDecoder(ckpt, dtype=torch.float64).forward(prompt).logits[-1]
    top = torch.topk(torch.softmax(ref, -1), 5)
    print(f"float64 reference next token ({time.perf_counter() - t0:.1f} s):")
    for p, i in zip(top.values.tolist(), top.indices.tolist()):
        print(f"  {i:>6} {repr(tok.decode([i])) if tok else '':<16} p={p:.4f}")

    engine = NativeAdapter(ckpt, key_form=args.key_form).make_engine(
        Case(length=len(ids), decode_steps=args.max_new_tokens, block_size=16)
    )
    t0 = time.perf_counter()
    logits = engine.prefill("run", prompt)
    out = []
    for _ in range(args.max_new_tokens):
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        logits = engine.decode("run", nxt).logits[0]
    dt = time.perf_counter() - t0
    agree = "agrees" if out[0] == int(top.indices[0]) else "DISAGREES"
    print(
        f"cached engine ({args.key_form} keys), greedy {len(out)} tokens in {dt:.1f} s; first token {agree} "
        f"with the reference:"
    )
    print(f"  {tok.decode(out) if tok else out!r}")
    return 0
