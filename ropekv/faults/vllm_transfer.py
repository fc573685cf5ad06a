"""Faults of vLLM's disaggregated prefill, on real engines: what a consumer can differ in from the
producer whose store it reads, and what can happen to the store or the injection between them.

Each is a :class:`TransferFault` run by ``ropekv handoff --engine vllm --inject NAME``; the bare
``--connector example`` run must catch it and name it (the contract field that differs between the
two sides, and/or the bug class the forensics find). What each changes, and where:

- a consumer model directory (a copy of the producer's: ``config.json`` edited, or one weight tensor
  scaled; the other files linked): ``consumer_config`` / ``scale_tensor``;
- the consumer's dtype (``consumer_dtype``: vLLM's cache dtype follows the model dtype on CPU);
- the running consumer's injection (``inject_shift``: every injected key turned by ``shift`` more
  positions right after vLLM's connector wrote it into the paged cache);
- the store (``forge``: another prompt's entry copied under this prompt's key).

The expected ``fields`` are :class:`~ropekv.contract.CacheContract` field names (``rope.theta``...);
``kind`` is the :class:`~ropekv.parity.bug_class.BugClass` the consumer's forensics name.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..adapters.vllm import kv_layout
from ..errors import CheckpointError, UsageError
from ..parity.bug_class import BugClass
from .record import Fault, FaultEngine

if TYPE_CHECKING:  # pragma: no cover
    from ..adapters.vllm.disagg import ConnectorConsumer, Injection

SCALED = 1.25  # the weight perturbation: one tensor times this


@dataclass(frozen=True, kw_only=True)
class TransferFault(Fault):
    """A fault between a vLLM producer and consumer (see the module docstring for each field)."""

    engine: FaultEngine = field(default="vllm", init=False)
    fields: tuple[str, ...] = ()  # contract fields the comparison of the two sides must name
    consumer_config: Mapping[str, Any] | None = None  # config.json keys replaced on the consumer
    scale_tensor: str | None = None  # a weight tensor scaled by SCALED on the consumer
    consumer_dtype: str | None = None
    inject_shift: int = 0
    forge: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.inject_shift, int) or not -64 <= self.inject_shift <= 64:
            raise UsageError(f"fault {self.name!r}: inject_shift must be an integer in [-64, 64]")

    @property
    def own_model_dir(self) -> bool:
        """The consumer runs a model directory of its own (a changed copy of the producer's)."""
        return self.consumer_config is not None or self.scale_tensor is not None

    def consumer_model_dir(self, source: Path, dest: Path) -> Path:
        """``dest``: a copy of the model directory ``source`` with this fault's change (config keys
        replaced, or one weight tensor scaled); unchanged files are linked, not copied."""
        if not self.own_model_dir:
            raise UsageError(f"fault {self.name!r} does not change the consumer's model")
        dest.mkdir(parents=True, exist_ok=False)
        for item in source.iterdir():
            if item.is_file():
                os.symlink(item.resolve(), dest / item.name)
        if self.consumer_config is not None:
            config = json.loads((source / "config.json").read_text())
            config.update(self.consumer_config)
            (dest / "config.json").unlink()
            (dest / "config.json").write_text(json.dumps(config, indent=2))
        if self.scale_tensor is not None:
            _scale_one_tensor(source, dest, self.scale_tensor)
        return dest

    def install(self, engine: ConnectorConsumer) -> Callable[[], None]:
        """Patch the running consumer (``inject_shift``); returns the undo step."""
        if not self.inject_shift:
            return lambda: None
        shift = self.inject_shift

        def turn(done: list[Injection]) -> None:
            _turn_injected(engine, done, shift)

        engine.tap.after_inject.append(turn)
        return lambda: engine.tap.after_inject.remove(turn)


def forge_entry(store: Path, victim: Path, donor: Path) -> None:
    """Replace the files of store entry ``victim`` (a directory under ``store``) by those of ``donor``:
    another prompt's KV under this prompt's key."""
    for d in (victim, donor):
        if d.parent != store or not d.is_dir():
            raise UsageError(f"{d}: not an entry directory of the store {store}")
    for item in victim.iterdir():
        item.unlink()
    for item in donor.iterdir():
        shutil.copyfile(item, victim / item.name)


def _scale_one_tensor(source: Path, dest: Path, name: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if name not in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                continue
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            metadata = f.metadata()
        tensors[name] = tensors[name] * SCALED
        (dest / path.name).unlink()
        save_file(tensors, str(dest / path.name), metadata=metadata)
        return
    raise CheckpointError(f"{source}: no tensor {name!r} to perturb")


@torch.no_grad()
def _turn_injected(engine: ConnectorConsumer, done: list[Injection], shift: int) -> None:
    """Turn every key the connector just injected by ``shift`` positions (in vLLM's paged cache, in the
    kernel's layout): token ``i``'s key then sits at ``i + shift``."""
    rope = engine.checkpoint.config.rope
    for layer in engine.model.model.layers:
        attn = layer.self_attn.attn
        key_cache, _ = kv_layout.kernel_views(attn.kv_cache)
        isa = str(attn.isa)
        for inj in done:
            keys = kv_layout.read_keys(key_cache, inj.slots, isa)  # [n, KVH, D]
            turned = rope.rotate(keys.double(), torch.full((inj.num_tokens,), shift, dtype=torch.int64))
            kv_layout.write_keys(key_cache, inj.slots, turned, isa)


_THETA = 20000.0
_YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "rope_theta": 100000.0}
_LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}

