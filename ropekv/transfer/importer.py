"""Export a cached sequence as a :class:`Handoff`, and import one into an engine, all or nothing.

The import boundary is where the contract is enforced: the payload's contract (the prefill side's)
must equal the engine's (the decode side's). With ``convert="explicit"`` and a difference in the key
form alone, keys are converted exactly once, here: raw keys are rotated at their logical positions,
rotated ones unrotated. Nothing else is ever converted -- a "rotate everything for consistency"
change is precisely the bug (docs/contract.md).

Windowed layers travel as the tokens their ring still holds (``Handoff.layer_rows``); the import
rebuilds the ring by appending the whole sequence in one call, in which the rows a ring would
overwrite are never stored (``PagedKVCache.append`` writes only a chunk's surviving rows).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ..cache.import_policy import ImportPolicy
from ..cache.paged import PagedKVCache
from ..cache.quant import dequantize
from ..contract import CacheContract
from ..errors import CacheError, ContractMismatch, PayloadError, UsageError
from ..models.config import ModelConfig
from ..numbers import is_int
from .payload import Handoff, check_token_ids

ConvertMode = Literal["never", "explicit"]
CONVERT_MODES: tuple[str, ...] = get_args(ConvertMode)
_KEY_FORM_FIELDS = {"key_form"}  # what a key-form difference shows as (kernel_rotates is derived from it)


@dataclass(frozen=True)
class ModelLimits:
    """What the model that will read an imported sequence can run: logical positions in
    ``[0, position_limit)`` and token ids in ``[0, vocab_size)``.

    The contract says how keys were written, not which model reads them next; a payload whose checksum
    is valid can still hold positions past the model's maximum or token ids past its vocabulary (a
    sender with another model, a hand-edited file). Those are refused at the import, before the cache
    is touched, instead of at the first decode step or never."""

    position_limit: int
    vocab_size: int

    def __post_init__(self) -> None:
        for name in ("position_limit", "vocab_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise UsageError(f"ModelLimits.{name} must be a positive integer, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, config: ModelConfig) -> ModelLimits:
        return cls(position_limit=config.position_limit, vocab_size=config.vocab_size)

    def check_count(self, num_tokens: int, what: str) -> None:
        """Strictly increasing positions from 0 fit ``position_limit`` tokens at most."""
        if num_tokens > self.position_limit:
            raise PayloadError(
                f"{what} holds {num_tokens} tokens, more than the model's {self.position_limit} positions"
            )

    def check(self, tokens: torch.Tensor, positions: torch.Tensor, what: str) -> None:
        """``tokens [n]`` and ``positions [n]`` (int64) within the model's vocabulary and positions."""
        self.check_count(int(positions.numel()), what)
        beyond = torch.nonzero(positions >= self.position_limit)
        if beyond.numel():
            i = int(beyond[0])
            raise PayloadError(
                f"{what} position {int(positions[i])} (token {i}) is beyond the model's {self.position_limit} positions"
            )
        check_token_ids(tokens, what, self.vocab_size)


def plan_import(ours: CacheContract, theirs: CacheContract, convert: str = "never") -> str | None:
    """The conversion an import of keys written under ``theirs`` into ``ours`` needs: None (contracts
    equal), ``"rotate"`` (raw -> rotated) or ``"unrotate"`` (rotated -> raw). Raises
    :class:`ContractMismatch` naming every differing field when the import must be refused."""
    if convert not in CONVERT_MODES:
        raise UsageError(f"convert must be one of {', '.join(CONVERT_MODES)}, got {convert!r}")
    diffs = ours.diff(theirs)
    if not diffs:
        return None
    names = {d.field for d in diffs}
    only_form = names <= _KEY_FORM_FIELDS
    if convert == "explicit" and only_form:
        if ours.rope.length_dependent:
            raise ContractMismatch(
                f"cannot convert keys from {theirs.key_form!r} to {ours.key_form!r}: "
                f"{ours.rope.scaling.rope_type} RoPE frequencies depend on the sequence length at the time a key "
                "was rotated, which the payload does not record",
                fields=("key_form",),
            )
        return "rotate" if ours.key_form == "rotated" else "unrotate"
    try:
        ours.require_compatible(theirs, ours="decode", theirs="prefill")
    except ContractMismatch as exc:
        if only_form:
            hint = "; convert='explicit' would convert the key form once, at this boundary"
        elif convert == "explicit":
            hint = "; convert='explicit' converts the key form only, never the other fields"
        else:
            hint = ""
        raise ContractMismatch(f"{exc}{hint}", fields=exc.fields) from None
    return None  # unreachable: diffs were non-empty


