"""argparse pieces that library entry points below ``cli/`` share with it (the handoff workers' own
command line): value types whose bad values are one-line errors, and a parser that raises
:class:`~ropekv.errors.UsageError` instead of exiting.

Every number a flag takes is bounded here, at parse time, before any model is read: nothing like
``10**30`` gets past argparse. The model's own limits (its positions, its vocabulary) bound the values
further once its config is read. The bounds (docs/errors.md, "Bounds of the command line"):

- token counts (lengths, prefix offsets, windows, sinks, chunks, decode steps, contexts): at most
  :data:`MAX_TOKENS`; block sizes at most :data:`MAX_BLOCK_SIZE` (the engine allocates a few spare
  blocks, so a block size is paid for several times over);
- seeds in ``[-2**63, 2**64)`` (what torch's generator takes); timeouts in ``(0, MAX_TIMEOUT_S]``
  seconds; thread and worker counts at most :data:`MAX_THREADS` and :data:`MAX_WORKERS`.

Integers are ASCII digits with an optional minus sign, nothing else: ``int()`` alone would take
``" 7"``, ``"1_000"`` and ``"٣"``, and ``str.isdigit()`` takes ``"²"``, which ``int()`` refuses.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
from collections.abc import Iterable, Sequence

from .errors import UsageError

MAX_TOKENS = 2**20  # 1,048,576 tokens: above every model ropekv reads, far below any integer overflow
# The highest position the engine runs at (a sequence shifted past the model's positions, whose span
# still fits them): int64 holds it with room, and float64 holds every position * inv_freq to 2**-12 rad
# (the reference computes the same float64 angles, so the parity check stays exact there).
MAX_POSITION = 2**40
# The largest shift a parity case takes (``--ops shift:N``): past 2**31 and 2**32, where 32-bit position
# indices wrap, and as far as the float64 reference stays exact for a float64 engine. Its angles p * w
# are rounded to p * 2**-53: on the tiny llama a float64 engine's scale-aware attention error grows
# from 2e-8 at 2**31 to 1.7e-7 at 2**33 (its tolerance is 1e-6) and 1.3e-6 at 2**36 (docs/ops.md).
MAX_SHIFT = 2**33
MAX_BLOCK_SIZE = 1024  # vLLM's largest block size is 256; 1024 keeps a tiny case's pool small
MAX_TIMEOUT_S = 86_400.0  # one day: a wait on a peer longer than that is a hang
MAX_THREADS = 1024
MAX_WORKERS = 64  # decode worker processes, each holding the model
SEED_RANGE = (-(2**63), 2**64)  # torch.Generator.manual_seed's range, the upper end excluded

_INTEGER = re.compile(r"-?[0-9]{1,40}", re.ASCII)
_DECIMAL = re.compile(r"-?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]{1,4})?", re.ASCII)


def strict_int(text: str) -> int | None:
    """``text`` as an integer if it is ASCII digits with an optional leading minus, else None."""
    text = text.strip()
    return int(text) if _INTEGER.fullmatch(text) else None


def strict_float(text: str) -> float | None:
    """``text`` as a finite number if it is an ASCII decimal (``60``, ``0.5``, ``1e3``), else None."""
    text = text.strip()
    if not _DECIMAL.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _describe(low: int, high: int, plural: bool) -> str:
    noun = "integers" if plural else "integer"
    if low == 1:
        return f"positive {noun} up to {high}"
    if low == 0:
        return f"non-negative {noun} up to {high}"
    return f"{noun} in [{low}, {high}]"


class BoundedInt:
    """argparse type: one integer in ``[low, high]``; every bad value gets the same message."""

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high
        self.__name__ = "integer"  # argparse names the type in some messages

    def __call__(self, text: str) -> int:
        value = strict_int(text)
        if value is None or not self.low <= value <= self.high:
            raise argparse.ArgumentTypeError(f"expected a {_describe(self.low, self.high, False)}, got {text!r}")
        return value


class BoundedIntList:
    """argparse type: ``"1,17,513"`` -> ``[1, 17, 513]``, each entry in ``[low, high]``; no empty entry
    (``"17,"`` and ``"1,,2"`` are refused, not read as ``[17]`` and ``[1, 2]``)."""

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high
        self.__name__ = "integer list"

    def __call__(self, text: str) -> list[int]:
        values = [strict_int(v) for v in text.split(",")]
        if not all(v is not None and self.low <= v <= self.high for v in values):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {_describe(self.low, self.high, True)}, got {text!r}"
            )
        return [v for v in values if v is not None]


def split_ints(text: str) -> list[int] | None:
    """``"5,6"`` -> ``[5, 6]``; None unless every comma-separated entry is a strict integer."""
    values = [strict_int(v) for v in text.split(",")]
    return None if any(v is None for v in values) else [v for v in values if v is not None]


# The types the subcommands use (one per kind of number).
int_list = BoundedIntList(0, MAX_TOKENS)  # prefix offsets
positive_int_list = BoundedIntList(1, MAX_TOKENS)  # lengths, contexts
block_size_list = BoundedIntList(1, MAX_BLOCK_SIZE)
positive_int = BoundedInt(1, MAX_TOKENS)  # windows, chunks, decode steps, new tokens
non_negative_int = BoundedInt(0, MAX_TOKENS)  # sink tokens
block_size = BoundedInt(1, MAX_BLOCK_SIZE)
thread_count = BoundedInt(1, MAX_THREADS)
worker_count = BoundedInt(1, MAX_WORKERS)


def seed(text: str) -> int:
    """An integer torch's generator accepts: ``-2**63 <= seed < 2**64``."""
    value = strict_int(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}")
    if not SEED_RANGE[0] <= value < SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"seed {text} is out of range [-2**63, 2**64)")
    return value


