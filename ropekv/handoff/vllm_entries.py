"""What a vLLM connector's store entry holds, against the keys and values the producer's hooks saw.

For every prompt the consumer reads, the entry under its key (``ropekv.adapters.vllm.store``: vLLM's
key rule and block-memory unpacking for the producer's kernel ISA) is decoded, and every row the
consumer injects (its :func:`consumer_tokens`) is compared, layer by layer, keys and values, bit for
bit with the post-RoPE keys and the values the producer's Attention modules got for each prompt it
prefilled. A correct store holds its own prompt's rows exactly (which also tests the unpacking on
real files); a forged one holds another prompt's, or none. An entry whose keys are its prompt's
exactly but whose values are not is a value mismatch, named so: nothing about RoPE is wrong there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..adapters.vllm.store import consumer_tokens, find_entry, read_entry
from ..errors import PayloadError, TransportError


def entry_findings(store: Path, producer: dict[str, Any], consumed: int) -> list[dict[str, Any]]:
    """One finding per prompt the consumer reads (the first ``consumed`` of the producer's): which
    prefilled prompt's keys and values its entry holds (``holds``: an index where both are that
    prompt's bit for bit, or None), the largest difference to each prompt (``errors``: keys,
    ``values_errors``: values), and ``value_mismatch`` (the layers whose values differ, where the keys
    are this prompt's exactly) or None."""
    from safetensors.torch import load_file

    side, prompts = producer["side"], producer["prompts"]
    contract, cache = side["contract"], side["cache_contract"]
    hooked = load_file(producer["keys"])  # p{prompt}.l{layer} keys, p{prompt}.v{layer} values: [L, KVH, D] float32
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
        keys = [_rows(hooked, f"p{j}.l", stored.keys, n) for j in range(len(prompts))]
        values = [_rows(hooked, f"p{j}.v", stored.values, n) for j in range(len(prompts))]
        exact = [not kd and not vd for (kd, _), (vd, _) in zip(keys, values)]
        holds = next((j for j, ok in enumerate(exact) if ok), None)
        mismatch = None
        if holds is None and not keys[k][0]:  # this prompt's keys exactly, not its values
            mismatch = {"layers": values[k][0], "max_error": values[k][1]}
        out.append(
            {
                "prompt": k,
                "key": entry.key,
                "tokens": stored.num_tokens,
                "holds": holds,
                "errors": [e for _, e in keys],
                "values_errors": [e for _, e in values],
                "value_mismatch": mismatch,
            }
        )
    return out


def _rows(
    hooked: dict[str, torch.Tensor], prefix: str, stored: tuple[torch.Tensor, ...], n: int
) -> tuple[list[int], float]:
    """``(layers whose n rows differ in any bit, largest |difference|)`` of ``stored`` against the
    producer's ``{prefix}{layer}`` tensors (float32: any float16 or bfloat16 value converts exactly)."""
    differ, worst = [], 0.0
    for i, rows in enumerate(stored):
        ref = hooked[f"{prefix}{i}"][:n]
        got = rows[:n].to(torch.float32)
        if got.shape != ref.shape or not torch.equal(got.view(torch.int32), ref.contiguous().view(torch.int32)):
            differ.append(i)
            if got.shape == ref.shape:
                worst = max(worst, float((got.double() - ref.double()).abs().nan_to_num(float("inf")).max()))
            else:
                worst = float("inf")
    return differ, worst


def describe(finding: dict[str, Any]) -> str:
    k = finding["prompt"]
    if finding.get("error"):
        return f"store entry of prompt {k}: unreadable: {finding['error']}"
    errors = ", ".join(f"{e:.3g}" for e in finding["errors"])
    mismatch = finding.get("value_mismatch")
    if finding["holds"] == k:
        what = (
            "the producer's post-RoPE keys and values of this prompt, bit for bit, in every injected row "
            f"(max key error to each prefilled prompt: {errors})"
        )
    elif mismatch is not None:
        layers = mismatch["layers"]
        shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
        what = (
            f"VALUE MISMATCH: the producer's post-RoPE keys of this prompt exactly, but the values of "
            f"{len(layers)} layer(s) ({shown}) differ from the producer's (max |diff| {mismatch['max_error']:.3g}): "
            "the stored values were changed; not a RoPE fault"
        )
    elif finding["holds"] is not None:
        what = f"the keys and values of ANOTHER prompt the producer prefilled (#{finding['holds']}; max key errors {errors})"
    else:
        what = f"keys and values of no prompt the producer prefilled (max key errors {errors})"
    return f"store entry {finding['key']} ({finding['tokens']} tokens) of prompt {k}: {what}"


def store_diagnosis(findings: list[dict[str, Any]]) -> str | None:
    """What the store check names, where it found a fault the parity forensics would misname: a value
    mismatch (keys exact, values changed) is no RoPE class."""
    if any(f.get("value_mismatch") for f in findings):
        return "value_mismatch (the stored values differ from the producer's; the keys are exact)"
    return None
