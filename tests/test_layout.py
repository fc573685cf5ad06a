"""The package's layout, read from its source with ``ast`` (nothing is imported or run).

- No import cycle among ropekv's modules. An import counts wherever it stands: at module level or
  inside a function (a function-level import that merely defers a cycle is still a cycle). Imports
  under ``if TYPE_CHECKING:`` are excluded from the cycle check: they never run.
- Imports go down the layers (``LAYERS``, bottom first). This check counts ``TYPE_CHECKING`` imports
  too: a type is knowledge of the layer it comes from.
- The parity harness knows no engine: ``ropekv.parity`` imports nothing from the engine, the adapters,
  the faults or the transfer layer.
- No source file cites this project's tracker ("issue 7") or the unshipped ``ROPE_KV_PRIMER``.

What an import statement depends on, as Python runs it: ``import a.b.c`` and ``from a.b.c import x``
run the ``__init__`` of every package on the way (``a``, ``a.b``) and then the module; ``from p import
m`` where ``m`` is a submodule imports ``m``; ``from p import name`` reads ``name`` from ``p``'s
namespace. A module's own ancestor packages are always already importing when it runs, so they are
edges only when a name (not a submodule) is read from them.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ropekv"

# Bottom first; a module may import from its own layer and the layers below it. A top-level module
# or subpackage of ropekv that is in no layer fails the layer test until it is placed here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "probe", "argtypes", "attention_kind", "numbers", "files", "user_code"),
    ("rope",),
    ("models",),
    ("contract",),
    ("cache",),
    ("engine",),
    ("transfer",),
    ("parity",),
    ("adapters",),
    ("faults",),
    ("bugs",),
    ("handoff",),
    ("api", "testing", "bench", "replay", "cli", "__main__"),
)

# What the parity harness must not know (it drives any engine through the adapter protocol).
PARITY_FORBIDDEN = ("engine", "adapters", "faults", "transfer")


@dataclass(frozen=True)
class Import:
    """One dependency of ``source`` on ``target`` (both dotted module names), from one statement."""

    source: str
    target: str
    path: str  # relative to the directory that holds the package
    line: int
    in_function: bool
    type_checking: bool

    def where(self) -> str:
        how = " (in a function)" if self.in_function else ""
        how += " (under TYPE_CHECKING)" if self.type_checking else ""
        return f"{self.path}:{self.line} imports {self.target}{how}"


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the package at ``root`` (packages by __init__)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Collector(ast.NodeVisitor):
    """The import statements of one module: (node, in a function, under TYPE_CHECKING)."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, bool, bool]] = []
        self._function = 0
        self._type_checking = 0

    def _in_function(self, node: ast.AST) -> None:
        self._function += 1
        self.generic_visit(node)
        self._function -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _in_function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._type_checking += 1
        for stmt in node.body:
            self.visit(stmt)
        self._type_checking -= 1
        for stmt in node.orelse:  # the else branch of ``if TYPE_CHECKING`` is what runs
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self._function > 0, self._type_checking > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self._function > 0, self._type_checking > 0))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    if not base:
        raise AssertionError(f"{module}: relative import beyond the top-level package (line {node.lineno})")
    return ".".join(base + ([node.module] if node.module else []))


