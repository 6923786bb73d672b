"""Issue 77 item 2: ``view``'s live mode shows where every in-flight rollout of the followed batch waits, the
oldest first, a wait past its bound flagged with the component to look at: a real run (``start`` processes, a
real nats-server, the scripted policy slow enough that its calls are in flight), its model worker frozen with
SIGSTOP. Without ``--batch`` the page says how to get it."""

from __future__ import annotations

import html
import re
import signal
import time
from pathlib import Path

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.e2e.test_why import tag
from tests.helpers import cli
from tests.pools import Pool, tasks_file, write_config
from tests.test_view import Served, serve
from tests.view_rows import sample_run

DETECT_S = 30.0  # the bound: a frozen component named within 30 s


def page_until(site: Served, holds: str, within: float) -> str:
    """The /waits page, read until ``holds`` (a regex) is on it; the last page in the failure's message."""
    deadline, text = time.monotonic() + within, ""
    while time.monotonic() < deadline:
        status, _, body = site.get("/waits")
        assert status == 200, body[:500]
        text = html.unescape(body.decode())
        if re.search(holds, text):
            return text
        time.sleep(0.3)
    raise AssertionError(f"{holds!r} not on /waits within {within:g}s:\n{text}")


def test_live_mode_shows_each_rollouts_wait_and_names_a_frozen_model_worker(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    config = write_config(tmp_path, delay_s=25.0)  # a generation takes 25 s: the freeze lands mid-call
    pool = Pool(config, nats_server.url)
    model = pool.start("models.policy", "models.policy")
    pool.start("resources.env", "resources.env")
    pool.start("agents.agent", "agents.agent")
    frozen = False
    try:
        published = cli(
            "publish", str(config), "-i", str(tasks_file(tmp_path, 2)), "--nats", nats_server.url, "--batch", "w1"
        )
        assert published.returncode == 0, published.stderr
        for site in serve("--batch", "w1", "--nats", nats_server.url):
            status, _, body = site.get("/")
            assert status == 200 and b'id="nav-waits"' in body
            before = page_until(
                site, rf"generating on model policy on model policy worker \S+ \({tag(model.pid)}\)", 60
            )
            assert "LATE" not in before and "Look at" not in before  # a slow replica that beats is not flagged
            assert "batch w1:" in before and 'http-equiv="refresh"' in before
            model.send_signal(signal.SIGSTOP)
            frozen, t0 = True, time.monotonic()
            after = page_until(site, rf"Look at: [^<]*models\.policy process {re.escape(tag(model.pid))}", DETECT_S)
            took = time.monotonic() - t0
            assert "LATE" in after
            print(f"view named the frozen model worker after {took:.1f}s")
    finally:
        if frozen:
            model.send_signal(signal.SIGCONT)
        pool.stop_all()


def test_without_a_followed_batch_the_waits_page_says_how_to_get_one(tmp_path: Path) -> None:
    for site in serve(str(sample_run(tmp_path / "out.jsonl"))):
        status, _, body = site.get("/waits")
        assert status == 404 and b"view --batch B --nats URL" in body
        assert b'id="nav-waits"' not in site.get("/")[2]
