"""No import cycle in the transport, type-only imports included: its parts never import the ``Bus`` back
(they take ``transport.interface.Connection``), so each can be read, and replaced, on its own."""

from __future__ import annotations

import ast
from pathlib import Path

TRANSPORT = Path(__file__).resolve().parents[2] / "runtime" / "transport"
PREFIX = "gym_runtime.transport"


def imports(path: Path) -> set[str]:
    """The transport modules ``path`` imports, under ``if TYPE_CHECKING:`` or not."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PREFIX:
                found |= {alias.name for alias in node.names}
            elif node.module.startswith(PREFIX + "."):
                found.add(node.module.split(".")[2])
    return found


def test_the_transport_modules_import_each_other_without_a_cycle() -> None:
    graph = {p.stem: imports(p) for p in TRANSPORT.glob("*.py")}
    assert {"bus", "blobs", "jetstream", "serving", "interface"} <= graph.keys()
    cycles: list[list[str]] = []

    def walk(module: str, path: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            if dep in path:
                cycles.append([*path[path.index(dep) :], dep])
            else:
                walk(dep, [*path, dep])

    for module in graph:
        walk(module, [module])
    assert cycles == []
    assert "bus" not in graph["blobs"] | graph["jetstream"] | graph["serving"] | graph["pull"]
