"""What a vLLM connector's store entry holds, against the keys the producer's hooks saw.

For every prompt the consumer reads, the entry under its key (``ropekv.adapters.vllm.store``: vLLM's
key rule and block-memory unpacking for the producer's kernel ISA) is decoded and its keys are
compared, layer by layer, with the post-RoPE keys the producer's Attention modules got for each prompt
it prefilled. A correct store matches its own prompt exactly (which also tests the unpacking on
real files); a forged one matches another prompt, or none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..adapters.vllm.store import consumer_tokens, find_entry, read_entry
from ..errors import PayloadError, TransportError


def entry_findings(store: Path, producer: dict[str, Any], consumed: int) -> list[dict[str, Any]]:
    """One finding per prompt the consumer reads (the first ``consumed`` of the producer's): which
    prefilled prompt's keys its entry holds (``holds``: an index, or None) and the error to each."""
    from safetensors.torch import load_file

    side, prompts = producer["side"], producer["prompts"]
    contract, cache = side["contract"], side["cache_contract"]
    hooked = load_file(producer["keys"])  # p{prompt}.l{layer}: [L, KVH, D] float32
    out: list[dict[str, Any]] = []
    for k, p in enumerate(prompts[:consumed]):
        n = consumer_tokens(p["length"], side["block_size"])
        try:
            entry = find_entry(store, p["token_ids"][:n])
            if entry is None:
                raise TransportError(f"the store {store} has no entry for the {p['length']}-token prompt")
            stored = read_entry(
                entry,
                num_kv_heads=cache["num_kv_heads"],
                head_dim=cache["head_dim"],
                block_size=side["block_size"],
                isa=contract["kernel_isa"],
            )
        except PayloadError as exc:
            out.append({"prompt": k, "key": None, "holds": None, "errors": [], "error": str(exc)})
            continue
        errors = []
        for j in range(len(prompts)):
            worst = 0.0
            for i in range(stored.num_layers):
                ref = hooked[f"p{j}.l{i}"][: stored.num_tokens]
                worst = max(worst, float((stored.keys[i].float() - ref).abs().max()))
            errors.append(worst)
        best = min(range(len(errors)), key=errors.__getitem__)
        holds = best if errors[best] <= 1e-6 * max(1.0, float(hooked[f"p{best}.l0"].abs().max())) else None
        out.append({"prompt": k, "key": entry.key, "tokens": stored.num_tokens, "holds": holds, "errors": errors})
    return out


def describe(finding: dict[str, Any]) -> str:
    k = finding["prompt"]
    if finding.get("error"):
        return f"store entry of prompt {k}: unreadable: {finding['error']}"
    errors = ", ".join(f"{e:.3g}" for e in finding["errors"])
    if finding["holds"] == k:
        what = f"the producer's post-RoPE keys of this prompt, exactly (max error to each prefilled prompt: {errors})"
    elif finding["holds"] is not None:
        what = f"the keys of ANOTHER prompt the producer prefilled (#{finding['holds']}; max errors {errors})"
    else:
        what = f"keys of no prompt the producer prefilled (max errors {errors})"
    return f"store entry {finding['key']} ({finding['tokens']} tokens) of prompt {k}: {what}"
