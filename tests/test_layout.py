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


def missing_parts(parts: list[tuple[object, str, set]]) -> list[str]:
    """Each (floor, role, streams): the parts the floor lacks, by the names `ContextStream.part_on` looks up."""
    return [f"{floor.__name__}.{role}_{s.name}" for floor, role, needed in parts for s in needed
            if not hasattr(floor, f"{role}_{s.name}")]  # fmt: skip


def test_every_stream_has_its_part_on_every_floor():
    """A context stream is its class in modeling/streams.py plus its part on each floor above, named after it
    (`ContextStream.part_on`: `modules_frames`), or, for what is keyed by what it gives (its modality, its media), an
    entry in one table: a stream added without one of them fails here, and the message names every part that it
    lacks. (vLLM's parts are checked in test_vllm.py, which imports vLLM.)"""
    from dattn_export import demo_model, graphs, media, media_options
    from dattn_export.modeling import context, streams
    from dattn_export.runtime.graph import GraphRuntime
    from dattn_export.stages import push, validate, verify

    every = {s for s in vars(streams).values() if isinstance(s, streams.ContextStream)}
    first = {streams.streams_of(kind, ratio)[0] for kind in streams.STREAMS for ratio in ("resize", "anyres")}
    video = set(streams.STREAMS["video"])
    assert {s.name for s in every} == {"image", "tiles", "frames", "audio"} and len(first) == 3  # the sets are read
    parts = [
        (context.ContextStreams, "modules", every),
        (graphs, "spec", every),
        (media, "graph_context", first),  # by a model's first stream
        (validate, "context_check", first),
        (GraphRuntime, "parts", video),  # a video's streams, through their graphs a part at a time
        (GraphRuntime, "amount", video),
    ]
    assert missing_parts(parts) == []
    tables = {
        "media_options.MODEL_KINDS": (media_options.MODEL_KINDS, every, "modality"),
        "push.MEDIA_PARTS": (push.MEDIA_PARTS, every, "modality"),
        "verify.PROBES": (verify.PROBES, every, "modality"),
        "demo_model.DEMO_QUESTIONS": (demo_model.DEMO_QUESTIONS, every, "modality"),
        "demo_model.TOWER_FOLDER_SUFFIX": (demo_model.TOWER_FOLDER_SUFFIX, every, "modality"),
    }
    lacking = {
        table: sorted(getattr(s, key) for s in needed if getattr(s, key) not in entries)
        for table, (entries, needed, key) in tables.items()
    }
    assert {table: names for table, names in lacking.items() if names} == {}
    media_fields = {field for s in every for field in s.media}
    assert media_fields == set(media_options.MEDIA_OPTIONS) == set(media_options.MEDIA_KINDS)


def test_every_module_says_its_job_in_few_enough_lines():
    """A newcomer opens one module for one change: each says what it is for in its docstring, and none runs past
    550 lines."""
    modules = {module_name(path): path.read_text() for path in PACKAGE.rglob("*.py")}
    assert len(modules) > 80  # the package is read: the check can fail
    assert [name for name, text in modules.items() if not ast.get_docstring(ast.parse(text))] == []
    assert {name: n for name, text in modules.items() if (n := len(text.splitlines())) > 550} == {}
