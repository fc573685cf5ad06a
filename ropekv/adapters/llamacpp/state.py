"""Moving one llama.cpp sequence between contexts, raw (llama.cpp's own calls) and checked (ropekv's pair).

llama.cpp restores a sequence's cells (positions, rotated keys, values) into any context of a model
with the same layer count and KV types: ``llama_state_seq_set_data`` and the session files check
nothing about RoPE, so a context with another ``rope_freq_base``, ``rope_freq_scale`` or YaRN setting
takes the keys and reads them under its own frequencies (docs/engines/llamacpp.md, "Sequence
state"). The raw calls are here as they are, to measure that; :func:`save_state` / :func:`load_state`
are the checked pair: the state goes to a file with the writer context's :class:`CacheContract`
(:mod:`.state_file`), and a reader context whose contract differs is refused with
:class:`~ropekv.errors.ContractMismatch` (the handshake's wording, every differing field and its
consequence) before a byte is written into it.

A context's contract is what its graph runs (:class:`~.rope_params.RopeRun`, read from the key RoPE
node's arguments): :class:`StateContext` decodes one probe token when it is made, reads the arguments,
and empties the cache again; every later decode re-reads them and refuses a change.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...contract import CacheContract
from ...errors import AdapterError, CacheError, PayloadError, UsageError
from .engine import LlamaCppEngine
from .rope_params import RopeOverrides, RopeRun
from .state_file import StateHeader, read_state_file, write_state_file

SEQ = 0  # every context here holds one sequence
_PROBE_TOKEN = 1
_STATE_SLACK = 1 << 20  # llama.cpp's per-stream and per-layer headers, far below this
_CELL_META = 64  # a cell's position and sequence ids in the state, well above what llama.cpp writes


class StateContext:
    """A llama.cpp context on ``engine``'s loaded model with RoPE settings ``rope`` and the contract it runs.

    ``n_batch`` (default the engine's): llama.cpp's batch; a full forward needs the whole sequence in one.
    """

    def __init__(self, engine: LlamaCppEngine, *, rope: RopeOverrides | None = None, n_batch: int | None = None):
        if engine.type_k != engine.type_v:
            raise UsageError(
                f"llama.cpp state transfer needs one KV type (type_k {engine.type_k} != type_v {engine.type_v}): "
                "a cache contract has one dtype"
            )
        self.engine = engine
        self.rope = rope or RopeOverrides()
        self.tap = engine.new_tap()
        self.ctx = engine.context(n_batch or engine.n_batch, self.tap, rope=self.rope)
        self.n_ctx = engine.n_ctx
        self.run = self._probe()
        base = CacheContract.for_model(
            engine.config,
            key_form="rotated",  # llama.cpp caches keys after RoPE
            block_size=1,  # single cells, not blocks
            dtype="float32" if engine.type_k == "f32" else "float16",
            weights_fingerprint=engine.checkpoint.weights_fingerprint,
        )
        self.runs = dict(self.tap.rope_runs)  # layer -> its key RoPE, read in the same probe
        contract = base.replace(rope=self.run.spec(base.rope))
        if not engine.config.uniform_rope:  # per-layer RoPE (gemma3): each layer's own, as its graph runs it
            ropes = []
            for i in range(engine.config.num_layers):
                spec, run = engine.config.layer_rope(i), self.runs.get(i)
                if spec is not None and run is None:
                    raise AdapterError(engine.name, f"key RoPE node (Kcur-{i})", "one in the decode graph", "none")
                ropes.append(None if spec is None or run is None else run.spec(spec))
            contract = contract.replace(layer_ropes=tuple(ropes))
        self.contract = contract

    def _probe(self) -> RopeRun:
        """Decode one token at position 0 to read the RoPE the graph runs, then empty the cache."""
        self.ctx.decode([_PROBE_TOKEN], [0], [True])
        run = self.tap.rope_run
        self.ctx.clear()
        if run is None:
            raise AdapterError(self.engine.name, "key RoPE node (Kcur-0)", "one in the decode graph", "none")
        return run

    def decode(self, tokens: Sequence[int], positions: Sequence[int], outputs: Sequence[bool]) -> None:
        """One ``llama_decode`` on sequence 0; the graph's RoPE arguments must be the probed ones."""
        self.ctx.decode(list(tokens), list(positions), list(outputs))
        self._same_rope()

    def prefill(self, tokens: Sequence[int], start: int = 0) -> None:
        self.ctx.prefill(list(tokens), start)
        self._same_rope()

    def logits(self, row: int) -> np.ndarray:
        """``[vocab]`` float32 logits of row ``row`` of the last decode."""
        return self.ctx.logits(row)

    def positions(self) -> tuple[int, int]:
        """``(first, last)`` position held by sequence 0; ``(-1, -1)`` when it is empty."""
        return self.ctx.position_range()

    def _same_rope(self) -> None:
        if self.tap.rope_run != self.run:
            raise AdapterError(self.engine.name, "key RoPE arguments", str(self.run), str(self.tap.rope_run))
        changed = [i for i, run in self.runs.items() if self.tap.rope_runs.get(i, run) != run]
        if changed:
            i = changed[0]
            raise AdapterError(
                self.engine.name, f"layer {i} key RoPE arguments", str(self.runs[i]), str(self.tap.rope_runs[i])
            )


# ---------------------------------------------------------------------------- llama.cpp's own calls


def get_seq_state(sc: StateContext) -> bytes:
    """``llama_state_seq_get_size`` then ``llama_state_seq_get_data`` of sequence 0."""
    import llama_cpp

    size = int(llama_cpp.llama_state_seq_get_size(sc.ctx.ctx, SEQ))
    buffer = (ctypes.c_uint8 * size)()
    got = int(llama_cpp.llama_state_seq_get_data(sc.ctx.ctx, buffer, size, SEQ))
    if got != size:
        raise AdapterError(sc.engine.name, "llama_state_seq_get_data", f"{size} bytes", f"{got}")
    return bytes(buffer)


def set_seq_state(sc: StateContext, state: bytes) -> int:
    """``llama_state_seq_set_data`` into sequence 0, unchecked: llama.cpp's return (bytes read, 0 refused).
    llama.cpp replaces whatever sequence 0 held; the tap's cell map is dropped with it."""
    import llama_cpp

    buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    sc.tap.reset()
    return int(llama_cpp.llama_state_seq_set_data(sc.ctx.ctx, buffer, len(state), SEQ))


def save_seq_file(sc: StateContext, path: str | os.PathLike, tokens: Sequence[int]) -> int:
    """``llama_state_seq_save_file`` of sequence 0 with ``tokens``: llama.cpp's session file; its return."""
    import llama_cpp

    arr = (llama_cpp.llama_token * len(tokens))(*[int(t) for t in tokens])
    return int(llama_cpp.llama_state_seq_save_file(sc.ctx.ctx, os.fsencode(path), SEQ, arr, len(tokens)))


def load_seq_file(sc: StateContext, path: str | os.PathLike, capacity: int) -> tuple[int, list[int]]:
    """``llama_state_seq_load_file`` into sequence 0, unchecked: ``(llama.cpp's return, tokens read)``."""
    import llama_cpp

    arr = (llama_cpp.llama_token * capacity)()
    count = ctypes.c_size_t(0)
    sc.tap.reset()
    rc = int(
        llama_cpp.llama_state_seq_load_file(sc.ctx.ctx, os.fsencode(path), SEQ, arr, capacity, ctypes.byref(count))
    )
    return rc, [int(arr[i]) for i in range(min(int(count.value), capacity))]


# ---------------------------------------------------------------------------- the checked pair


def state_bound(contract: CacheContract, n_tokens: int) -> int:
    """The most bytes llama.cpp's state of ``n_tokens`` cells under ``contract`` can take: keys and values
    of every layer, a cell's metadata, and the headers."""
    itemsize = 4 if contract.dtype == "float32" else 2
    per_cell = 2 * contract.num_layers * contract.num_kv_heads * contract.head_dim * itemsize + _CELL_META
    return n_tokens * per_cell + _STATE_SLACK


def save_state(sc: StateContext, path: str | os.PathLike, tokens: Sequence[int]) -> int:
    """Write sequence 0 of ``sc`` with its contract to ``path``; returns the file's size. ``tokens``:
    the ids the sequence holds, one per cached position (``CacheError`` where the counts differ)."""
    import llama_cpp

    first, last = sc.positions()
    if first < 0:
        raise CacheError("llama.cpp state save: sequence 0 holds nothing")
    if last - first + 1 != len(tokens):
        raise CacheError(
            f"llama.cpp state save: sequence 0 holds positions {first}..{last}, {len(tokens)} token id(s) were given"
        )
    state = get_seq_state(sc)
    writer = {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "api": "llama_state_seq_get_data",
        "gguf": Path(sc.engine.gguf_path).name,
        "rope_settings": sc.rope.given(),
    }
    return write_state_file(path, sc.contract, list(tokens), first, state, writer)


def load_state(sc: StateContext, path: str | os.PathLike, tokens: Sequence[int]) -> StateHeader:
    """Restore the sequence saved at ``path`` into sequence 0 of ``sc``, all or nothing. ``tokens``: the
    ids the reader expects the sequence to hold, one per position, first to last.

    Refused, with ``sc`` untouched: a contract that differs from ``sc``'s (``ContractMismatch``), more
    tokens than ``sc`` has cells (``CacheError``), a header listing other tokens than ``tokens`` (nothing
    in llama.cpp's bytes names them, so a file of another prompt would restore its keys under this one's
    ids), a state larger than its contract allows or a truncated, corrupt or foreign file
    (``PayloadError``). llama.cpp refusing the bytes anyway, or restoring other positions than the
    header's, is an ``AdapterError`` with sequence 0 emptied."""
    expected = tuple(int(t) for t in tokens)

    def accept(header: StateHeader) -> None:
        sc.contract.require_compatible(header.contract, ours="reader context", theirs="saved state")
        n = len(header.tokens)
        if n > sc.n_ctx:
            raise CacheError(f"llama.cpp state load: {n} saved tokens, the reader context has {sc.n_ctx} cells")
        if header.tokens != expected:
            raise PayloadError(f"llama.cpp state load: {_token_difference(header.tokens, expected)}")
        bound = state_bound(sc.contract, n)
        if header.state_bytes > bound:
            raise PayloadError(
                f"llama.cpp state load: {header.state_bytes} state bytes for {n} tokens, at most {bound} under "
                "its contract (corrupt)"
            )

    header, state = read_state_file(path, accept)
    got = set_seq_state(sc, state)
    if got != len(state):
        sc.ctx.remove_from(0)
        raise AdapterError(sc.engine.name, "llama_state_seq_set_data", f"{len(state)} bytes read", str(got))
    if sc.positions() != header.positions:
        sc.ctx.remove_from(0)
        raise AdapterError(sc.engine.name, "restored positions", str(header.positions), str(sc.positions()))
    return header


def _token_difference(saved: tuple[int, ...], expected: tuple[int, ...]) -> str:
    """Where a saved sequence's token ids first differ from those expected, in words."""
    if len(saved) != len(expected):
        return f"the saved state holds {len(saved)} tokens, {len(expected)} were expected"
    i = next(i for i, (a, b) in enumerate(zip(saved, expected)) if a != b)
    return f"the saved state holds other tokens than expected: token {i} is {saved[i]}, expected {expected[i]}"
