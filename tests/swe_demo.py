"""A real SWE task for the fleet: a tiny repository with a bug and a failing test, in an image built here.

The image ``gym-runtime/swe-demo:<hash>`` is the fleet's Debian base (``gym_runtime.sandboxes.images``)
with the repository copied to ``/testbed`` (where SWE-Gym's and SWE-bench's images keep theirs), built
through the Engine API with no network (nothing is fetched) and only when the engine lacks it. The
base has Python and no pytest, so the tests are ``unittest``'s. The row is in SWE-bench's shape: its
``test_patch`` adds the failing test, ``patch`` is the gold fix, both written by real ``git``.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.sandboxes.engine_http import Engine

CALC = '''def add(a, b):
    """Sum of a and b."""
    return a - b


def mul(a, b):
    return a * b
'''
TESTS = """import unittest

from calc import mul


class TestCalc(unittest.TestCase):
    def test_mul(self):
        self.assertEqual(mul(3, 4), 12)
"""
TESTS_AFTER = (
    TESTS.replace("from calc import mul", "from calc import add, mul")
    + """
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
"""
)
FILES = {"calc.py": CALC, "test_calc.py": TESTS}
REPO = "gym-runtime/swe-demo"


def git_diff(files: dict[str, str], changed: dict[str, str]) -> str:
    """``changed`` against ``files`` as real ``git diff`` writes it (SWE-bench's patches are git's)."""
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for rel, text in files.items():
            (root / rel).write_text(text)
        env = {"HOME": d, "GIT_CONFIG_NOSYSTEM": "1", "PATH": "/usr/bin:/bin"}
        who = ["-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(["git", "init", "-q"], cwd=root, env=env, check=True)
        subprocess.run(["git", "add", "-A"], cwd=root, env=env, check=True)
        subprocess.run(["git", *who, "commit", "-q", "-m", "base"], cwd=root, env=env, check=True)
        for rel, text in changed.items():
            (root / rel).write_text(text)
        return subprocess.run(["git", "diff"], cwd=root, env=env, check=True, capture_output=True, text=True).stdout


def context(base: str) -> bytes:
    """The build context: a Dockerfile copying the repository onto the base."""
    dockerfile = f"FROM {base}\nCOPY testbed /testbed\nWORKDIR /testbed\n"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in {"Dockerfile": dockerfile, **{f"testbed/{k}": v for k, v in FILES.items()}}.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def image_ref(base: str) -> str:
    return f"{REPO}:{hashlib.sha256(json.dumps([base, FILES]).encode()).hexdigest()[:16]}"


@pytest.fixture
async def swe_demo_image(engine: Engine, base_image: str) -> str:
    """The demo task's image, built once per engine (its tag is the hash of the base and the files)."""
    ref = image_ref(base_image)
    if not await engine.image_exists(ref):
        await engine.build(context(base_image), ref)
    return ref


def swe_row(image: str, **extra: Any) -> dict[str, Any]:
    """The task as a SWE-bench row (plus ``image_name``: the image the fleet runs it in)."""
    return {
        "instance_id": "gymdemo__calc-1",
        "repo": "gymdemo/calc",
        "base_commit": "0" * 40,
        "image_name": image,
        "problem_statement": "calc.add(2, 3) returns -1 instead of 5.",
        "test_patch": git_diff(FILES, {"test_calc.py": TESTS_AFTER}),
        "patch": git_diff(FILES, {"calc.py": CALC.replace("return a - b", "return a + b")}),
        "FAIL_TO_PASS": ["test_calc.TestCalc.test_add"],
        "PASS_TO_PASS": ["test_calc.TestCalc.test_mul"],
        "responses_create_params": {"input": []},
        **extra,
    }
