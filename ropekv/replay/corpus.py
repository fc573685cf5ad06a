"""A replay corpus: real bugs engines shipped, each with a release that has it and one that fixed it.

A corpus is a TOML file anyone can write (the one ropekv ships is ``ropekv/replay/corpus.toml``)::

    [[entry]]
    name = "mlx-gemma3-window-mask"        # letters, digits, '-', '_', '.'
    engine = "mlx-lm"                       # "transformers" or "mlx-lm"
    buggy = "0.26.3"                        # a release that has the bug (installed from the package index)
    fixed = "0.26.4"                        # a release that fixed it
    upstream = "ml-explore/mlx-lm PR 390"
    story = "two lines: what went wrong, and what shows it"
    expect = "window_mismatch"              # the BugClass that is right for the bug
    [entry.model]                           # the tiny model's config.json (TINY_BASE sizes unless given)
    model_type = "gemma3_text"
    sliding_window = 8
    [entry.case]                            # the case that exposes it (ropekv.parity.cases.Case)
    length = 12                             # prompt tokens
    decode_steps = 5
    prefix = 0                              # tokens already cached by an earlier request (default 0)
    chunk = 4                               # prefill the prompt this many tokens at a time (default: at once)
    [entry.options]                         # engine options (transformers: drive, cache_implementation)
    drive = "generate"

Everything is validated when the file is read (:func:`load_corpus`): an unknown key, a value of the
wrong type, a number out of its bounds, an unknown engine or bug class, a version that is not a plain
release number, two entries with one name: each is a :class:`~ropekv.errors.ConfigError` naming the
entry and the key. Nothing of a corpus is run before all of it has been read.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..files import open_regular
from ..parity.bug_class import BugClass

ENGINES = ("transformers", "mlx-lm")
MAX_CORPUS_BYTES = 1 << 20  # a corpus is text a person writes; a megabyte is far beyond any real one
MAX_ENTRIES = 200
MAX_TEXT = 2000  # characters of a story or an upstream reference
MAX_TOKENS = 4096  # a case's length and decode steps: tiny models, and a check a CI lane can afford
MAX_MODEL_NUMBER = 1e12  # any number of the tiny model's config (rope_theta 1e6 fits; sizes are bounded below)
# The sizes that decide a model's memory: a replay model is tiny, and a corpus cannot make it otherwise.
SIZE_LIMITS = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "vocab_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 256,
    "max_position_embeddings": 1 << 16,
}
DEFAULT_CASE: dict[str, int | None] = {"length": 12, "decode_steps": 4, "prefix": 0, "chunk": None}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")
_ENTRY_KEYS = {"name", "engine", "buggy", "fixed", "upstream", "story", "expect", "model", "case", "options"}
_CASE_KEYS = {"length": 1, "decode_steps": 1, "prefix": 0, "chunk": 1}
_OPTIONS = {
    "transformers": {"drive": ("forward", "generate"), "cache_implementation": None},
    "mlx-lm": {},
}


@dataclass(frozen=True)
class ReplayCase:
    """The cached run that exposes a bug: ``prefix`` tokens from an earlier request's cache (0: none), a
    prompt of ``length`` tokens after them (prefilled ``chunk`` tokens at a time; None: at once), then
    ``decode_steps`` steps (``ropekv.parity.cases.Case``'s meaning of each)."""

    length: int
    decode_steps: int
    prefix: int = 0
    chunk: int | None = None


@dataclass(frozen=True)
class Entry:
    """One real bug: where it shipped, where it was fixed, and how a tiny model shows it."""

    name: str
    engine: str
    buggy: str
    fixed: str
    upstream: str
    story: str
    expect: BugClass
    model: Mapping[str, Any]  # the tiny model's config.json entries (TINY_BASE fills the sizes)
    case: ReplayCase
    options: Mapping[str, str]


@dataclass(frozen=True)
class Corpus:
    source: str
    entries: tuple[Entry, ...]

    def select(self, names: list[str] | None) -> Corpus:
        """The entries named (in the corpus's order); an unknown name is refused."""
        if not names:
            return self
        known = {e.name for e in self.entries}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ConfigError(
                f"{self.source}: no entry named {', '.join(unknown)} (entries: {', '.join(sorted(known))})"
            )
        return Corpus(self.source, tuple(e for e in self.entries if e.name in names))


def default_corpus_path() -> Path:
    return Path(__file__).with_name("corpus.toml")


def load_corpus(path: str | Path | None = None) -> Corpus:
    """Read and validate a corpus file (None: the one ropekv ships)."""
    path = Path(path) if path is not None else default_corpus_path()
    f, size = open_regular(path, "replay corpus", ConfigError)
    with f:
        if size > MAX_CORPUS_BYTES:
            raise ConfigError(f"{path}: {size} bytes; a replay corpus is at most {MAX_CORPUS_BYTES} bytes")
        raw = f.read(MAX_CORPUS_BYTES + 1)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not a TOML file: {exc}") from None
    return parse_corpus(data, str(path))


def parse_corpus(data: Mapping[str, Any], source: str) -> Corpus:
    """A corpus from its parsed TOML (``{"entry": [...]}``), validated."""
    extra = sorted(set(data) - {"entry"})
    if extra:
        raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(extra)} (a corpus is a list of [[entry]])")
    items = data.get("entry")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{source}: no [[entry]] tables")
    if len(items) > MAX_ENTRIES:
        raise ConfigError(f"{source}: {len(items)} entries; at most {MAX_ENTRIES}")
    entries = tuple(_entry(item, f"{source}: entry {i + 1}") for i, item in enumerate(items))
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise ConfigError(f"{source}: two entries named {e.name!r}")
        seen.add(e.name)
    return Corpus(source, entries)


