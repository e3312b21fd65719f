"""The package's shape: no import cycle between tsckpt's modules, one public surface."""

from __future__ import annotations

import ast
import pathlib

import tsckpt

PKG = pathlib.Path(tsckpt.__file__).parent


def _imports() -> dict[str, set[str]]:
    """module -> tsckpt modules it imports (at module level or inside functions)."""
    graph: dict[str, set[str]] = {}
    for path in PKG.glob("*.py"):
        name = path.stem
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
        graph[name] = deps - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if m == "__init__" or m not in graph:
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle():
    graph = _imports()
    graph.pop("__init__")
    graph.pop("__main__", None)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_torch_private_sharding_helper_has_one_home():
    users = [p.name for p in PKG.glob("*.py") if "compute_local_shape_and_global_offset" in p.read_text()]
    assert users == ["_dtensor.py"]


def test_cli_does_no_library_work():
    """The CLI parses and prints: it opens no TensorStore and writes no files itself."""
    text = (PKG / "_cli.py").read_text()
    for needle in ("import tensorstore", "safe_open", "save_file", "kvstore()", "json.loads"):
        assert needle not in text, needle


def test_public_surface():
    for name in ("save", "restore", "open", "metadata", "verify", "convert", "save_async"):
        assert name in tsckpt.__all__ and callable(getattr(tsckpt, name))
    assert all(not n.startswith("_") for n in tsckpt.__all__)
