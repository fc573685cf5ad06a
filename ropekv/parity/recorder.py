"""The shared attention recorder: what every adapter uses at the attention boundary.

Adapters never build attention logits. They record, per layer, the query and keys their kernel used
and the keys' logical positions (:class:`AttentionRecorder`); ropekv turns those into pre-softmax
logits with one function (:func:`attention_logits`), the same for the float64 reference, ropekv's
engine and every engine under test, so a difference in logits is a difference in what the kernels saw.
"""

from __future__ import annotations

import torch

from ..probe import LayerProbe


def visible_keys(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    sink_tokens: int = 0,
    chunk: int | None = None,
) -> torch.Tensor:
    """Boolean mask ``[R, N]``: key at position ``j`` visible to the query at position ``i`` iff
    ``j <= i`` and (no window, or ``i - window < j``, or ``j < sink_tokens``): HF's sliding-window
    semantics (``W`` keys, the query's own included) with StreamingLLM sinks; on a chunked layer
    also ``j >= (i // chunk) * chunk`` (llama4's chunked attention: the query's own chunk)."""
    i = query_positions.reshape(-1, 1).to(torch.int64)
    j = key_positions.reshape(1, -1).to(torch.int64)
    mask = j <= i
    if window is not None:
        mask &= (j > i - window) | (j < sink_tokens)
    if chunk is not None:
        mask &= j >= (i // chunk) * chunk
    return mask


def attention_logits(
    probe: LayerProbe,
    query_positions: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    sink_tokens: int = 0,
    softcap: float | None = None,
    mask_by_position: bool = True,
    chunk: int | None = None,
) -> torch.Tensor:
    """Pre-softmax scores ``[H, R, N]`` of ``probe.q [R, H, D]`` against ``probe.k [N, KVH, D]``,
    in float64, scaled by ``scale``, soft-capped (``softcap * tanh(s / softcap)``) where the model caps,
    and set to ``-inf`` where a key is not visible to the query by its logical position.

    ``mask_by_position=False`` keeps every given key (a decode step whose keys are exactly those the
    kernel read: a key the engine should not have read then shows up as an error, not as hidden)."""
    q = probe.q.double()
    k = probe.k.double()
    num_heads, num_kv = q.shape[1], k.shape[1]
    kv_head = torch.arange(num_heads) // (num_heads // num_kv)  # [H]
    scores = torch.einsum("rhd,nhd->hrn", q, k[:, kv_head]) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask_by_position:
        mask = visible_keys(query_positions, probe.key_positions, window, sink_tokens, chunk)  # [R, N]
        scores = scores.masked_fill(~mask[None], float("-inf"))
    return scores


class AttentionRecorder:
    """Collects one :class:`LayerProbe` per layer while an engine runs one forward (a decode step or a
    probed full forward). Hooks call :meth:`record`; :meth:`take` returns the layers in order and
    empties the recorder. Tensors are detached and copied to CPU: the engine may reuse its buffers."""

    def __init__(self, num_layers: int):
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self._layers: dict[int, LayerProbe] = {}

    def record(
        self,
        layer: int,
        *,
        q: torch.Tensor,
        k: torch.Tensor,
        key_positions: torch.Tensor,
        key_slots: torch.Tensor | None = None,
        hidden_in: torch.Tensor | None = None,
        q_raw: torch.Tensor | None = None,
        k_raw: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> None:
        """``q [R, H, D]``, ``k [N, KVH, D]``, ``key_positions [N]`` (see :class:`LayerProbe`). A second
        record for the same layer replaces the first (an engine that runs a layer twice per forward
        reports the call that produced the output)."""

        def cpu(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu").clone()

        def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else cpu(t)

        self._layers[layer] = LayerProbe(
            q=cpu(q),
            k=cpu(k),
            key_positions=cpu(torch.as_tensor(key_positions)).to(torch.int64),
            key_slots=None if key_slots is None else cpu(torch.as_tensor(key_slots)).to(torch.int64),
            hidden_in=maybe(hidden_in),
            q_raw=maybe(q_raw),
            k_raw=maybe(k_raw),
            v=maybe(v),
        )

    def take(self) -> tuple[LayerProbe, ...]:
        """The recorded layers ``0..L-1`` in order (validation names any layer that is missing)."""
        layers = tuple(self._layers[i] for i in sorted(self._layers))
        self._layers = {}
        return layers

    def clear(self) -> None:
        self._layers = {}
