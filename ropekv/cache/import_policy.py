"""What the decode side does to keys imported into its cache beyond the explicit key-form conversion.

The import itself is ``ropekv.transfer.importer.import_handoff``; the policy lives below it (and below
``ropekv.faults``), so that a handoff fault is a one-method subclass here, the way rotation faults
subclass :class:`~ropekv.engine.rotation.RotationPolicy`, and the importer has no fault switches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..rope import RopeSpec

if TYPE_CHECKING:
    from ..contract import CacheContract


class ImportPolicy:
    """What the decode side does to imported keys beyond the explicit conversion: nothing.

    Faults override :meth:`imported_keys` (``ropekv.faults.handoff.RotateOnTransfer``) or
    :meth:`received_rows` (``ropekv.bugs.block_layout_mismatch``).
    """

    name = "correct"

    def received_rows(self, sender: CacheContract, rows: torch.Tensor) -> torch.Tensor:
        """One layer's keys or values ``[rows, KVH, D]`` as the decode side reads them off the transfer,
        before any conversion (``sender``: the contract they were sent under): as they were sent."""
        return rows

    def imported_keys(self, rope: RopeSpec, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys ``[rows, KVH, D]`` (in the engine's key form) at ``positions [rows]`` as they will be stored."""
        return keys
