"""A vLLM logits processor that makes a request generate given tokens, so its decode steps feed the
case's token stream instead of the model's own choices.

Registered at engine start (``LLM(logits_processors=[ForcedTokens])``, vLLM's public V1 API) and
active only for requests whose ``SamplingParams.extra_args`` carry :data:`EXTRA_ARG`: output token
``i`` is forced to ``forced[i]``; past the list the request samples normally. vLLM's reported
log-probabilities are computed from the raw logits, before any logits processor
(``logprobs_mode="raw_logprobs"``, its default), so forcing does not change what is compared.
"""

from __future__ import annotations

import torch

EXTRA_ARG = "ropekv_forced_tokens"


def _force(forced: tuple[int, ...]):
    def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:  # logits: [vocab]
        i = len(output_ids)
        if i >= len(forced):
            return logits
        out = torch.full_like(logits, float("-inf"))
        out[forced[i]] = 0.0
        return out

    return apply


def processor_class():
    """The :class:`vllm...AdapterLogitsProcessor` subclass (built lazily: vLLM is imported only here)."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ForcedTokens(AdapterLogitsProcessor):
        @classmethod
        def validate_params(cls, params) -> None:
            forced = (params.extra_args or {}).get(EXTRA_ARG)
            if forced is not None and not all(isinstance(t, int) and t >= 0 for t in forced):
                raise ValueError(f"{EXTRA_ARG} must be a list of token ids")

        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            forced = (params.extra_args or {}).get(EXTRA_ARG)
            return None if forced is None else _force(tuple(forced))

    ForcedTokens.__qualname__ = ForcedTokens.__name__ = "ForcedTokens"
    return ForcedTokens
