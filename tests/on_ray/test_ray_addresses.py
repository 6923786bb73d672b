"""Issue 75 points 1 and 2: ``start --ray`` against a Ray head it cannot use, as a user starts it (the CLI in a
subprocess, a live bus). A dead address hung (``127.0.0.1:1``: still waiting after 600 s), a closed Ray Client port was
a 40-line traceback after 31 s, and a head with token authentication (Ray 2.60's, on wherever a token exists) was 20 s
of Ray's ``InvalidAuthToken`` lines then "internal error (a bug in gym-runtime)": now each is one line naming the
address, what was tried and the fix, exit 2, within 30 s; and a head whose token this node holds is used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_runtime.ops.nats_server import EmbeddedServer, free_port
from tests.helpers import REPO, cli, read_until
from tests.on_ray.cluster import need_ray

need_ray()

TOKEN = "t75" * 11  # a 33-character token (Ray's own are 32 hex digits; any string serves)

HEAD = """
import os, signal, sys, time
from ray.cluster_utils import Cluster
c = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, "num_cpus": 2})
signal.signal(signal.SIGTERM, lambda *a: (c.shutdown(), sys.exit(0)))
print("ADDRESS", c.address, flush=True)
while True:
    time.sleep(1)
"""


def one_line(res: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if line.startswith("gym-runtime: ")]
    assert len(said) == 1, res.stderr[-3000:]
    assert "InvalidAuthToken" not in res.stderr.replace(said[0], ""), res.stderr[-3000:]  # no page of Ray's lines
    for f in fragments:
        assert f in said[0], (f, said[0])
    return said[0]


def start(address: str, url: str, home: Path, *, timeout: float = 90) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {"HOME": str(home)}  # (this node's token, if any, is where Ray looks: ~/.ray/auth_token)
    t0 = time.monotonic()
    res = cli("start", "weather", "--ray", address, "--nats", url, env=env, timeout=timeout)
    return res, time.monotonic() - t0


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:{closed}", "ray://127.0.0.1:{nats}"])
def test_a_wrong_ray_address_is_one_line_naming_it_within_30_s(
    address: str, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    given = address.format(closed=free_port(), nats=nats_server.url.rsplit(":", 1)[1])  # (NATS: not Ray Client)
    res, took = start(given, nats_server.url, tmp_path)
    words = "no Ray head answers there" if "ray://" not in given else "no Ray Client server answers"
    one_line(res, f"--ray {given}: ", words, "`ray start --head")
    assert took < 30, took


@pytest.fixture(scope="module")
def token_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray head with token authentication, as `ray start` makes one where ~/.ray/auth_token exists."""
    home = tmp_path_factory.mktemp("head_home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(TOKEN)
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token"}
    env.pop("RAY_AUTH_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", HEAD], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        seen, out = read_until(proc.stdout, "ADDRESS", 240)
        assert seen, out
        yield out.split("ADDRESS", 1)[1].split()[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def test_a_head_that_wants_a_token_this_node_lacks_is_one_line_naming_ray_auth_mode(
    token_head: str, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    res, took = start(token_head, nats_server.url, tmp_path)  # a HOME with no token
    one_line(res, f"--ray {token_head}: this Ray cluster requires token authentication", "RAY_AUTH_MODE=token")
    assert took < 30, took
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("another clusters token")
    res, _ = start(token_head, nats_server.url, tmp_path)
    one_line(res, "this Ray cluster refuses this node's token", "`ray get-auth-token` on the head")


def test_a_head_whose_token_this_node_holds_is_used(
    token_head: str, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(TOKEN)  # the same user's token, as on the head's own node
    env = {**os.environ, "HOME": str(tmp_path)}
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    args = ["start", "weather", "--ray", token_head, "--nats", nats_server.url, "--only", "resources"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        seen, out = read_until(proc.stdout, "workers ready on Ray", 240)
        assert seen, out + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert proc.stderr is not None
    assert "InvalidAuthToken" not in proc.stderr.read()
