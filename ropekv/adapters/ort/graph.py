"""Reading and probing the ONNX graph onnxruntime-genai's builder made.

Every attention layer of that graph is one ``com.microsoft`` ``GroupQueryAttention`` node: with
``do_rotary=1`` it turns the query and the new keys itself, before it writes them into the static KV
buffer it shares between steps, so the cache holds rotated keys and nothing turns them on read. The
node's attributes and inputs say how (:class:`GqaLayer`): ``rotary_interleaved`` (the channel pairing),
the ``cos_cache``/``sin_cache`` initializers it reads its angles from, ``local_window_size`` (the
number of keys a query sees, itself included: onnxruntime 1.32's CPU kernel returns zero scores for
the ``t + 1 - local_window_size`` keys before them, measured on Gemma 3) and ``sliding_window_cache``. ropekv reads all of it from the graph (:func:`read_layers`), never assumes it.

:func:`write_probed` writes a copy of the graph that also returns, per layer, the node's pre-RoPE
query and key inputs and, where the CPU kernel allows it (not on ``sliding_window_cache`` layers),
its own attention scores (``qk_output=1``: ``scale * q K^T`` before the mask); and that takes the
tokens' positions as an explicit ``position_ids`` input wired into every node (the builder drops it:
the kernel then counts positions from the attention mask). The copy shares the weights file (a hard
link: onnxruntime-genai refuses external data outside the model's folder) and runs through the same
``Generator``, so the probed run is the engine's own cached path. ``patches`` change the copy before it
is written (the graph faults of :mod:`ropekv.faults.ort`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CheckpointError

GQA = "GroupQueryAttention"
POSITION_IDS = "position_ids"
GraphPatch = Callable[[Any], None]  # edits an onnx ModelProto in place
ConfigPatch = Callable[[dict[str, Any]], None]  # edits the parsed genai_config.json in place
_LAYER_NAME = re.compile(r"/layers\.(\d+)/")


@dataclass(frozen=True)
class GqaLayer:
    """One layer's ``GroupQueryAttention`` node as the graph builds it."""

    index: int
    node: str
    num_heads: int
    kv_num_heads: int
    scale: float
    do_rotary: bool
    interleaved: bool
    local_window_size: int  # -1: full attention; else the keys a query sees, itself included
    sliding_window_cache: bool  # the layer keeps a window-sized buffer (qk_output is refused on CPU then)
    query: str  # the node's query input (the packed q, k, v where key is "")
    key: str
    value: str
    cos_cache: str
    sin_cache: str

    @property
    def packed(self) -> bool:
        return not self.key

    @property
    def window(self) -> int | None:
        """The window in ropekv's (and transformers') terms: a query sees ``W`` keys, itself included."""
        return None if self.local_window_size < 0 else self.local_window_size


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def gqa_nodes(model: Any) -> list[Any]:
    """The graph's ``GroupQueryAttention`` nodes in layer order (CheckpointError where there are none or
    their names do not number the layers 0..N-1)."""
    nodes = [n for n in model.graph.node if n.op_type == GQA]
    if not nodes:
        raise CheckpointError("the ONNX graph has no GroupQueryAttention node: not a graph ropekv can probe")
    numbers = [_LAYER_NAME.search(n.name) for n in nodes]
    if all(numbers):
        nodes = sorted(nodes, key=lambda n: int(_LAYER_NAME.search(n.name).group(1)))  # type: ignore[union-attr]
        found = [int(_LAYER_NAME.search(n.name).group(1)) for n in nodes]  # type: ignore[union-attr]
        if found != list(range(len(nodes))):
            raise CheckpointError(f"GroupQueryAttention nodes number layers {found}, not 0..{len(nodes) - 1}")
    return nodes


def read_layers(model: Any) -> tuple[GqaLayer, ...]:
    """One :class:`GqaLayer` per attention node of ``model`` (an onnx ModelProto)."""
    out = []
    for i, node in enumerate(gqa_nodes(model)):
        a = _attrs(node)
        inputs = list(node.input) + [""] * (9 - len(node.input))
        out.append(
            GqaLayer(
                index=i,
                node=node.name,
                num_heads=int(a["num_heads"]),
                kv_num_heads=int(a["kv_num_heads"]),
                scale=float(a.get("scale", 0.0)),
                do_rotary=int(a.get("do_rotary", 0)) == 1,
                interleaved=int(a.get("rotary_interleaved", 0)) == 1,
                local_window_size=int(a.get("local_window_size", -1)),
                sliding_window_cache=int(a.get("sliding_window_cache", 0)) == 1,
                query=inputs[0],
                key=inputs[1],
                value=inputs[2],
                cos_cache=inputs[7],
                sin_cache=inputs[8],
            )
        )
    return tuple(out)


