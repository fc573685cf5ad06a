"""Comparing top-k log-probabilities, for engines that return only those (vLLM's ``logprobs``).

Two top-k lists of the same distribution may hold different tokens near the k-th place. On the
union of the two sets: a token both have is compared directly; a token only one side lists must sit,
on the other side, below that side's k-th value, so the error it shows is at least
``max(0, value - other side's k-th value)``. Against full logits (ropekv's reference) every value is
known: the listed tokens are compared directly, and any token the reference ranks in its own top k
that the engine left out counts with the same lower bound.
"""

from __future__ import annotations

import torch


def topk_error(ids_a: torch.Tensor, lp_a: torch.Tensor, ids_b: torch.Tensor, lp_b: torch.Tensor) -> float:
    """Largest log-probability difference on the union of two top-k lists (``[K]`` ids and values each)."""
    a = dict(zip(ids_a.tolist(), lp_a.double().tolist()))
    b = dict(zip(ids_b.tolist(), lp_b.double().tolist()))
    floor_a, floor_b = min(a.values()), min(b.values())
    err = 0.0
    for token in a.keys() | b.keys():
        if token in a and token in b:
            err = max(err, abs(a[token] - b[token]))
        elif token in a:
            err = max(err, a[token] - floor_b)
        else:
            err = max(err, b[token] - floor_a)
    return err


def topk_error_vs_logits(ids: torch.Tensor, lp: torch.Tensor, logits: torch.Tensor) -> float:
    """Largest difference between top-k log-probabilities ``lp [K]`` at ``ids [K]`` and the
    log-softmax of full ``logits [V]``, including reference top-k tokens the list left out."""
    ref = torch.log_softmax(logits.double(), dim=-1)
    err = float((lp.double() - ref[ids]).abs().max())
    listed = set(ids.tolist())
    floor = float(lp.double().min())
    for token in torch.topk(ref, ids.numel()).indices.tolist():
        if token not in listed:
            err = max(err, float(ref[token]) - floor)
    return err
