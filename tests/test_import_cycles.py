"""No import cycles in attnlab (issue 60): registries at the bottom, config above them, forms and backends above
that, the layer above those. Module-level imports only (an import inside a function or under ``TYPE_CHECKING`` is
lazy), a ``from pkg import name`` counting as an import of the package ``pkg`` (its ``__init__``, which imports what
it re-exports) and of ``pkg.name`` where that is a module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "attnlab"


def executed_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: its statements, those of its if/try/with blocks and class
    bodies, not those inside functions or under ``if TYPE_CHECKING``."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                found += executed_imports(node.body)
            found += executed_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += executed_imports(block)
        elif isinstance(node, ast.With | ast.ClassDef):
            found += executed_imports(node.body)
    return found


def module_graph() -> dict[str, set[str]]:
    files = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in executed_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order), or None (a depth-first search with three colours)."""
    colour = dict.fromkeys(graph, 0)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if colour[nxt] == 0 and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if colour[node] == 0 and (found := visit(node)):
            return found
    return None


def test_attnlab_has_no_import_cycle():
    cycle = find_cycle(module_graph())
    assert cycle is None, "an import cycle: " + " -> ".join(cycle)


def test_the_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_backends_do_not_import_the_layer():
    """``choose_backend`` takes the layer's frozen record: no backend imports ``attnlab.attention``."""
    graph = module_graph()
    for name in (n for n in graph if n.startswith("attnlab.backends")):
        assert "attnlab.attention" not in graph[name], name