def export_handoff(cache: PagedKVCache, seq_id: str | int, tokens: torch.Tensor) -> Handoff:
    """The cached state of ``seq_id`` in ``cache`` (copies); ``tokens [n]`` are the ids it has consumed."""
    c = cache.contract
    n = cache.num_tokens(seq_id)  # CacheError for an unknown sequence
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 1 or tokens.numel() != n or tokens.is_floating_point():
        raise UsageError(
            f"export of {seq_id!r}: tokens must be 1-D integer ids, one per cached token ({n}), "
            f"got shape {tuple(tokens.shape)}"
        )
    if n == 0:
        raise CacheError(f"export of {seq_id!r}: the sequence is empty")
    if c.kv_quant is not None:  # an 8-bit cache: its codes and the scales that dequantize them
        codes = [cache.codes(seq_id, layer) for layer in range(c.num_layers)]
        keys, values = tuple(k.cpu() for k, _ in codes), tuple(v.cpu() for _, v in codes)
        scales = cache.layer_scales()
    else:
        views = [cache.view(seq_id, layer) for layer in range(c.num_layers)]
        keys, values, scales = tuple(v.keys.cpu() for v in views), tuple(v.values.cpu() for v in views), None
    return Handoff(
        contract=c,
        seq_id=seq_id,
        tokens=tokens.to(torch.int64).cpu().clone(),
        positions=all_positions(cache, seq_id).cpu().clone(),
        keys=keys,
        values=values,
        scales=scales,
    )


def all_positions(cache: PagedKVCache, seq_id: Hashable) -> torch.Tensor:
    """Logical positions ``[n]`` of every token of ``seq_id``. A full layer has them all; when every
    layer slides and the ring has wrapped, the evicted tokens' positions are rebuilt only where strict
    increase forces them (consecutive positions), never guessed."""
    c, n = cache.contract, cache.num_tokens(seq_id)
    kept = cache.positions(seq_id)  # the full group's, or the live sliding ones when every layer slides
    if len(c.window_layers) < c.num_layers or kept.numel() == n:
        return kept
    s = c.sink_tokens
    low = int(kept[s - 1]) if s else -1
    high = int(kept[s])
    evicted = n - kept.numel()
    if high - low - 1 != evicted:
        raise CacheError(
            f"export of {seq_id!r}: every layer slides and the ring evicted {evicted} token(s) whose positions "
            f"the cache no longer holds; positions {low} and {high} around them do not determine them"
        )
    return torch.cat((kept[:s], torch.arange(low + 1, high, dtype=torch.int64, device=kept.device), kept[s:]))


def import_handoff(
    cache: PagedKVCache,
    handoff: Handoff,
    *,
    convert: str = "never",
    seq_id: Hashable | None = None,
    policy: ImportPolicy | None = None,
    limits: ModelLimits | None = None,
) -> Hashable:
    """Import ``handoff`` into ``cache`` as ``seq_id`` (default: the handoff's); returns the id.
    ``limits``: the reading model's positions and vocabulary, checked against the handoff's content
    (:class:`ModelLimits`; a payload's own checks bound them only by what any model could hold).

    All or nothing: the contract check, the conversion and every tensor are done before the cache is
    touched, and the one append either writes everything or raises having changed nothing; on any
    error the new sequence is dropped, so the cache and every other sequence are exactly as before.
    """
    if not isinstance(handoff, Handoff):
        raise UsageError(f"import_handoff needs a Handoff (see read_payload), got {type(handoff).__name__}")
    if not isinstance(cache, PagedKVCache):
        raise UsageError(f"import_handoff needs a PagedKVCache, got {type(cache).__name__}")
    ours = cache.contract
    conversion = plan_import(ours, handoff.contract, convert)
    if limits is not None:
        limits.check(handoff.tokens, handoff.positions, "import")
    sid = handoff.seq_id if seq_id is None else seq_id
    if cache.has(sid):
        raise CacheError(f"import: sequence {sid!r} already exists in this cache")
    keys, values = _layer_tensors(ours, handoff, conversion, policy or ImportPolicy())
    cache.create(sid)
    try:
        # an 8-bit cache takes the sender's scales for layers it has none for yet (its codes then
        # arrive unchanged); a layer with scales of its own re-quantizes the dequantized rows under them
        cache.append(
            sid, handoff.positions.to(cache.device), keys, values, key_form=ours.key_form, scales=handoff.scales
        )
    except BaseException:
        cache.free(sid)
        raise
    return sid


def _layer_tensors(
    c: CacheContract, h: Handoff, conversion: str | None, policy: ImportPolicy
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys and values ``[n, KVH, D]`` for one append of the whole sequence. A windowed
    layer's evicted rows are zeros: the append stores only the rows its ring keeps, which are exactly
    the rows the payload carries (the contracts are equal, so the rings are the same)."""
    n, rope = h.num_tokens, c.rope
    keys, values = [], []
    for layer in range(c.num_layers):
        rows = h.layer_rows(layer)  # [m]
        pos = h.positions[rows]
        k = policy.received_rows(h.contract, h.keys[layer])
        v = policy.received_rows(h.contract, h.values[layer])
        if h.scales is not None:  # 8-bit codes: numbers again, under the sender's scales
            k, v = dequantize(k, h.scales[layer].k), dequantize(v, h.scales[layer].v)
        if conversion == "rotate":
            k = rope.rotate(k, pos)
        elif conversion == "unrotate":
            k = rope.unrotate(k, pos)
        k = policy.imported_keys(rope, k, pos).to(c.compute_dtype)
        v = v.to(c.compute_dtype)
        if rows.numel() < n:
            k = torch.zeros((n, *k.shape[1:]), dtype=k.dtype).index_copy_(0, rows, k)
            v = torch.zeros((n, *v.shape[1:]), dtype=v.dtype).index_copy_(0, rows, v)
        keys.append(k)
        values.append(v)
    return keys, values


__all__ = ["CONVERT_MODES", "ModelLimits", "all_positions", "export_handoff", "import_handoff", "plan_import"]
