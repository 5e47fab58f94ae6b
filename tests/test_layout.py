"""The package's floors (README "Layout"), read from every import its modules make, function-local ones included:
no import cycle; modeling/ (shipped to the Hub) imports only itself; nothing below the commands imports a command."""

import ast
from pathlib import Path

import dattn_export

PACKAGE = Path(dattn_export.__file__).parent


def module_name(path: Path) -> str:
    parts = ["dattn_export", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module -> the package's modules it imports (a name imported from a package counts as its submodule
    where it is one). A module importing its own package is left out: importing a submodule imports it anyway."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                origin = ".".join(base + [node.module] * bool(node.module))
                targets |= {f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, found = {}, {}, [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            found.extend([sorted(component)] if len(component) > 1 else [])

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and graph["dattn_export.stages.demo"]  # the graph is read: the check can fail
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_above_its_floor():
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("dattn_export.modeling"):  # ships to the Hub as-is
            assert all(t.startswith("dattn_export.modeling") for t in targets), (module, targets)
        if not module.startswith(("dattn_export.stages", "dattn_export.cli", "dattn_export.__main__")):
            assert not any(t.startswith("dattn_export.stages") for t in targets), (module, targets)
        if not module.startswith(("dattn_export.cli", "dattn_export.__main__")):
            assert not any(t.startswith("dattn_export.cli") for t in targets), (module, targets)
