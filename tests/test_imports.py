"""No import cycles inside ``attnlab/``.

The graph is read from the source with :mod:`ast` (nothing of attnlab is imported, so it is fast and cannot be
broken by an import error): an edge ``a → b`` for every ``import attnlab.b`` / ``from attnlab.b import x`` /
relative import in module ``a``, at module level AND inside functions, classes and ``try`` blocks (a deferred
import still closes a cycle: it only moves the failure from import time to the first call). Imports under
``if TYPE_CHECKING:`` are left out: they never run. ``from attnlab.x import y`` is an edge to ``attnlab.x.y``
when that is a module (a file or a package), else to ``attnlab.x``; a package's ``__init__.py`` is the package
itself, and its imports of its own submodules (registration imports) are edges like any other. The implicit
import of a parent package (``import attnlab.a.b`` runs ``attnlab/a/__init__.py``) is not an edge.

Layering (lower layers never import higher ones; a module may import its own layer only without a cycle):

1. the bottom, registries and pure helpers: ``registry``, ``checks``, ``stats``, ``transition``, ``masks``,
   ``normalizers``, ``feature_maps``, ``positions``, ``scores`` (with the presets' registry: ``build_score`` takes
   a preset), ``position_bias`` (below ``scores``: it reads the scores' registry through
   :func:`attnlab.registry.registry_of`, never by importing them), ``kernels`` (the compiled kernels, which import
   nothing of attnlab) and ``compat`` (the table of old names: it imports nothing of attnlab when imported, and
   reads a name's new module with :mod:`importlib` only when the old name is read, so the modules with old names,
   at any layer, can import it), ``cores`` (the cores this process can have; nothing of attnlab);
2. ``config`` (the layer's description; it expands presets) above them;
3. ``forms``, ``backends`` and ``stages`` (the layer's own stages: QK-norms, the short convolution, the config
   from the layer's keyword arguments) above ``config``;
4. the layer, ``attention``, above those;
5. on top: ``encoder``, ``module``, ``training``, ``dashboard``, ``bench``, ``card``, ``compare`` (the command
   of :mod:`attnlab.training.compare`) and ``check_device``.

Training never imports the dashboard: statistics both use live in :mod:`attnlab.stats`.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "attnlab"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

LAYERS: tuple[frozenset[str], ...] = (
    frozenset(
        {
            "registry",
            "checks",
            "stats",
            "transition",
            "masks",
            "normalizers",
            "feature_maps",
            "positions",
            "scores",
            "position_bias",
            "kernels",
            "compat",
            "cores",
        }
    ),
    frozenset({"config"}),
    frozenset({"forms", "backends", "stages"}),
    frozenset({"attention"}),
    frozenset({"encoder", "module", "training", "dashboard", "bench", "card", "compare", "check_device"}),
)
"""The layers of the docstring, bottom first, by the name under ``attnlab`` (a package with all its modules)."""


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module under ``root``: its dotted name → its file (a package's ``__init__.py`` is the package)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``, at any depth, except those under ``if TYPE_CHECKING:`` (its ``else``
    runs, so it is walked)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is an attnlab module, or None (outside attnlab)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """The import edges between attnlab modules: module → the attnlab modules it imports (no self-edges)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    # relative: level 1 is the module's own package (the package itself for an __init__)
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    keep = len(package) - (node.level - 1)
                    base = ".".join(package[: max(keep, 0)])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of ``graph`` with two modules or more (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _shortest_path(graph: dict[str, set[str]], start: str, goal: str, within: set[str]) -> list[str] | None:
    """The shortest path start → … → goal through modules of ``within`` (breadth first), or None."""
    previous: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = []
            step: str | None = node
            while step is not None:
                path.append(step)
                step = previous[step]
            return path[::-1]
        for child in sorted(graph[node] & within):
            if child not in previous:
                previous[child] = node
                queue.append(child)
    return None


def find_cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """The import cycles of ``graph`` (default: attnlab's), each as ``[a, b, …, a]``: for every edge inside a
    strongly connected component, the shortest cycle through it, without repeats. Every edge that takes part in
    a cycle shows up in at least one of them, so breaking all the listed cycles' edges is never guesswork."""
    graph = import_graph() if graph is None else graph
    cycles: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for component in _components(graph):
        for source in sorted(component):
            for target in sorted(graph[source] & component):
                back = _shortest_path(graph, target, source, component)
                if back is None:  # cannot happen inside a component
                    continue
                cycle = [source, *back]
                ring = cycle[:-1]
                turn = ring.index(min(ring))
                key = tuple(ring[turn:] + ring[:turn])
                if key not in seen:
                    seen.add(key)
                    cycles.append([*key, key[0]])
    return sorted(cycles, key=lambda cycle: (len(cycle), cycle))


def format_cycle(cycle: list[str]) -> str:
    return " → ".join(cycle)


def test_graph_is_not_trivial():
    graph = import_graph()
    assert len(graph) > 50, f"the walker found only {len(graph)} modules under {ROOT}"
    assert "attnlab.config" in graph["attnlab.attention"]
    assert sum(len(targets) for targets in graph.values()) > 100


def test_walker_resolves_submodules_relative_imports_and_skips_type_checking(tmp_path):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from attnlab.sub import leaf\n")
    (package / "sub" / "__init__.py").write_text("from . import leaf\nfrom .leaf import thing\n")
    (package / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from attnlab import top\n"
        "else:\n    import attnlab.other\n"
        "def f():\n    from .. import top\n"
    )
    (package / "top.py").write_text("import attnlab.sub.leaf\nfrom attnlab import sub\n")
    (package / "other.py").write_text("x = 1\n")
    graph = import_graph(package)
    assert graph == {
        "attnlab": {"attnlab.sub.leaf"},
        "attnlab.sub": {"attnlab.sub.leaf"},
        "attnlab.sub.leaf": {"attnlab.other", "attnlab.top"},
        "attnlab.top": {"attnlab.sub.leaf", "attnlab.sub"},
        "attnlab.other": set(),
    }
    cycles = [format_cycle(cycle) for cycle in find_cycles(graph)]
    assert cycles == [
        "attnlab.sub.leaf → attnlab.top → attnlab.sub.leaf",
        "attnlab.sub → attnlab.sub.leaf → attnlab.top → attnlab.sub",
    ]


def layer_of(module: str) -> int | None:
    """The layer (index into :data:`LAYERS`: the docstring's number less one) of ``attnlab.<name>[...]``; None for
    a module the rule does not place."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return next((i for i, names in enumerate(LAYERS) if parts[1] in names), None)


def upward_imports(graph: dict[str, set[str]] | None = None) -> list[str]:
    """The edges that break the layering: a module importing one of a higher layer, or training the dashboard."""
    graph = import_graph() if graph is None else graph
    out = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = layer_of(source), layer_of(target)
            if low is not None and high is not None and low < high:
                out.append(f"{source} (layer {low + 1}) → {target} (layer {high + 1})")
            elif source.startswith(f"{PACKAGE}.training") and target.startswith(f"{PACKAGE}.dashboard"):
                out.append(f"{source} → {target} (training never imports the dashboard: use attnlab.stats)")
    return out


def test_layers_are_kept():
    upward = upward_imports()
    listing = "\n".join(f"  {edge}" for edge in upward)
    assert not upward, f"imports against the layering of tests/test_imports.py's docstring:\n{listing}"


def test_upward_imports_are_found():
    graph = {
        "attnlab.scores": {"attnlab.config", "attnlab.registry"},
        "attnlab.config": {"attnlab.scores"},
        "attnlab.training.tuned": {"attnlab.dashboard.stats", "attnlab.stats"},
        "attnlab.runs": {"attnlab.attention"},  # (a module the rule does not place)
    }
    assert upward_imports(graph) == [
        "attnlab.scores (layer 1) → attnlab.config (layer 2)",
        "attnlab.training.tuned → attnlab.dashboard.stats (training never imports the dashboard: use attnlab.stats)",
    ]


def test_no_import_cycles():
    cycles = find_cycles()
    listing = "\n".join(f"  {format_cycle(cycle)}" for cycle in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) in attnlab/ (layering: see tests/test_imports.py):\n{listing}"