def _entry(item: Any, where: str) -> Entry:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: an [[entry]] table, got {type(item).__name__}")
    extra = sorted(set(item) - _ENTRY_KEYS)
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(extra)} (known: {', '.join(sorted(_ENTRY_KEYS))})")
    name = _text(item, "name", where, 64)
    if not _NAME.match(name):
        raise ConfigError(f"{where}: name {name!r} must be letters, digits, '-', '_' or '.' (at most 64)")
    where = f"{where.rsplit(': ', 1)[0]}: entry {name!r}"
    engine = _text(item, "engine", where, 32)
    if engine not in ENGINES:
        raise ConfigError(f"{where}: engine {engine!r} is not one of {', '.join(ENGINES)}")
    buggy, fixed = (_version(item, k, where) for k in ("buggy", "fixed"))
    if buggy == fixed:
        raise ConfigError(f"{where}: buggy and fixed are the same release {buggy}")
    expect_text = _text(item, "expect", where, 64)
    try:
        expect = BugClass(expect_text)
    except ValueError:
        raise ConfigError(
            f"{where}: expect {expect_text!r} is not a bug class ({', '.join(c.value for c in BugClass)})"
        ) from None
    return Entry(
        name=name,
        engine=engine,
        buggy=buggy,
        fixed=fixed,
        upstream=_text(item, "upstream", where, MAX_TEXT),
        story=_text(item, "story", where, MAX_TEXT),
        expect=expect,
        model=_model(item.get("model"), where),
        case=_case(item.get("case", {}), where),
        options=_options(item.get("options", {}), engine, where),
    )


def _text(item: Mapping[str, Any], key: str, where: str, limit: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: {key} must be a non-empty string, got {value!r}")
    if len(value) > limit:
        raise ConfigError(f"{where}: {key} has {len(value)} characters; at most {limit}")
    return value.strip()


def _version(item: Mapping[str, Any], key: str, where: str) -> str:
    value = _text(item, key, where, 32)
    if not _VERSION.match(value):
        raise ConfigError(f"{where}: {key} {value!r} must be a release number such as 4.51.3")
    return value


def _case(value: Any, where: str) -> ReplayCase:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [entry.case] must be a table, got {type(value).__name__}")
    extra = sorted(set(value) - set(_CASE_KEYS))
    if extra:
        raise ConfigError(f"{where}: case: unknown key(s) {', '.join(extra)} (known: {', '.join(_CASE_KEYS)})")
    out: dict[str, int | None] = {}
    for key, low in _CASE_KEYS.items():
        v = value.get(key, DEFAULT_CASE[key])
        if v is None and key == "chunk":
            out[key] = None
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_TOKENS:
            raise ConfigError(f"{where}: case.{key} must be an integer in [{low}, {MAX_TOKENS}], got {v!r}")
        out[key] = v
    return ReplayCase(**out)  # type: ignore[arg-type]


def _options(value: Any, engine: str, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [entry.options] must be a table, got {type(value).__name__}")
    known = _OPTIONS[engine]
    extra = sorted(set(value) - set(known))
    if extra:
        raise ConfigError(
            f"{where}: options: unknown key(s) {', '.join(extra)} for {engine} (known: {', '.join(known) or 'none'})"
        )
    out = {}
    for key, choices in known.items():
        if key not in value:
            continue
        v = value[key]
        if not isinstance(v, str) or (choices is not None and v not in choices) or not _NAME.match(v):
            allowed = f"one of {', '.join(choices)}" if choices else "a name"
            raise ConfigError(f"{where}: options.{key} must be {allowed}, got {v!r}")
        out[key] = v
    return out


def _model(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where}: [entry.model] must be a table with at least model_type")
    model_type = value.get("model_type")
    if not isinstance(model_type, str) or not _NAME.match(model_type):
        raise ConfigError(f"{where}: model.model_type must be an architecture name, got {model_type!r}")
    _bounded(value, f"{where}: model", 0)
    for key, limit in SIZE_LIMITS.items():
        v = value.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limit):
            raise ConfigError(f"{where}: model.{key} must be an integer in [1, {limit}] (a tiny model), got {v!r}")
    return dict(value)


def _bounded(value: Any, where: str, depth: int) -> None:
    """Every number of the model config is finite and bounded; nesting is shallow (config.json's shape)."""
    if depth > 4:
        raise ConfigError(f"{where}: nested too deep")
    if isinstance(value, dict):
        for k, v in value.items():
            _bounded(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        if len(value) > 1024:
            raise ConfigError(f"{where}: a list of {len(value)} items; at most 1024")
        for i, v in enumerate(value):
            _bounded(v, f"{where}[{i}]", depth + 1)
    elif isinstance(value, bool) or value is None or isinstance(value, str):
        return
    elif isinstance(value, int | float):
        if value != value or abs(value) > MAX_MODEL_NUMBER:
            raise ConfigError(f"{where}: {value} is not a finite number of magnitude at most {MAX_MODEL_NUMBER:g}")
    else:  # TOML dates and times have no place in a config.json
        raise ConfigError(f"{where}: {type(value).__name__} values are not config.json values")