def timeout_seconds(text: str) -> float:
    """A wait bound in seconds: a finite number in ``(0, MAX_TIMEOUT_S]``."""
    value = strict_float(text)
    if value is None or not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {text!r}")
    return value


def rope_theta(text: str) -> float:
    """A RoPE base: a finite number in ``(1, 1e12]``."""
    value = strict_float(text)
    if value is None or not 1 < value <= 1e12:
        raise argparse.ArgumentTypeError(f"expected a finite RoPE theta in (1, 1e12], got {text!r}")
    return value


def suggest(value: str, known: Iterable[str]) -> str:
    """``"; did you mean 'check'?"`` for the known name nearest ``value`` (difflib), else ``""``."""
    near = difflib.get_close_matches(value, list(known), n=1, cutoff=0.6)
    return f"; did you mean {near[0]!r}?" if near else ""


class RaisingParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, so usage errors share the one-line path.

    The message names the parser's ``prog`` (``ropekv check: argument --lengths: ...``) unless it is
    the top-level one, whose name the caller prints already (``name_in_errors=False``). An unknown
    flag or choice comes with the nearest known one (difflib): ``--lenghts`` -> ``--lengths``."""

    def __init__(self, *args, name_in_errors: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.name_in_errors = name_in_errors

    def error(self, message: str):
        message = _with_choice_suggestion(message)
        raise UsageError(f"{self.prog}: {message}" if self.name_in_errors else message)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            # argparse reports unknown flags on the top-level parser; name the subcommand they were
            # given to and the nearest flag it has.
            parser = self._chosen_subparser(parsed) or self
            flags = sorted(s for a in parser._actions for s in a.option_strings)
            unknown = extras[0].split("=", 1)[0]
            hint = suggest(unknown, flags) if unknown.startswith("-") else ""
            what = "argument" if len(extras) == 1 else "arguments"
            message = f"unrecognized {what}: {' '.join(extras)}{hint}"
            raise UsageError(f"{parser.prog}: {message}" if getattr(parser, "name_in_errors", True) else message)
        return parsed

    def _chosen_subparser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = getattr(parsed, action.dest or "", None)
                return action.choices.get(chosen) if chosen is not None else None
        return None


_INVALID_CHOICE = re.compile(r"invalid choice: '?(?P<value>[^' ]*)'? \(choose from (?P<choices>.*)\)$")


def _with_choice_suggestion(message: str) -> str:
    """argparse's "invalid choice: 'chek' (choose from 'check', ...)" with "did you mean 'check'?"."""
    match = _INVALID_CHOICE.search(message)
    if match is None:
        return message
    choices = [c.strip().strip("'") for c in match["choices"].split(",")]
    return message + suggest(match["value"], choices)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """``MODEL`` (a path, or an embedded model's name) and ``--model NAME`` (an embedded model by name);
    :func:`ropekv.models.embedded.fold_model_name` checks the name and folds it into ``args.model``."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a transformers directory, a .gguf file or an embedded model's name (default: the embedded SmolLM2-135M)",
    )
    parser.add_argument(
        "--model",
        dest="model_name",
        metavar="NAME",
        default=None,
        help="an embedded model by name: smollm2-135m (the default) or gemma3-270m (`ropekv models` lists them)",
    )
