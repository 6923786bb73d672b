"""The Python diff/apply the fleet uses in images without git, checked against real git; the unittest log parser."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gym_runtime.resources.swe.grading import parse_unittest
from gym_runtime.resources.swe.patch_tool import apply_patch, diff_trees, unpack

BASE = {
    "calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
    "old.txt": "x\n",
    "eol": "a\nb",
}
AFTER = {"calc.py": BASE["calc.py"].replace("a - b", "a + b"), "pkg/new.py": "NEW = 1\n", "eol": "a\nc"}


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def read(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.parts
    }


def test_a_diff_of_two_trees_applies_back_with_git_and_with_itself(tmp_path: Path) -> None:
    base, after = tree(tmp_path / "base", BASE), tree(tmp_path / "after", AFTER)
    patch = diff_trees(str(base), str(after))
    assert "new file mode" in patch and "deleted file mode" in patch and "\\ No newline at end of file" in patch
    mine = tree(tmp_path / "mine", BASE)
    assert apply_patch(patch, str(mine)) == ["calc.py", "eol", "old.txt", "pkg/new.py"]
    assert read(mine) == AFTER
    gits = tree(tmp_path / "git", BASE)
    subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=gits, check=True)  # git reads it as its own
    assert read(gits) == AFTER


def test_gits_own_diff_applies_at_an_offset(tmp_path: Path) -> None:
    repo = tree(tmp_path / "repo", BASE)
    env = {"HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run(
        "git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm b",
        shell=True,
        cwd=repo,
        env=env,
        check=True,
    )
    tree(repo, {"calc.py": AFTER["calc.py"]})
    patch = subprocess.run(["git", "diff"], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout
    moved = tree(tmp_path / "moved", {"calc.py": "# a header line\n\n" + BASE["calc.py"]})
    apply_patch(patch, str(moved))
    assert (moved / "calc.py").read_text() == "# a header line\n\n" + AFTER["calc.py"]


def test_a_patch_applies_wholly_or_not_at_all(tmp_path: Path) -> None:
    patch = diff_trees(str(tree(tmp_path / "b", BASE)), str(tree(tmp_path / "a", AFTER)))
    stale = tree(tmp_path / "stale", {**BASE, "eol": "a\nzzz"})  # one file's context differs
    with pytest.raises(ValueError, match="eol: hunk 1 does not apply"):
        apply_patch(patch, str(stale))
    assert read(stale) == {**BASE, "eol": "a\nzzz"}  # calc.py untouched although its hunk would fit


def test_unittest_verbose_lines_give_each_tests_status() -> None:
    out = (
        "test_add (test_calc.TestCalc.test_add) ... FAIL\n"
        "test_mul (test_calc.TestCalc) ... ok\n"  # Python < 3.11 names the class only
        "test_doc (m.T.test_doc)\nIts docstring ... ok\n"
        "test_skip (m.T.test_skip) ... skipped 'no'\n"
        "test_err (m.T.test_err) ... ERROR\n"
        "ERROR: test_err (m.T.test_err)\n"
    )
    assert parse_unittest(out) == {
        "test_calc.TestCalc.test_add": "FAILED",
        "test_calc.TestCalc.test_mul": "PASSED",
        "m.T.test_doc": "PASSED",
        "m.T.test_skip": "SKIPPED",
        "m.T.test_err": "ERROR",
    }


def test_a_rows_files_are_written_under_each_root_and_never_outside(tmp_path: Path) -> None:
    (tmp_path / "files.json").write_text(json.dumps({"pkg/a.py": "A = 1\n"}))
    unpack(str(tmp_path / "files.json"), str(tmp_path / "repo"), str(tmp_path / "base"))
    assert (tmp_path / "repo/pkg/a.py").read_text() == (tmp_path / "base/pkg/a.py").read_text() == "A = 1\n"
    (tmp_path / "bad.json").write_text(json.dumps({"../escape.py": "x"}))
    with pytest.raises(ValueError, match="leaves the repository"):
        unpack(str(tmp_path / "bad.json"), str(tmp_path / "repo"))
    assert not (tmp_path / "escape.py").exists()
