"""Test tasks for NeMo Gym's container servers (swebench, terminal_bench_2_1) hosted on the fleet: rows in the
servers' own formats and their images, built here from the fleet's Debian base and tagged with the names the
rows carry (nothing can be pulled on these machines).

- **SWE-bench**: a tiny repository with a bug at ``/testbed`` (a real git history), posing as an instance of
  ``pytest-dev/pytest`` so that SWE-bench's own eval script and log parser grade it (``pytest -rA``). The image
  adds what SWE-bench's images have and the base lacks: ``git``, ``pytest`` (Debian's, installed while building
  with the host's network; sandboxes never get one) and ``/opt/miniconda3/bin/activate`` (a stand-in whose
  ``conda`` does nothing: the eval script activates the ``testbed`` environment, which here is the system's).
  Its name is SWE-bench's for the row's ``instance_id``: ``swebench/sweb.eval.x86_64.<id, __ -> _1776_>:latest``.
- **Terminal-Bench 2.1**: an image whose ``WORKDIR /app`` holds numbers to add, and a task folder whose
  ``tests/test.sh`` writes ``/logs/verifier/reward.txt`` (1 iff ``/app/answer.txt`` holds their sum), as the
  benchmark's tasks do. Its name is the row's ``docker_image``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from gym_runtime.sandboxes.engine_http import Engine

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TESTS = "from calc import mul\n\n\ndef test_mul():\n    assert mul(3, 4) == 12\n"
TESTS_AFTER = TESTS.replace("import mul", "import add, mul") + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"
# conftest.py at the root: pytest puts the repository on sys.path (as pytest's own repository has it)
SWE_FILES = {"conftest.py": "", "calc.py": CALC, "testing/test_calc.py": TESTS}
SWE_FIX = "sed -i 's/return a - b/return a + b/' calc.py"
_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "PATH": "/usr/bin:/bin",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",  # a fixed history: the same base commit every build
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}
_WHO = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]

TB_NUMBERS = "3\n4\n5\n"
TB_SOLVE = "awk '{s += $1} END {print s}' /app/numbers.txt > /app/answer.txt"
TB_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/answer.txt 2>/dev/null)" = "12" ]; then reward=1; else reward=0; fi
echo "$reward" > /logs/verifier/reward.txt
"""


def _git(repo: Path, *args: str) -> str:
    env = {**_GIT_ENV, "HOME": str(repo.parent)}
    out = subprocess.run(["git", *_WHO, *args], cwd=repo, env=env, check=True, capture_output=True, text=True)
    return out.stdout


def swe_repo(into: Path) -> str:
    """The repository at its base commit (in ``into``); returns the commit's hash."""
    into.mkdir(parents=True)
    for rel, text in SWE_FILES.items():
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        (into / rel).write_text(text)
    _git(into, "init", "-q")
    _git(into, "add", "-A")
    _git(into, "commit", "-q", "-m", "base")
    return _git(into, "rev-parse", "HEAD").strip()


def _diff(files: dict[str, str], changed: dict[str, str]) -> str:
    with tempfile.TemporaryDirectory() as d:
        repo = Path(d) / "r"
        swe_repo(repo)
        for rel, text in changed.items():
            (repo / rel).write_text(text)
        return _git(repo, "diff")


def _tar(files: dict[str, bytes], dirs: dict[str, Path] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755 if name.endswith(".sh") else 0o644
            tar.addfile(info, io.BytesIO(data))
        for name, path in (dirs or {}).items():
            tar.add(str(path), arcname=name)
    return buf.getvalue()


def swe_image_name(instance_id: str) -> str:
    """SWE-bench's image name for an instance (``TestSpec.instance_image_key``, namespace ``swebench``)."""
    return f"swebench/sweb.eval.x86_64.{instance_id.lower()}:latest".replace("__", "_1776_")


async def build_swe_image(engine: Engine, base: str, instance_ids: list[str]) -> str:
    """The SWE-bench test image, tagged with each row's name (the build cache makes later builds instant)."""
    dockerfile = (
        f"FROM {base}\n"
        "RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends git python3-pytest patch"
        " && rm -rf /var/lib/apt/lists/* && (command -v pytest || ln -s /usr/bin/pytest-3 /usr/local/bin/pytest)\n"
        "RUN mkdir -p /opt/miniconda3/bin && printf 'conda() { :; }\\n' > /opt/miniconda3/bin/activate\n"
        "COPY testbed /testbed\n"
        "WORKDIR /testbed\n"
    )
    with tempfile.TemporaryDirectory() as d:
        commit = swe_repo(Path(d) / "testbed")
        context = _tar({"Dockerfile": dockerfile.encode()}, {"testbed": Path(d) / "testbed"})
    for instance_id in instance_ids:
        await engine.build(context, swe_image_name(instance_id), network="host", timeout_s=900)
    return commit


def swe_row(instance_id: str, base_commit: str) -> dict[str, Any]:
    """A row in the swebench server's format (SWE-bench Verified's fields; ``FAIL_TO_PASS`` as JSON text)."""
    return {
        "responses_create_params": {"input": [{"role": "user", "content": "calc.add(2, 3) returns -1, not 5."}]},
        "repo": "pytest-dev/pytest",
        "instance_id": instance_id,
        "base_commit": base_commit,
        "patch": _diff(SWE_FILES, {"calc.py": CALC.replace("a - b", "a + b")}),
        "test_patch": _diff(SWE_FILES, {"testing/test_calc.py": TESTS_AFTER}),
        "problem_statement": "calc.add(2, 3) returns -1 instead of 5.",
        "hints_text": "",
        "created_at": "2026-01-01T00:00:00Z",
        "version": "7.0",
        "FAIL_TO_PASS": json.dumps(["testing/test_calc.py::test_add"]),
        "PASS_TO_PASS": json.dumps(["testing/test_calc.py::test_mul"]),
        "environment_setup_commit": base_commit,
        "difficulty": "<15 min fix",
        "subset": "verified",
        "split": "test",
    }


async def build_tb_image(engine: Engine, base: str, names: list[str]) -> None:
    dockerfile = f"FROM {base}\nWORKDIR /app\nCOPY numbers.txt /app/numbers.txt\n"
    context = _tar({"Dockerfile": dockerfile.encode(), "numbers.txt": TB_NUMBERS.encode()})
    for name in names:
        await engine.build(context, name)


def tb_task_folder(into: Path) -> Path:
    """A task folder as the benchmark's: ``tests/test.sh`` (uploaded to ``/tests`` at verify)."""
    (into / "tests").mkdir(parents=True)
    (into / "tests" / "test.sh").write_text(TB_TEST)
    os.chmod(into / "tests" / "test.sh", 0o755)
    return into


def tb_row(task_name: str, image: str, folder: Path) -> dict[str, Any]:
    """A row in the terminal_bench_2_1 server's format."""
    prompt = "Write the sum of the numbers in /app/numbers.txt to /app/answer.txt."
    return {
        "responses_create_params": {"input": [{"role": "user", "content": prompt}]},
        "task_name": task_name,
        "docker_image": image,
        "task_folder": str(folder),
    }