def _prefixes(dotted: str) -> list[str]:
    parts = dotted.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _is_ancestor(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def imports(modules: dict[str, Path], root: Path = ROOT) -> list[Import]:
    """Every dependency of a ropekv module on another ropekv module (outside imports are dropped)."""
    out: list[Import] = []
    for module, path in modules.items():
        rel = os.path.relpath(path, root.parent)
        is_package = path.name == "__init__.py"
        collector = _Collector()
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for node, in_function, type_checking in collector.found:
            targets: list[str] = []  # the modules this statement runs or reads from
            if isinstance(node, ast.Import):
                for alias in node.names:
                    targets += [p for p in _prefixes(alias.name) if not _is_ancestor(p, module)]
            else:
                base = _resolve(module, is_package, node)
                targets += [p for p in _prefixes(base) if not _is_ancestor(p, module)]
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        targets.append(submodule)
                    elif _is_ancestor(base, module) or base == module:
                        targets.append(base)  # a name read from a package that is still importing
            for target in dict.fromkeys(targets):
                if target in modules and target != module:
                    out.append(Import(module, target, rel, node.lineno, in_function, type_checking))
    return out


def _edges(found: list[Import]) -> dict[str, dict[str, Import]]:
    """source -> target -> the first statement (by line) that makes the dependency."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in sorted(found, key=lambda i: (i.source, i.line)):
        edges.setdefault(imp.source, {}).setdefault(imp.target, imp)
    return edges


def strongly_connected(nodes: list[str], edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(edges.get(start, {})))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges.get(w, {}))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of a ropekv module (``ropekv`` itself is above them all); None: unplaced."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    return None


def test_no_import_cycles() -> None:
    modules = module_files()
    edges = _edges([i for i in imports(modules) if not i.type_checking])
    cycles = strongly_connected(sorted(modules), edges)
    lines = []
    for group in cycles:
        lines.append("cycle: " + ", ".join(group))
        for a in group:
            lines += [f"  {imp.where()}" for b, imp in edges.get(a, {}).items() if b in group]
    assert not cycles, f"{len(cycles)} import cycle(s) in ropekv:\n" + "\n".join(lines)


def test_every_module_has_a_layer() -> None:
    unplaced = sorted({m.split(".")[1] for m in module_files() if layer_of(m) is None})
    assert not unplaced, f"ropekv modules in no layer (add them to LAYERS in {Path(__file__).name}): {unplaced}"


def test_imports_go_down_the_layers() -> None:
    upward: dict[tuple[str, int], str] = {}  # one line per statement: its deepest target
    for imp in imports(module_files()):
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src is not None and dst is not None and dst > src:
            upward[imp.path, imp.line] = f"  {imp.where()}  ({'/'.join(LAYERS[src])} -> {'/'.join(LAYERS[dst])})"
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward.values())


def test_parity_knows_no_engine() -> None:
    forbidden = tuple(f"ropekv.{name}" for name in PARITY_FORBIDDEN)
    found = [
        f"  {imp.where()}"
        for imp in imports(module_files())
        if imp.source.startswith("ropekv.parity")
        and any(imp.target == f or imp.target.startswith(f + ".") for f in forbidden)
    ]
    assert not found, "ropekv.parity imports the engine, adapters, faults or transfer layer:\n" + "\n".join(found)


# "issue 7", "Issue #7", "ticket 12": this project's tracker; upstream references name their project
# ("mlx-vlm #1155") and are not matched. ROPE_KV_PRIMER is a document that does not ship with the code.
TRACKER = re.compile(r"\b(?:issue|ticket)s?\s*#?\s*\d+|ROPE_KV_PRIMER", re.IGNORECASE)


def test_no_tracker_or_primer_citations() -> None:
    found = []
    for path in module_files().values():
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in TRACKER.finditer(text):
                found.append(f"  {os.path.relpath(path, ROOT.parent)}:{number}: {match.group(0)!r}")
    assert not found, "source cites the project's tracker or ROPE_KV_PRIMER:\n" + "\n".join(found)


def test_the_checks_see_cycles_and_upward_imports(tmp_path: Path) -> None:
    """The collector itself: module- and function-level imports count, relative imports resolve,
    TYPE_CHECKING imports are marked, a name read from a parent package is an edge to it."""
    pkg = tmp_path / "ropekv"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from .b import X\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..c import T\n"
        "def f():\n    from .. import a\n"
        "X = 1\n"
    )
    (pkg / "sub" / "c.py").write_text("from ropekv.sub import X\n")
    (pkg / "c.py").write_text("")
    modules = module_files(pkg)
    found = imports(modules, pkg)
    pairs = {(i.source, i.target, i.in_function, i.type_checking) for i in found}
    assert ("ropekv.a", "ropekv.sub", False, False) in pairs  # the package's __init__ runs
    assert ("ropekv.a", "ropekv.sub.b", False, False) in pairs
    assert ("ropekv.sub", "ropekv.sub.b", False, False) in pairs
    assert ("ropekv.sub.b", "ropekv.c", False, True) in pairs
    assert ("ropekv.sub.b", "ropekv.a", True, False) in pairs
    assert ("ropekv.sub.c", "ropekv.sub", False, False) in pairs  # X is read from the importing package
    assert not any(i.source == "ropekv.sub.b" and i.target == "ropekv.sub" for i in found)
    edges = _edges([i for i in found if not i.type_checking])
    assert strongly_connected(sorted(modules), edges) == [["ropekv.a", "ropekv.sub", "ropekv.sub.b"]]
