"""The package's import graph, as a maintainer reads it: arrows running back up the layers, and circles.

    python tests/bench/import_graph.py [--contracts PATH]   # default: this tree's .importlinter

An arrow up is an import from a module of a lower layer of ``.importlinter``'s layers contract to one of a
higher layer (import-linter's own check, counted rather than failed: its ``ignore_imports`` would hide them).
A circle is a set of modules that reach each other through their imports (a strongly connected component of
more than one module), ``if TYPE_CHECKING:`` imports included, as they are arrows a reader follows too. A
package and its own submodule count: ``config/__init__.py`` importing ``config.fingerprints``, which imports
``gym_runtime.config`` back, is a circle. Used for issue 53's closing note. Last, the circles between rooms: the
same with each top-level package folded into one node (issue 64 item 7).
"""

from __future__ import annotations

import argparse
import configparser
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]


def layers(contracts: Path) -> list[list[str]]:
    """The layers contract's modules, top first (``:`` and ``|`` siblings share a layer)."""
    ini = configparser.ConfigParser()
    ini.read(contracts)
    lines = [line.strip() for line in ini["importlinter:contract:layers"]["layers"].splitlines() if line.strip()]
    return [[m.strip() for m in line.replace("|", ":").split(":")] for line in lines]


def layer_of(module: str, table: list[list[str]]) -> int | None:
    for i, mods in enumerate(table):
        if any(module == m or module.startswith(m + ".") for m in mods):
            return i
    return None


def circles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child) & modules))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contracts", type=Path, default=REPO / ".importlinter", help="the .importlinter to read")
    args = ap.parse_args()
    graph = grimp.build_graph("gym_runtime")
    modules = {m for m in graph.modules if m.startswith("gym_runtime")}
    table = layers(args.contracts)
    up = []
    for importer in sorted(modules):
        lo = layer_of(importer, table)
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & modules):
            hi = layer_of(imported, table)
            if lo is not None and hi is not None and hi < lo:
                up.append(f"{importer} -> {imported}")
    found = circles(graph, modules)
    print(f"modules: {len(modules)}")
    print(f"arrows up: {len(up)}")
    for line in up:
        print(f"  {line}")
    print(f"circles: {len(found)}")
    for comp in found:
        print(f"  {' <-> '.join(comp)}")
    rooms = sorted(graph.find_children("gym_runtime"))
    for room in rooms:  # each top-level package folded into one node: the rooms a reader walks between
        if graph.find_children(room):
            graph.squash_module(room)
    between = circles(graph, set(rooms))
    print(f"circles between rooms (top-level modules and packages, {len(rooms)}): {len(between)}")
    for comp in between:
        print(f"  {' <-> '.join(comp)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
