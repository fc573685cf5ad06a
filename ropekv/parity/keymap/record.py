"""The key map record: what every key the kernel read, and its query, really is, per head.

A *cell* is one token at one head (``[N, K]``: the ``N`` keys at the ``K`` KV heads, or the query at its
``H`` heads as ``[1, H]``). Each cell carries the explanation the fit chose for it (:mod:`.fit`): the
positions it sits at per M-RoPE section, the rotation it was turned under (an index into
:attr:`KeyMap.rotations`, 0 being the contract's), the reference row its content is (its own token's
normally), its length relative to what the contract gives that row there, and what is left over.
Every bug-class explanation reads this record; the report prints it (:mod:`ropekv.parity.explain.pattern` describes what no class explains).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...rope import RopeSpec
from .rotations import Rotation

FIT_OK = 0.995  # a cell fits an explanation at this cosine (bf16 storage costs ~1e-5; one position off, ~0.05)


MAX_JSON_KEYS = 64  # key rows a report's JSON holds per key map


def fit_ok(noise: float) -> float:
    """The cosine a cell must reach to fit its explanation under an engine with ``noise``:
    :data:`FIT_OK`, or lower where the noise itself costs more (an fp8 cache: ``1 - noise**2``)."""
    return min(FIT_OK, 1 - noise**2)


# The relative residual a cell may keep and still count as exact, by the engine's dtype: float32 keys
# differ from the float64 reference by ~1e-6 at layer 0 and ~1e-4 deep in SmolLM2-135M; bfloat16 storage
# alone costs ~4e-3 a vector; an fp8 cache's e4m3 codes ~3e-2. Every catalogued bug leaves far more.
NOISE = {"float64": 1e-6, "float32": 5e-3, "float16": 1e-2, "bfloat16": 3e-2, "fp8": 0.12}
SCALE_TOL = 0.01  # |scale - 1| a cell keeps and still counts as the right length (bf16's 2^-8 is 0.004)


@dataclass(frozen=True, eq=False)
class TokenFits:
    """``N`` tokens at ``K`` heads each, with the explanation chosen per cell.

    Positions are logical; ``expected`` is what each section should turn by (the streams of an
    M-RoPE token, else its position), ``effective`` what it does under the chosen rotation."""

    positions: torch.Tensor  # [N] int64 logical positions
    own: torch.Tensor  # [N] int64 each token's row in the reference (position - shift)
    expected: torch.Tensor  # [N, S] int64
    effective: torch.Tensor  # [N, K, S] int64
    fit: torch.Tensor  # [N, K] float64 cosine of the cell against its explanation
    rotation: torch.Tensor  # [N, K] int64 index into KeyMap.rotations
    source: torch.Tensor  # [N, K] int64 reference row of the content (own normally; -1: none found)
    source_head: torch.Tensor  # [N, K] int64 the head of that row
    scale: torch.Tensor  # [N, K] float64 length against the explanation's (1: right)
    residual: torch.Tensor  # [N, K] float64 relative residual after that scale
    passthrough: torch.Tensor  # [N, K] float64 relative change of channels RoPE leaves alone (0: none)
    searched: torch.Tensor  # [N, K] bool: the integer search ran (no named position fitted first)
    fit_ok: float = FIT_OK  # the cosine a cell must reach to fit (fit_ok(noise))

    @property
    def num(self) -> int:
        return int(self.positions.shape[0])

    @property
    def heads(self) -> int:
        return int(self.fit.shape[1])

    @property
    def ok(self) -> torch.Tensor:
        """``[N, K]``: the cell fits its explanation."""
        return self.fit >= self.fit_ok

    @property
    def at_expected(self) -> torch.Tensor:
        """``[N, K]``: every section at the position it should turn by."""
        return (self.effective == self.expected[:, None, :]).all(-1)

    @property
    def own_content(self) -> torch.Tensor:
        return (self.source == self.own[:, None]) & (self.source_head == torch.arange(self.heads)[None, :])

    def placed(self) -> torch.Tensor:
        """``[N, K]``: its own content, at its positions, under the contract's rotation."""
        return self.ok & self.at_expected & (self.rotation == 0) & self.own_content

    def exact(self, noise: float) -> torch.Tensor:
        """``[N, K]``: placed, the right length, nothing left over beyond ``noise``."""
        return (
            self.placed()
            & (self.residual <= noise)
            & ((self.scale - 1).abs() <= max(SCALE_TOL, noise / 2))
            & (self.passthrough <= noise)
        )

    def offsets(self) -> torch.Tensor:
        """``[N, K, S]`` effective minus expected positions."""
        return self.effective - self.expected[:, None, :]

    def agreed(self) -> list[int | None]:
        """Per token, the position (section 0) every head of it sits at with its own content (under
        whichever rotation explains it), or None where the heads disagree or one does not fit."""
        out: list[int | None] = []
        ok = self.ok & self.own_content
        eff = self.effective[..., 0]
        for i in range(self.num):
            row = eff[i]
            out.append(int(row[0]) if bool(ok[i].all()) and bool((row == row[0]).all()) else None)
        return out


