"""Bugs patched into the ONNX graph onnxruntime-genai's builder made, to prove ropekv catches them
inside a kernel that turns keys itself.

Each is a function that edits the graph (an onnx ModelProto) before it runs, the way a builder or a
graph optimizer that got it wrong would have written it; :meth:`OrtFault.engine` runs the patched copy
through onnxruntime-genai's own Generator (``ropekv.adapters.ort``). The kernel is untouched.

- :func:`rotary_interleaved_flipped`: every ``GroupQueryAttention`` node pairs channels ``(2m, 2m+1)``
  (``rotary_interleaved=1``) on weights whose pairs are ``(m, m + d/2)``.
- :func:`cos_sin_of_theta`: the nodes read cos/sin caches computed with another RoPE base.
- :func:`decode_position_off_by_one`: a one-token step (decode) hands the kernel ``position + 1``:
  the decoded token's query and key turn one position too far.
- :func:`window_dropped`: windowed layers attend to every key (``local_window_size=-1``, a full
  buffer, and genai_config.json without its sliding-window section), what the builder emits for a
  config without ``layer_types`` (docs/findings.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..parity.bug_class import BugClass
from .record import Fault, FaultEngine

GQA = "GroupQueryAttention"


def _nodes(model: Any) -> list[Any]:
    return [n for n in model.graph.node if n.op_type == GQA]


def _set_attr(node: Any, name: str, value: int) -> None:
    from onnx import helper

    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.append(helper.make_attribute(name, value))


def rotary_interleaved_flipped(model: Any) -> None:
    """Every attention node turns interleaved pairs instead of the half-split ones it was built for."""
    for node in _nodes(model):
        current = next((a.i for a in node.attribute if a.name == "rotary_interleaved"), 0)
        _set_attr(node, "rotary_interleaved", 1 - current)


def cos_sin_of_theta(theta: float) -> Callable[[Any], None]:
    """A patch: every node reads cos/sin caches of RoPE base ``theta`` (same length and width)."""

    def patch(model: Any) -> None:
        from onnx import numpy_helper

        shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
        made: set[str] = set()
        for node in _nodes(model):
            positions, half = shapes[node.input[7]]
            inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / (2 * half))
            angles = np.arange(positions, dtype=np.float64)[:, None] * inv_freq[None]
            for slot, fn in ((7, np.cos), (8, np.sin)):
                name = f"ropekv.fault.{'cos' if slot == 7 else 'sin'}_theta_{theta:g}"
                if name not in made:
                    model.graph.initializer.append(numpy_helper.from_array(fn(angles).astype(np.float32), name))
                    made.add(name)
                node.input[slot] = name

    return patch


def decode_position_off_by_one(model: Any) -> None:
    """Where a step appends one token, the kernels get ``position_ids + 1``; prefill steps are right."""
    from onnx import TensorProto, helper

    g = model.graph
    one = "ropekv.fault.one"
    g.initializer.append(helper.make_tensor(one, TensorProto.INT64, [], [1]))
    g.node.extend(
        [
            helper.make_node("Shape", ["position_ids"], ["ropekv.fault.shape"], start=1, end=2),
            helper.make_node("Squeeze", ["ropekv.fault.shape"], ["ropekv.fault.len"]),
            helper.make_node("Equal", ["ropekv.fault.len", one], ["ropekv.fault.decode"]),
            helper.make_node("Add", ["position_ids", one], ["ropekv.fault.ahead"]),
            helper.make_node(
                "Where", ["ropekv.fault.decode", "ropekv.fault.ahead", "position_ids"], ["ropekv.fault.pos"]
            ),
        ]
    )
    for node in _nodes(model):
        node.input[9] = "ropekv.fault.pos"


def window_dropped(model: Any) -> None:
    """Windowed layers see every key, and keep a full buffer (the builder's output without layer_types)."""
    for node in _nodes(model):
        _set_attr(node, "local_window_size", -1)
        _set_attr(node, "sliding_window_cache", 0)


def _no_sliding_buffers(config: dict[str, Any]) -> None:
    from ..adapters.ort.engine import no_sliding_buffers

    no_sliding_buffers(config)


@dataclass(frozen=True, kw_only=True)
class OrtFault(Fault):
    """A :class:`~ropekv.faults.record.Fault` patched into the built ONNX graph; ``patch`` edits it
    (the graph with its ``position_ids`` input wired into every node, before the probes are added:
    ``ropekv.adapters.ort.graph.write_probed``)."""

    engine: FaultEngine = field(default="ort", init=False)
    patch: Callable[[Any], None]
    config_patch: Callable[[dict[str, Any]], None] | None = None  # its genai_config.json, where needed

    def adapter(self, model: Any = None, **kwargs: Any) -> Any:
        """The onnxruntime-genai adapter on ``model``'s graph with this fault patched in."""
        from ..adapters.ort.engine import OrtEngine

        configs = () if self.config_patch is None else (self.config_patch,)
        return OrtEngine(model, patches=(self.patch,), config_patches=configs, patch_name=self.name, **kwargs)


CATALOGUE: tuple[OrtFault, ...] = (
    OrtFault(
        name="ort-rotary-interleaved-flipped",
        kind=BugClass.LAYOUT_MISMATCH,
        description="GroupQueryAttention pairs channels (2m, 2m+1) on weights built for (m, m + d/2)",
        shows_when="from layer 0, any decode",
        patch=rotary_interleaved_flipped,
    ),
    OrtFault(
        name="ort-cos-sin-other-theta",
        kind=BugClass.FREQUENCY_MISMATCH,
        description="GroupQueryAttention reads cos/sin caches computed with RoPE base 10000",
        shows_when="any decode past position 0; grows with position",
        patch=cos_sin_of_theta(10000.0),
    ),
    OrtFault(
        name="ort-decode-position-off-by-one",
        kind=BugClass.QUERY_POSITION_OFFSET,
        description="a one-token step hands the kernel position_ids + 1 (its query and key one position too far)",
        shows_when="any decode",
        patch=decode_position_off_by_one,
    ),
    OrtFault(
        name="ort-window-dropped",
        kind=BugClass.WINDOW_MISMATCH,
        description="windowed layers attend to every key (local_window_size=-1, a full buffer)",
        shows_when="a model with sliding layers, once a decode sees more keys than the window",
        patch=window_dropped,
        config_patch=_no_sliding_buffers,
    ),
)