def load_graph(folder: Path) -> Any:
    """``folder/model.onnx`` without its weights (they stay in ``model.onnx.data``)."""
    import onnx

    return onnx.load(str(Path(folder) / "model.onnx"), load_external_data=False)


def initializer(model: Any, name: str, folder: Path) -> np.ndarray:
    """The initializer ``name`` of ``model`` (built in ``folder``): inline, or read from its external data
    file in ``folder`` (a plain file name, offset and length as the graph records them). onnx's own
    reader refuses the hard-linked data file of a probed copy, so it is read here."""
    from onnx import helper, numpy_helper

    for tensor in model.graph.initializer:
        if tensor.name != name:
            continue
        if tensor.data_location != 1:  # not EXTERNAL: the values are in the graph
            return numpy_helper.to_array(tensor)
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not location or Path(location).name != location:
            raise CheckpointError(f"initializer {name!r}: external data location {location!r} is not a file name")
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        count = int(np.prod(tensor.dims)) if len(tensor.dims) else 1
        with open(Path(folder) / location, "rb") as f:
            f.seek(int(info.get("offset", 0)))
            data = np.frombuffer(f.read(count * np.dtype(dtype).itemsize), dtype=dtype)
        if data.size != count:
            raise CheckpointError(f"initializer {name!r}: its external data ends early")
        return data.reshape(tuple(tensor.dims))
    raise CheckpointError(f"the ONNX graph has no initializer {name!r}")


def output_names(layer: GqaLayer) -> dict[str, str]:
    """The probed graph's outputs for ``layer``: its pre-RoPE query (and key) inputs, and its scores."""
    i = layer.index
    names = {"q": f"ropekv.{i}.q"}
    if not layer.packed:
        names["k"] = f"ropekv.{i}.k"
    if not layer.sliding_window_cache:
        names["qk"] = f"ropekv.{i}.qk"
    return names


def write_probed(
    src: Path, dst: Path, patches: Sequence[GraphPatch] = (), config_patches: Sequence[ConfigPatch] = ()
) -> tuple[GqaLayer, ...]:
    """Write the probed copy of the graph in ``src`` to ``dst`` (module docstring); its layers as read
    after ``patches`` (and ``config_patches`` applied to its genai_config.json)."""
    from onnx import TensorProto, helper

    model = load_graph(src)
    g = model.graph
    if POSITION_IDS not in {i.name for i in g.input}:
        g.input.append(
            helper.make_tensor_value_info(POSITION_IDS, TensorProto.INT64, ["batch_size", "sequence_length"])
        )
    for node in gqa_nodes(model):
        while len(node.input) < 10:
            node.input.append("")
        node.input[9] = POSITION_IDS
    for patch in patches:
        patch(model)
    layers = read_layers(model)
    for layer, node in zip(layers, gqa_nodes(model)):
        names = output_names(layer)
        if "qk" in names:
            node.attribute.append(helper.make_attribute("qk_output", 1))
            while len(node.output) < 4:
                node.output.append("")
            node.output[3] = names["qk"]
            g.output.append(helper.make_tensor_value_info(names["qk"], TensorProto.FLOAT, None))
        for what, source in (("q", layer.query), ("k", layer.key)):
            if what in names:
                g.node.append(helper.make_node("Identity", [source], [names[what]], name=f"ropekv/probe/{names[what]}"))
                g.output.append(helper.make_tensor_value_info(names[what], TensorProto.FLOAT, None))
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.onnx", "genai_config.json"):
            try:
                os.link(f, dst / f.name)
            except OSError:  # another file system: a copy
                shutil.copy2(f, dst / f.name)
    (dst / "model.onnx").write_bytes(model.SerializeToString())  # the weights stay in the linked data file
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["decoder"]["inputs"][POSITION_IDS] = POSITION_IDS
    for config_patch in config_patches:
        config_patch(config)
    (dst / "genai_config.json").write_text(json.dumps(config, indent=1))
    return layers