CATALOGUE: tuple[TransferFault, ...] = (
    TransferFault(
        name="consumer_rope_theta",
        kind=BugClass.FREQUENCY_MISMATCH,
        description="the consumer runs rope_theta 20000 (the producer 100000)",
        fields=("rope.theta",),
        consumer_config={"rope_theta": _THETA, "rope_parameters": {"rope_type": "default", "rope_theta": _THETA}},
    ),
    TransferFault(
        name="consumer_linear_scaling",
        # at the consumer's angles (j / 2 per position) a key stored at angle j sits at position 2j
        kind=BugClass.DOUBLE_ROTATION,
        description="the consumer runs linear RoPE scaling, factor 2",
        fields=("rope.scaling.rope_type", "rope.scaling.factor"),
        consumer_config={"rope_scaling": dict(_LINEAR), "rope_parameters": dict(_LINEAR)},
    ),
    TransferFault(
        name="consumer_yarn_scaling",
        kind=BugClass.UNKNOWN,  # YaRN's per-channel ramp and attention factor fit no single pattern
        description="the consumer runs YaRN, factor 2 over 4096 original positions",
        fields=("rope.scaling.rope_type", "rope.scaling.factor"),
        consumer_config={"rope_scaling": dict(_YARN), "rope_parameters": dict(_YARN)},
    ),
    TransferFault(
        name="consumer_other_weights",
        kind=BugClass.UNKNOWN,
        description=f"the consumer's model has layer 0's k_proj scaled by {SCALED} (same architecture and tokens)",
        fields=("weights_fingerprint",),
        scale_tensor="model.layers.0.self_attn.k_proj.weight",
    ),
    TransferFault(
        name="consumer_bfloat16",
        kind=BugClass.UNKNOWN,
        description="the consumer runs bfloat16 (its cache too), the producer float32",
        fields=("dtype",),
        consumer_dtype="bfloat16",
    ),
    TransferFault(
        name="inject_position_shift",
        kind=BugClass.KEY_POSITION_OFFSET,
        description="the consumer's injection turns every injected key by 5 more positions",
        inject_shift=5,
    ),
    TransferFault(
        name="forged_store_entry",
        kind=BugClass.UNKNOWN,
        description="the store entry under this prompt's key holds another prompt's KV",
        forge=True,
    ),
)
