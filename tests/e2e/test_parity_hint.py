"""``parity`` given a Harbor task directory (or a directory of them) without ``--harbor`` says to add it, in one
line, before it looks for a NeMo Gym server of that name (the real CLI; no engine is asked)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, cli

TASKS = REPO / "tests/harbor_tasks"


@pytest.mark.parametrize("path", [TASKS / "read-file", TASKS])
def test_parity_on_harbor_tasks_without_harbor_says_to_add_it(path: object) -> None:
    res = cli("parity", str(path))
    assert res.returncode == 2, res.stderr
    [line] = res.stderr.strip().splitlines()
    assert line.endswith("a Harbor task directory (task.toml): add --harbor"), line
