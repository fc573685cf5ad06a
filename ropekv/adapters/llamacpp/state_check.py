"""A llama.cpp sequence moved from a writer context to a fresh reader context, checked three ways.

The writer prefills ``tokens[:n]`` at positions ``0..n-1``; its sequence state goes to the reader
(checked: :func:`~.state.save_state` / :func:`~.state.load_state`; raw: llama.cpp's own
``llama_state_seq_get_data`` / ``set_data``); the reader decodes ``tokens[n : n + steps]`` at
``n..n+steps-1``. Each step's next-token logits are compared with

- the float64 reference (ropekv's, on the GGUF's weights, under the reader's RoPE as its graph runs it);
- the reader's own full forward over ``tokens[:n + steps]`` (one batch, no restored cache);
- the writer decoding the same tokens itself (the correct restore is bit-identical to it).

Errors are scale-aware (``max |diff| / max(1, max |ref|)``) and judged under the engine's own
tolerance (:mod:`.tolerance`: float32 for the f32 GGUF, the measured noise floor for Q4_1); against the
writer, where the reader runs the writer's contract, bit for bit (:func:`steps_pass`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from ...models.reference import ReferenceDecoder
from ...parity.compare import scaled_error
from .engine import LlamaCppEngine
from .rope_params import RopeOverrides
from .state import StateContext, get_seq_state, load_state, save_state, set_seq_state


@dataclass(frozen=True)
class StepResult:
    position: int
    vs_reference: float | None  # scale-aware logits error, restored reader vs float64 (None: not computed)
    vs_self: float  # restored reader vs its own full forward
    vs_writer: float  # max |dlogit|, restored reader vs the writer decoding the same token
    logprob_change: float  # the writer's top token: log p under the reader minus log p under the writer
    same_top_token: bool


@dataclass(frozen=True)
class TransferCheck:
    n: int
    writer: str  # the writer context's RoPE settings, in words
    reader: str
    checked: bool  # through ropekv's pair (else llama.cpp's own calls)
    accepted_bytes: int  # what llama_state_seq_set_data returned (0: refused)
    state_bytes: int
    steps: tuple[StepResult, ...]
    tolerance: float  # on the logits, scale-aware
    bitwise_vs_writer: bool  # the reader runs the writer's contract: judged against it bit for bit
    passed: bool

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["steps"] = [dataclasses.asdict(s) for s in self.steps]
        return d


class References:
    """float64 references of one engine's checkpoint under the RoPE specs reader contexts run (one each),
    each forward computed once per tokens and rows. ``default``: an existing reference of the checkpoint
    as it is (shared: converting weights costs seconds). An engine on a GGUF with the same weights
    (the Q4_1 file and its float32 copy) may share the object."""

    def __init__(self, engine: LlamaCppEngine, default: ReferenceDecoder | None = None):
        self.engine = engine
        self._by_rope: dict[str, ReferenceDecoder] = {}
        self._logits: dict[tuple[str, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        if default is not None:
            self._by_rope[engine.config.rope.fingerprint()] = default

    def logits(self, sc: StateContext, tokens: list[int], rows: list[int]) -> torch.Tensor:
        """``[len(rows), vocab]`` float64 logits of a full forward over ``tokens`` under ``sc``'s RoPE."""
        rope = sc.contract.rope
        key = rope.fingerprint()
        if key not in self._by_rope:
            ckpt = self.engine.checkpoint
            config = dataclasses.replace(ckpt.config, rope=rope)
            self._by_rope[key] = ReferenceDecoder(dataclasses.replace(ckpt, config=config))
        memo = (key, tuple(tokens), tuple(rows))
        if memo not in self._logits:
            out = self._by_rope[key].forward(torch.tensor(tokens), probe_rows=rows, logits_for="probed")
            self._logits[memo] = out.logits
        return self._logits[memo]


def full_forward(engine: LlamaCppEngine, rope: RopeOverrides, tokens: list[int], rows: list[int]) -> np.ndarray:
    """``[len(rows), vocab]``: a fresh context with ``rope`` computes ``tokens`` in one batch."""
    sc = StateContext(engine, rope=rope, n_batch=len(tokens))
    outputs = [False] * len(tokens)
    for r in rows:
        outputs[r] = True
    sc.decode(tokens, list(range(len(tokens))), outputs)
    return np.stack([sc.logits(r) for r in rows])


def decode_steps(sc: StateContext, tokens: list[int], n: int, steps: int) -> np.ndarray:
    """``[steps, vocab]``: ``tokens[n + s]`` decoded alone at position ``n + s`` on what ``sc`` holds."""
    out = []
    for s in range(steps):
        sc.decode([tokens[n + s]], [n + s], [True])
        out.append(sc.logits(0))
    return np.stack(out)


