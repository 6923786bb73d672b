"""A tiny SWE task made on the spot: a bug, a failing test, a gold patch (diffs written by real git)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from gym_runtime.agents.swe import SUBMIT
from tests.swe_demo import scripted_policy

CALC = '''def add(a, b):
    """Sum of a and b."""
    return a - b


def mul(a, b):
    return a * b
'''
TESTS = """from calc import mul


def test_mul():
    assert mul(3, 4) == 12
"""
TESTS_AFTER = """from calc import add, mul


def test_mul():
    assert mul(3, 4) == 12


def test_add():
    assert add(2, 3) == 5
"""


def _diff(files: dict[str, str], changed: dict[str, str]) -> str:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        env = {
            "GIT_CONFIG_NOSYSTEM": "1",
            "HOME": d,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
            "PATH": "/usr/bin:/bin",
        }
        subprocess.run("git init -q && git add -A && git commit -q -m base", shell=True, cwd=root, env=env, check=True)
        for rel, text in changed.items():
            (root / rel).write_text(text)
        return subprocess.run(["git", "diff"], cwd=root, env=env, check=True, capture_output=True, text=True).stdout


def task(**extra: Any) -> dict[str, Any]:
    files = {"calc.py": CALC, "test_calc.py": TESTS}
    fixed = CALC.replace("return a - b", "return a + b")
    return {
        "instance_id": "tiny__calc-1",
        "repo": "tiny/calc",
        "problem_statement": "add(2, 3) returns -1 instead of 5.",
        "repo_files": files,
        "test_patch": _diff(files, {"test_calc.py": TESTS_AFTER}),
        "patch": _diff(files, {"calc.py": fixed}),
        "breaking_patch": _diff(files, {"calc.py": fixed.replace("return a * b", "return a ** b")}),
        "FAIL_TO_PASS": ["test_calc.py::test_add"],
        "PASS_TO_PASS": ["test_calc.py::test_mul"],
        "responses_create_params": {
            "input": [
                {"role": "system", "content": "You fix bugs with bash commands."},
                {"role": "user", "content": "add(2, 3) returns -1 instead of 5. Fix calc.py."},
            ]
        },
        **extra,
    }


def recording(row: dict[str, Any], commands: list[str]) -> dict[str, Any]:
    """A rollout row as NeMo Gym records one: the model's bash calls (outputs are recomputed live)."""
    return {**scripted_policy(row, commands), "reward": None}


def rows_and_recordings(tmp_path: Path, copies: int = 1) -> tuple[Path, Path]:
    """Rows (a fixing and a looping variant of the task, ``copies`` of each) and a replay recording of both."""
    fix = {**task(), "problem_statement": "add is wrong (fix)", "responses_create_params": {"input": []}}
    loop = {**task(), "problem_statement": "add is wrong (loop)", "responses_create_params": {"input": []}}
    for r in (fix, loop):
        r.pop("breaking_patch")
    rows = [fix, loop] * copies
    recs = [
        recording(fix, ["sed -i 's/a - b/a + b/' calc.py", "python -m pytest -q test_calc.py", SUBMIT]),
        recording(loop, ["while true; do :; done", SUBMIT]),
    ]
    return _jsonl(tmp_path / "rows.jsonl", rows), _jsonl(tmp_path / "rec.jsonl", recs)


def _jsonl(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path
