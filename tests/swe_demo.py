"""A real SWE task for the fleet: a tiny repository with a bug and a failing test, in an image built here.

The image ``gym-runtime/swe-demo:<hash>`` is the fleet's Debian base (``gym_runtime.sandboxes.images``)
with the repository copied to ``/testbed`` (where SWE-Gym's and SWE-bench's images keep theirs), built
through the Engine API with no network (nothing is fetched) and only when the engine lacks it. The
base has Python and no pytest, so the tests are ``unittest``'s. The row is in SWE-bench's shape: its
``test_patch`` adds the failing test, ``patch`` is the gold fix, both written by real ``git``. Also the
config that runs it on a pool (``fleet_config``) and the scripted policy, a test double for the LLM.
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

from gym_runtime.agents.swe import SYSTEM
from gym_runtime.config import Config, config_from_dict
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


def scripted_policy(row: dict[str, Any], commands: list[str]) -> dict[str, Any]:
    """A TEST DOUBLE for the LLM: a recorded rollout (NeMo Gym's format) whose ``bash`` calls the ``replay``
    adapter plays back; their outputs are computed live in the sandbox."""
    output: list[dict[str, Any]] = []
    for i, command in enumerate(commands):
        output.append(
            {
                "type": "function_call",
                "call_id": f"c{i}",
                "name": "bash",
                "arguments": json.dumps({"command": command}),
                "id": f"fc{i}",
                "status": "completed",
            }
        )
        output.append({"type": "function_call_output", "call_id": f"c{i}", "output": "recorded"})
    issue = f"Resolve this issue in the repository:\n\n<issue>\n{row['problem_statement']}\n</issue>"
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": issue}]
    return {"responses_create_params": {"input": prompt}, "response": {"id": "r", "output": output}}


def fleet_config(
    tmp_path: Path, socket: str, pool: str, recordings: Path, images: list[str], backend: str = "docker"
) -> Config:
    """Our swe environment and agent on pool ``pool``; the policy replays ``recordings``."""
    engine = {"engine": f"unix://{socket}"} if socket else {}
    return config_from_dict(
        {
            "namespace": "gym",
            "models": {"policy": {"adapter": "replay", "rollouts": str(recordings)}},
            "sandboxes": {
                pool: {
                    "backend": backend,
                    **engine,
                    "images": images,
                    "limits": {"memory_mb": 256, "pids": 64, "disk_mb": 32, "timeout_s": 120},
                }
            },
            "resources": {
                "swe": {
                    "server": "resources.swe",
                    "sandbox": pool,  # the fleet: the environment's commands run in this pool's sandboxes
                    "options": {
                        "test_command": "python3 -m unittest -v {tests}",
                        "log_parser": "unittest",
                        "command_timeout_s": 60,
                        "eval_timeout_s": 120,
                    },
                }
            },
            "agents": {
                "swe_agent": {
                    "agent": "agents.swe",
                    "model": "policy",
                    "resource": "swe",
                    "max_steps": 10,
                    "timeout_s": 300,
                    "max_attempts": 1,
                }
            },
            "base_dir": str(tmp_path),
        }
    )
