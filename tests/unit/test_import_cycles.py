"""No two modules of one llmflow folder import each other, directly or round a longer circle.

A circle works only while one of its imports is deferred into a function (or a module
``__getattr__``); the order the modules load in then decides what exists when. What two modules
share belongs in a third, below both. Every import counts: at module level, inside functions and
under ``TYPE_CHECKING``."""

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "llmflow"


def _module_name(path: Path) -> str:
    return ".".join(("llmflow", *path.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__")


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The llmflow modules ``path`` imports anywhere in it (``from llmflow.x import y`` names the
    module ``llmflow.x.y`` where that is a module, else ``llmflow.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmflow"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found & set(modules)


def _folder(module: str) -> str:
    return module.rpartition(".")[0]


def import_graph() -> dict[str, set[str]]:
    """Each module -> the modules of its own folder it imports (a package's ``__init__`` counts as
    a module of the folder it opens)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        folder = name if path.name == "__init__.py" else _folder(name)
        graph[name] |= {m for m in _imported(path, modules) if m != name
                        and (_folder(m) == folder or m == folder)}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per group of modules that import each other (the groups: strongly connected
    components, Tarjan's algorithm), as the path round it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_round(group, graph) for group in groups]


def _path_round(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, through the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, set()) & members):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    return group


def test_no_module_imports_one_that_imports_it_back():
    cycles = [" -> ".join(cycle) for cycle in find_cycles(import_graph())]
    assert cycles == []


def test_the_finder_sees_a_circle_through_a_deferred_import(tmp_path):
    """A circle closed by an import inside a function, or a longer one, is found; a chain is not."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from llmflow.x.b import f\n")
    b.write_text("def f():\n    from llmflow.x import a\n    return a\n")
    modules = {"llmflow.x.a": a, "llmflow.x.b": b}
    graph = {name: _imported(path, modules) - {name} for name, path in modules.items()}
    assert graph == {"llmflow.x.a": {"llmflow.x.b"}, "llmflow.x.b": {"llmflow.x.a"}}
    assert find_cycles(graph) == [["llmflow.x.a", "llmflow.x.b", "llmflow.x.a"]]
    assert find_cycles({"p": {"q"}, "q": {"r"}, "r": {"p"}, "s": {"p"}}) == [["p", "q", "r", "p"]]
    assert find_cycles({"p": {"q"}, "q": {"r"}, "r": set()}) == []
