"""The docs name only what exists: every ``ropekv <command> --flag`` written in README.md or docs/*.md
is a flag of that command's parser, every ``ropekv.module.name`` or ``ropekv/path.py`` they cite
resolves, and the lists of supported architectures they quote are the package's own. Read from the Markdown (inline code and fenced blocks), compared with ``build_parser()`` and
the package itself, so a renamed flag or a moved module fails here instead of in a reader's shell."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from ropekv.cli.main import build_parser
from ropekv.models.config import ARCHITECTURES
from ropekv.models.gguf_file import SUPPORTED_ARCHITECTURES as GGUF_ARCHITECTURES

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"`([^`\n]+)`")


def _parsers() -> dict[str, set[str]]:
    parser = build_parser()
    common = {s for a in parser._actions for s in a.option_strings}
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {name: common | set(p._option_string_actions) for name, p in sub.choices.items()}


PARSERS = _parsers()
COMMAND = re.compile(r"(?<![\w./-])ropekv\s+(?:--debug\s+)?(" + "|".join(sorted(PARSERS)) + r")\b")


def commands(text: str) -> list[tuple[int, str, str]]:
    """``(line, command, text)`` for every ropekv command written in ``text``: an inline code span, or a
    command in a fenced block with its continuation lines (indented, or after a trailing backslash)."""
    out: list[tuple[int, str, str]] = []
    lines = text.splitlines()
    in_fence, current = False, None
    for n, line in enumerate(lines, 1):
        if FENCE.match(line):
            in_fence = not in_fence
            current = None
            continue
        if in_fence:
            m = COMMAND.search(line)
            if m:
                current = [n, m.group(1), line[m.start() :]]
                out.append(current)  # type: ignore[arg-type]
            elif current is not None and (line[:1].isspace() or current[2].rstrip().endswith("\\")) and line.strip():
                current[2] += " " + line.strip()
            else:
                current = None
            continue
        for span in INLINE.findall(line):
            m = COMMAND.search(span)
            if m:
                out.append((n, m.group(1), span[m.start() :]))
    return [tuple(c) for c in out]  # type: ignore[misc]


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def flag_findings(path: Path) -> list[str]:
    rel = _rel(path)
    found = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, command, text in commands(path.read_text(encoding="utf-8")):
        if "unrecognized argument" in lines[n - 1]:
            continue  # a documented refusal of a misspelled flag, shown with its message
        # a second ropekv command in the same span ends this one's flags
        text = re.split(r"\s(?:&&|\|\||;|\|)\s", text)[0]
        found += [
            f"{rel}:{n}: ropekv {command} has no {flag}" for flag in FLAG.findall(text) if flag not in PARSERS[command]
        ]
    return found


MODULE_PATH = re.compile(r"(?<![\w./-])ropekv(?:\.[A-Za-z_]\w*)+")
FILE_PATH = re.compile(r"(?<![\w./-])(?:ropekv|tests|engine_tests|scripts|examples|docs)/[\w./-]+\.(?:py|sh|md)\b")


# names the package writes into files and messages (format names such as ``ropekv.cache_contract``),
# which look like module paths and are not
FORMAT_NAMES = {
    m.group(1)
    for source in (REPO / "ropekv").rglob("*.py")
    for m in re.finditer(r"""["'](ropekv(?:\.\w+)+)["']""", source.read_text(encoding="utf-8"))
}


def resolves(dotted: str) -> bool:
    if dotted in FORMAT_NAMES:
        return True
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def path_findings(path: Path) -> list[str]:
    rel = _rel(path)
    found = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for span in INLINE.findall(line) + ([line] if line.startswith(("    ", "\t")) else []):
            found += [f"{rel}:{n}: {m} does not resolve" for m in MODULE_PATH.findall(span) if not resolves(m)]
            found += [f"{rel}:{n}: {m} does not exist" for m in FILE_PATH.findall(span) if not (REPO / m).exists()]
    return found


def test_the_scanner_reads_commands_as_the_docs_write_them():
    text = (
        "Run `ropekv check MODEL --lengths 1,17 --no-such-flag` or `ropekv.cli` alone.\n"
        "```\n"
        "ropekv handoff [MODEL] [--decode-workers N]\n"
        "               [--seed 0] [--backend auto]\n"
        "python -m ropekv.bench --quick\n"
        "```\n"
        "`--backend` in prose, outside any command, is not read.\n"
    )
    got = commands(text)
    assert [(n, c) for n, c, _ in got] == [(1, "check"), (3, "handoff")]
    assert "--no-such-flag" in got[0][2] and "--backend auto" in got[1][2] and "--quick" not in got[1][2]


def test_the_scanner_flags_a_flag_the_parser_lacks(tmp_path):
    doc = tmp_path / "scratch.md"
    doc.write_text("`ropekv handoff --backend gloo` and `ropekv check --lenghts 3`\n", encoding="utf-8")
    assert flag_findings(doc) == [
        "scratch.md:1: ropekv handoff has no --backend",
        "scratch.md:1: ropekv check has no --lenghts",
    ]


def test_the_path_check_flags_what_does_not_resolve():
    assert resolves("ropekv.transfer.saved.load_sequence") and resolves("ropekv.cli.main")
    assert not resolves("ropekv.transfer.saved.no_such_thing") and not resolves("ropekv.no_such_module")
    assert resolves("ropekv.cache_contract") and resolves("ropekv.handoff")  # a format name, a package


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_flag_written_in_the_docs_exists(doc):
    assert flag_findings(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_module_and_file_path_in_the_docs_exists(doc):
    assert path_findings(doc) == []


SUPPORTED = re.compile(r"unsupported (GGUF )?architecture '[^']*'; supported: ([a-z0-9_, .]+)")
OLD_LIST = re.compile(r"llama,\s+mistral,\s+qwen2,\s+qwen3\b")  # the four architectures of early releases


def architecture_findings(path: Path) -> list[str]:
    rel, text = _rel(path), path.read_text(encoding="utf-8")
    found = [
        f"{rel}:{text[: m.start()].count(chr(10)) + 1}: stale architecture list {m.group(0)!r}"
        for m in OLD_LIST.finditer(text)
    ]
    for m in SUPPORTED.finditer(text):
        line = text[: m.start()].count("\n") + 1
        want = GGUF_ARCHITECTURES if m.group(1) else ARCHITECTURES
        names = [n.strip() for n in m.group(2).split(",") if n.strip()]
        if names and names[-1] == "...":
            ok = tuple(names[:-1]) == tuple(want[: len(names) - 1])
        else:
            ok = tuple(names) == tuple(want)
        if not ok:
            found.append(f"{rel}:{line}: quotes supported architectures {names}, the package has {list(want)}")
    return found


def test_the_architecture_check_flags_a_stale_list(tmp_path):
    text = "supported: llama, mistral, qwen2, qwen3 only; `unsupported architecture 'X'; supported: llama, qwen2`"
    doc = tmp_path / "scratch.md"
    doc.write_text(text, encoding="utf-8")
    assert len(architecture_findings(doc)) == 2


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_architectures_the_docs_quote_are_the_supported_ones(doc):
    assert architecture_findings(doc) == []
