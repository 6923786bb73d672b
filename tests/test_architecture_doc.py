"""docs/architecture.md's tables name what the tree holds: a package or module added, moved or removed without
its row is a failure here, not a reader's surprise (issue 64: four adapters had gone missing from them)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import REPO

DOC = REPO / "docs" / "architecture.md"
NAME = re.compile(r"`([^`]+)`")


def _table_after(heading: str) -> list[list[str]]:
    """The rows (cells split) of the first table under ``heading``."""
    text = DOC.read_text()
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # past the header and its rule


def _stem(name: str) -> str:
    return name.removesuffix("/").removesuffix(".py")


def _children(folder: Path) -> set[str]:
    """A folder's modules and packages, by stem (``__init__.py`` is its own row where it has one)."""
    found = set()
    for p in folder.iterdir():
        if p.suffix == ".py" and p.name != "__init__.py":
            found.add(p.stem)
        elif p.is_dir() and (p / "__init__.py").is_file() and p.name != "tests":
            found.add(p.name)
    return found


def test_every_runtime_package_and_module_has_its_row() -> None:
    rows = _table_after("## Layers inside `runtime/`")
    named = {_stem(n) for row in rows for n in NAME.findall(row[0])} - {"__init__"}
    tree = _children(REPO / "runtime")
    assert tree - named == set(), f"docs/architecture.md's package table lacks a row for {sorted(tree - named)}"
    assert named - tree == set(), f"docs/architecture.md's package table names what is gone: {sorted(named - tree)}"


def test_every_agent_and_adapter_module_is_named_in_its_folders_row() -> None:
    rows = {row[0]: row[2] for row in _table_after("## The repository's folders")}
    for folder in ("agents", "models"):
        named = {_stem(n) for n in NAME.findall(rows[f"`{folder}/`"])}
        missing = _children(REPO / folder) - named
        assert missing == set(), f"docs/architecture.md's `{folder}/` row lacks {sorted(missing)}"
