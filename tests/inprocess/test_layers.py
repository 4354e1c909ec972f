"""The package's import graph: every import of ours, at the top, in functions or under
TYPE_CHECKING, so a cycle cannot hide behind a deferred import. No cycle at all;
rendering imports neither the servers nor the model; and only what registers the
plugin (the CLI, the legacy API, the demo) reaches server code from the client side."""

from __future__ import annotations

import ast
from pathlib import Path

import dask_pyspy

ROOT = Path(dask_pyspy.__file__).parent
REGISTERS_THE_PLUGIN = {"dask_pyspy", "dask_pyspy.__main__", "dask_pyspy.cli", "dask_pyspy.legacy", "dask_pyspy.demo"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """Our modules `path` imports by name (not the packages above them, which Python
    imports first but which import nothing but the public names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            base = node.module or ""
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return found & modules


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (*ROOT.rglob("*.py"), *ROOT.rglob("*.pyi"))}  # the stub: _native
    return {name: imports(path, set(files)) for name, path in files.items()}


def reach(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in edges[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_no_import_cycle():
    edges = graph()
    cycles = sorted(name for name in edges if name in reach(edges, name))
    assert not cycles, f"modules in an import cycle: {cycles}"


def test_rendering_imports_neither_the_servers_nor_the_model():
    edges = graph()
    for name in (n for n in edges if n.startswith("dask_pyspy.render")):
        bad = {m for m in reach(edges, name) if m.startswith("dask_pyspy.server") or m == "dask_pyspy.model"}
        assert not bad, f"{name} imports {bad}"


def test_client_side_code_reaches_no_server_code():
    edges = graph()
    client_side = set(edges) - REGISTERS_THE_PLUGIN - {n for n in edges if n.startswith("dask_pyspy.server")}
    assert "dask_pyspy.client" in client_side and "dask_pyspy.model" in client_side
    for name in client_side:
        bad = {m for m in reach(edges, name) if m.startswith("dask_pyspy.server")}
        assert not bad, f"{name} imports {bad}"
