"""``gym-runtime init``: the scaffold runs and passes its own tests at once, in and out of the repo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import REPO, cli

VARIANTS = {"plain": [], "stateful": ["--stateful"], "judge": ["--judge"], "stateful_judge": ["--stateful", "--judge"]}


def no_pythonpath() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def scaffold_tests(package: Path) -> subprocess.CompletedProcess[str]:
    """The package's own tests, run the way its README says, from its own directory."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=package,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=no_pythonpath(),
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_scaffold_outside_the_repo_passes_its_own_tests(tmp_path: Path, variant: str) -> None:
    name = f"my_{variant}_env"
    r = cli("init", name, "--dir", str(tmp_path), *VARIANTS[variant])
    assert r.returncode == 0, r.stderr
    package = tmp_path / name
    # less the bytecode Python leaves beside a module it imported (``init`` imports the package it wrote)
    files = [p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sorted(p.relative_to(package).as_posix() for p in files) == [
        "README.md",
        "__init__.py",
        "config.yaml",
        "data/example.jsonl",
        f"tests/test_{name}.py",
    ]
    t = scaffold_tests(package)
    assert t.returncode == 0, t.stdout + t.stderr
    assert "5 passed" in t.stdout  # the tool, verify, a rollout in process, the rows, a whole run
    assert "skipped" not in t.stdout


def test_scaffold_runs_from_any_directory_without_pythonpath(tmp_path: Path) -> None:
    assert cli("init", "far_env", "--dir", str(tmp_path / "deep" / "er")).returncode == 0
    package = tmp_path / "deep" / "er" / "far_env"
    out = tmp_path / "out.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "run",
            str(package / "config.yaml"),
            "-i",
            str(package / "data" / "example.jsonl"),
            "-o",
            str(out),
            "--no-progress",
        ],
        cwd="/",
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=no_pythonpath(),
    )
    assert r.returncode == 0, r.stderr
    assert len(out.read_text().splitlines()) == 5


def test_scaffold_inside_the_repo_passes_its_own_tests() -> None:
    """Inside the repository the repo's pytest settings apply (import mode, asyncio): still green."""
    holder = REPO / f".scaffold-test-{uuid.uuid4().hex[:8]}"
    try:
        r = cli("init", "in_repo_env", "--dir", str(holder), "--stateful")
        assert r.returncode == 0, r.stderr
        t = scaffold_tests(holder / "in_repo_env")
        assert t.returncode == 0, t.stdout + t.stderr
        assert "5 passed" in t.stdout  # the tool, verify, a rollout in process, the rows, a whole run
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def test_bad_names_and_existing_directories_are_one_line_errors(tmp_path: Path) -> None:
    for name, text in (
        ("My-Env", "lowercase Python identifier"),
        ("class", "lowercase Python identifier"),
        ("json", "an importable module already has this name"),
    ):
        r = cli("init", name, "--dir", str(tmp_path))
        assert r.returncode == 2 and text in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "taken").mkdir()
    r = cli("init", "taken", "--dir", str(tmp_path))
    assert r.returncode == 2 and "already exists" in r.stderr
