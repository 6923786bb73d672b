"""`publish` against live workers: one started with another config is named before anything is published.

A user starts workers with ``--set models.policy.delay_s=0.05`` and publishes without it: every task would
become a ``config_mismatch`` failure row. ``publish`` asks the live workers what they serve (discovery),
compares each config key's digest with its own and refuses with one line naming the keys, exit 2. With no
worker yet it publishes and says so once.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, WEATHER, cli

ROWS = WEATHER.parent / "data/example.jsonl"


@pytest.fixture
def workers(nats_server) -> Iterator[subprocess.Popen[str]]:
    """The weather config's workers, started with one `--set` the publisher will not give."""
    p = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(WEATHER), "--nats", nats_server.url,
         "--set", "models.policy.delay_s=0.05", "--in-process"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        assert "ready" in p.stdout.readline(), "the workers did not start"
        yield p
    finally:
        p.terminate()
        p.wait(30)


def test_a_publish_with_another_config_than_the_workers_is_refused_naming_the_key(nats_server, workers) -> None:
    res = cli("publish", str(WEATHER), "-i", str(ROWS), "--nats", nats_server.url, "--batch", "refused-b")
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "models.policy.delay_s" in lines[0] and "Nothing was published" in lines[0], lines[0]
    assert "Traceback" not in res.stderr
    status = cli("status", "--nats", nats_server.url)
    assert "refused-b" not in status.stdout  # no manifest was recorded either

    same = cli("publish", str(WEATHER), "-i", str(ROWS), "--nats", nats_server.url, "--batch", "b2",
               "--set", "models.policy.delay_s=0.05")  # fmt: skip
    assert same.returncode == 0, same.stderr
    done = cli(
        "collect", "--batch", "b2", "--nats", nats_server.url, "-o", str(Path(nats_server.store_dir) / "o.jsonl")
    )
    assert done.returncode == 0, done.stderr
    assert "5 rows, 0 failed" in done.stdout, done.stdout


def test_a_publish_with_no_worker_yet_says_so_once(nats_server) -> None:
    res = cli("publish", str(WEATHER), "-i", str(ROWS), "--nats", nats_server.url, "--batch", "b1")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("no live worker serves") == 1, res.stderr