@dataclass(frozen=True, eq=False)
class KeyMap:
    """The fit of one decode row at one layer: its query and every key the kernel read.

    ``slots [N]``: each key's physical slot from the engine's metadata (-1 unknown);
    ``visible [N]``: whether the reference's mask shows that key to this query; ``missed``:
    positions the reference shows that the kernel did not read; ``values`` / ``value_scale`` ``[N, K]``:
    the relative residual and length of each value against the reference's value of the same row
    (NaN where the engine records no values)."""

    layer: int
    rope: RopeSpec | None
    query_position: int
    seq_len: int
    noise: float
    query: TokenFits
    keys: TokenFits
    slots: torch.Tensor  # [N]
    visible: torch.Tensor  # [N] bool
    missed: torch.Tensor  # [M] int64 positions
    values: torch.Tensor  # [N, K]
    value_scale: torch.Tensor  # [N, K]
    rotations: tuple[Rotation, ...]
    rotary_pairs: int  # pairs the layer turns (0: a NoPE layer)

    def key_exact(self) -> torch.Tensor:
        return self.keys.exact(self.noise)

    def query_exact(self) -> torch.Tensor:
        """``[H]``: query heads that are exactly right."""
        return self.query.exact(self.noise)[0]

    def wrong_keys(self) -> torch.Tensor:
        """``[N, K]``: key cells that are not exactly right (the divergence the explanations account for)."""
        return ~self.key_exact()

    def wrong_query(self) -> torch.Tensor:
        """``[H]``: query heads that are not exactly right."""
        return ~self.query_exact()

    def values_wrong(self) -> torch.Tensor:
        """``[N, K]``: value cells off the reference beyond the noise (False where none are recorded)."""
        v = self.values
        return torch.isfinite(v) & (v > self.noise) | torch.isinf(v)

    def rotation_name(self, index: int) -> str:
        return self.rotations[index].name

    def to_dict(self, max_keys: int = MAX_JSON_KEYS) -> dict[str, object]:
        """The key map as the report's JSON holds it: the layer, the query, and one row per key
        (the first ``max_keys`` wrong ones, then right ones up to ``max_keys``), each with its
        logical position, slot, effective position per KV head, fit, scale, source row and rotation."""
        wrong = self.wrong_keys().any(1)
        order = torch.cat((torch.nonzero(wrong).flatten(), torch.nonzero(~wrong).flatten()))[:max_keys]
        k = self.keys

        def cell_rows(t: TokenFits, i: int) -> dict[str, object]:
            return {
                "effective": t.effective[i, :, 0].tolist(),
                "fit": [round(float(x), 4) for x in t.fit[i]],
                "scale": [round(float(x), 4) for x in t.scale[i]],
                "source": t.source[i].tolist(),
                "rotation": [self.rotation_name(int(r)) for r in t.rotation[i]],
            }

        return {
            "layer": self.layer,
            "keys_total": k.num,
            "keys_wrong": int(wrong.sum()),
            "query": {"position": self.query_position, **cell_rows(self.query, 0)},
            "keys": [
                {
                    "position": int(k.positions[i]),
                    "slot": int(self.slots[i]),
                    "wrong": bool(wrong[i]),
                    **cell_rows(k, i),
                }
                for i in order.tolist()
            ],
        }
