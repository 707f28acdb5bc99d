"""No import circle in medfed: module-level, function-level (lazy) and TYPE_CHECKING imports alike.

Every module's imports are read with :mod:`ast` (nothing is imported), each
``import medfed.x`` / ``from medfed.x import y`` resolved to the module it
names (``y`` when it is a submodule, else ``x``), and the graph searched for
a circle. A lazy or type-checking import still couples the two modules; a
circle means neither can be read or moved without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "medfed"


def module_names(package: Path) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of ``package`` (a package is named by its folder)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The medfed modules ``path`` (module ``name``) imports anywhere in its code, relative imports included."""

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names if alias.name.split(".")[0] == "medfed")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            if base.split(".")[0] == "medfed":
                found.update(known(f"{base}.{alias.name}") or known(base) for alias in node.names)
    return {module for module in found if module is not None and module != name}


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle ``[a, b, ..., a]`` of ``graph`` (depth-first search), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every path from it is searched
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_finder_sees_lazy_and_type_checking_imports_and_names_the_circle(tmp_path):
    package = tmp_path / "medfed"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from medfed.sub import b\n")
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    (package / "sub" / "c.py").write_text("import medfed.a\n")
    graph = import_graph(package)
    assert graph["medfed.a"] == {"medfed.sub.b"} and graph["medfed.sub.b"] == {"medfed.sub.c"} and graph["medfed.sub.c"] == {"medfed.a"}
    assert find_cycle(graph) == ["medfed.a", "medfed.sub.b", "medfed.sub.c", "medfed.a"]
    (package / "sub" / "c.py").write_text("import medfed.sub\n")  # a package's __init__ is a module of its own
    assert find_cycle(import_graph(package)) is None


def test_medfed_has_no_import_circle():
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


ALGORITHMS = "medfed.federated.strategies"


def test_the_framework_never_imports_the_algorithms():
    # the framework writes against medfed.federated.protocol and loads a strategy's class from its registration line
    graph = import_graph(PACKAGE)
    framework = {name: imported for name, imported in graph.items() if not name.startswith(ALGORITHMS)}
    importing = {name: sorted(m for m in imported if m.startswith(ALGORITHMS)) for name, imported in framework.items()}
    assert {name: found for name, found in importing.items() if found} == {}
    assert graph["medfed.federated.protocol"] <= {"medfed.data.federation", "medfed.models.base"}  # the contract stands alone
