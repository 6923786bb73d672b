"""A run without a container engine says, once and last, how many engine tests it skipped and how to run them
(issue 57: the README's test line gave "80 skipped" on a fresh clone, 46 of them the Docker tests, and nothing
said that an engine was missing or how to start one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers import REPO


def test_a_run_without_an_engine_says_how_many_engine_tests_skipped_and_how_to_start_one() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_HOST", "GYM_REQUIRE_DOCKER")}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_sandbox_engine.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = r.stdout.strip().splitlines()
    skipped = re.fullmatch(r"(\d+) skipped in .*", lines[-1])
    assert r.returncode == 0 and skipped, r.stdout + r.stderr
    assert lines[-2] == (
        f'{skipped.group(1)} tests skipped: no Docker engine: start one with `eval "$(bash .ci/docker.sh start)"`'
        " (as root), then run the tests again"
    )