def check_transfer(
    engine: LlamaCppEngine,
    references: References | None,
    tokens: list[int],
    n: int,
    steps: int,
    *,
    writer_rope: RopeOverrides | None = None,
    reader_rope: RopeOverrides | None = None,
    checked: bool = True,
    state_path: str | os.PathLike | None = None,
) -> TransferCheck:
    """Prefill ``tokens[:n]`` in a writer context, move the state to a fresh reader, decode ``steps``.

    ``references`` None: no float64 reference (the judgement is then against the reader's own full
    forward only). ``checked``: through :func:`save_state` / :func:`load_state` at ``state_path`` (raises
    ContractMismatch where the contexts' contracts differ, before the reader is touched); else
    llama.cpp's own bytes, unchecked, whatever it does with them."""
    writer_rope, reader_rope = writer_rope or RopeOverrides(), reader_rope or RopeOverrides()
    if len(tokens) < n + steps or n < 1 or steps < 1:
        raise ValueError(f"need n >= 1, steps >= 1 and {n + steps} tokens, got {len(tokens)}")
    writer = StateContext(engine, rope=writer_rope)
    writer.prefill(tokens[:n], 0)
    reader = StateContext(engine, rope=reader_rope)
    if checked:
        if state_path is None:
            raise ValueError("a checked transfer needs a state_path")
        save_state(writer, state_path, tokens[:n])
        header = load_state(reader, state_path, tokens[:n])  # ContractMismatch / PayloadError: nothing restored
        state_bytes = accepted = header.state_bytes  # load_state checked llama.cpp read all of them
    else:
        state = get_seq_state(writer)
        state_bytes = len(state)
        accepted = set_seq_state(reader, state)
    restored = decode_steps(reader, tokens, n, steps)
    own = decode_steps(writer, tokens, n, steps)
    rows = list(range(n, n + steps))
    self_full = full_forward(engine, reader_rope, tokens[: n + steps], rows)
    ref = None if references is None else references.logits(reader, tokens[: n + steps], rows)
    tol = engine.tolerance.logits
    results = []
    for s, position in enumerate(rows):
        mine, theirs = torch.from_numpy(restored[s]), torch.from_numpy(own[s])
        top = int(theirs.argmax())
        lp_mine = torch.log_softmax(mine.double(), -1)[top]
        lp_theirs = torch.log_softmax(theirs.double(), -1)[top]
        results.append(
            StepResult(
                position=position,
                vs_reference=None if ref is None else scaled_error(mine, ref[s]),
                vs_self=scaled_error(mine, torch.from_numpy(self_full[s])),
                vs_writer=float((mine - theirs).abs().max()),
                logprob_change=float(lp_mine - lp_theirs),
                same_top_token=int(mine.argmax()) == top,
            )
        )
    bitwise = reader.contract == writer.contract
    passed = steps_pass(results, tol, writer_equal=bitwise)
    return TransferCheck(
        n=n,
        writer=writer_rope.label(),
        reader=reader_rope.label(),
        checked=checked,
        accepted_bytes=accepted,
        state_bytes=state_bytes,
        steps=tuple(results),
        tolerance=tol,
        bitwise_vs_writer=bitwise,
        passed=passed,
    )


def steps_pass(steps: list[StepResult] | tuple[StepResult, ...], tolerance: float, writer_equal: bool) -> bool:
    """Whether a restore holds: every step within ``tolerance`` of the float64 reference (where computed)
    and of the reader's own full forward, and against the writer bit for bit where the reader runs the
    writer's contract (``writer_equal``): llama.cpp's graph is the same there, so a faithful restore
    decodes exactly the writer's logits, and a key changed in the file (its sha256 recomputed) shows
    as a difference the tolerances may not see. Under another contract the writer's logits are
    another computation, and only their finiteness is asked."""
    return all(
        (r.vs_reference is None or r.vs_reference <= tolerance)
        and r.vs_self <= tolerance
        and (r.vs_writer == 0.0 if writer_equal else math.isfinite(r.vs_writer))
        for r in steps
    )


def table(check: TransferCheck) -> str:
    """The per-step table ``ropekv check`` style: one row per decoded position."""
    head = (
        f"llama.cpp sequence state, {check.n} prompt tokens: writer [{check.writer}] -> reader [{check.reader}] "
        f"({'ropekv save_state/load_state' if check.checked else 'llama_state_seq_get_data/set_data, unchecked'}; "
        f"{check.state_bytes} bytes, llama.cpp read {check.accepted_bytes})"
    )
    lines = [
        head,
        f"  {'position':>8}  {'vs float64':>10}  {'vs own full':>11}  {'vs writer':>10}  {'dlogp top':>9}  top",
    ]
    for r in check.steps:
        lines.append(
            f"  {r.position:>8}  {_num(r.vs_reference):>10}  {r.vs_self:>11.2e}  {r.vs_writer:>10.2e}  "
            f"{r.logprob_change:>+9.4f}  {'same' if r.same_top_token else 'CHANGED'}"
        )
    verdict = "parity" if check.passed else "NO PARITY"
    writer = ", vs writer bit for bit" if check.bitwise_vs_writer else ""
    lines.append(
        f"  {verdict} (tolerance {check.tolerance:g} scale-aware on the logits, vs float64 and vs own full{writer})"
    )
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"
