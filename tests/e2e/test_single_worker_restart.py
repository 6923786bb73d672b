"""``start`` with one worker supervises it as it does several: a SIGKILLed single worker is restarted (the README
and docs/operations.md: each replica is its own process, restarted if it dies). Real ``start``, real server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.helpers import REPO, cli
from tests.pools import wait_until

WEATHER = str(REPO / "resources/weather/config.yaml")


def workers(url: str) -> list[dict[str, object]]:
    res = cli("status", "--nats", url, "--json", timeout=60)
    return json.loads(res.stdout)["workers"] if res.returncode == 0 else []


def test_a_single_worker_killed_is_restarted(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", WEATHER, "--nats", nats_server.url,
         "--only", "resources.weather"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        found = workers(nats_server.url)
        assert len(found) == 1, found
        pid = int(str(found[0]["process"]).rsplit("/", 1)[1])
        assert pid != proc.pid  # the worker is a child of `start`, not `start` itself
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        again: dict[str, list[dict[str, object]]] = {}

        def restarted() -> bool:
            again["w"] = w = workers(nats_server.url)
            return len(w) == 1 and w[0]["process"] != found[0]["process"]

        wait_until(restarted, timeout=90)
        assert proc.poll() is None  # `start` itself runs on
        print(f"single worker killed: restarted {time.monotonic() - killed_at:.1f}s after the kill")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
