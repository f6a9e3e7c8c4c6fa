"""The house rules of the source tree: no import circles, short files, every package says what it owns."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "bench", "specserve", "tools")
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every project module `path` imports, wherever the import sits (TYPE_CHECKING and
    function-local imports count: a circle hidden in a function is still a circle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path, or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def _collapsed(unit: Callable[[str], str]) -> dict[str, set[str]]:
    """The module graph with each module replaced by `unit(module)`, self-edges dropped."""
    modules = _modules()
    graph: dict[str, set[str]] = {unit(name): set() for name in modules}
    for name, path in modules.items():
        graph[unit(name)] |= {unit(m) for m in _imports(path, name, modules)} - {unit(name)}
    return graph


def _subpackage(name: str) -> str:
    """`engine.spec_decode.proposers.ngram` -> `engine.spec_decode`; a top package's own modules
    (`engine.sequence`, `server.app`) stand for themselves."""
    parts = name.split(".")
    is_package = (ROOT.joinpath(*parts[:2]) / "__init__.py").exists()
    return ".".join(parts[:2]) if len(parts) > 2 or is_package else name


def _folder(name: str) -> str:
    """A module's folder (`engine.model.quant.linear` -> `engine.model.quant`, `engine.model.runner`
    -> `engine.model`), so a folder and the one inside it cannot import each other; a top
    package's own modules (`engine.sequence`, `server.app`) stand for themselves."""
    parts = name.split(".")
    if (ROOT.joinpath(*parts) / "__init__.py").exists() or len(parts) <= 2:
        return name
    return ".".join(parts[:-1])


@pytest.mark.parametrize(
    "unit",
    [lambda name: name.split(".")[0], _subpackage, _folder],
    ids=["top-level packages", "subpackages", "folders"],
)
def test_no_package_circles(unit: Callable[[str], str]) -> None:
    """engine <- server <- bench <- specserve, one way; and no subpackage (engine.spec_decode)
    both imports and is imported by another (or by a module beside it, engine.sequence)."""
    graph = _collapsed(unit)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


@pytest.mark.parametrize("pkg", PACKAGES)
def test_files_stay_short(pkg: str) -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / pkg).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize(
    ("folder", "patterns"),
    [("engine/kernels/csrc", ("*.cpp", "*.h")), ("tests", ("*.py",))],
)
def test_native_code_and_tests_stay_short_too(folder: str, patterns: tuple[str, ...]) -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for pattern in patterns
        for p in (ROOT / folder).rglob(pattern)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_every_package_says_what_it_owns() -> None:
    silent = [
        str(init.relative_to(ROOT))
        for pkg in PACKAGES
        for init in (ROOT / pkg).rglob("__init__.py")
        if not ast.get_docstring(ast.parse(init.read_text()))
    ]
    assert not silent, f"packages without a docstring: {silent}"
