"""The attack of issue 65 in a real browser: a page of another origin, open in the operator's Chromium, fetches
the gateway (Debian's chromium and chromium-driver through Selenium, as ``tests/test_view_browser.py``).

Before: its ``mode: "no-cors"`` POSTs (``text/plain``, no preflight) ran a rollout on the policy's tokens and
paused the policy until someone posted ``/resume``; a page under a name rebound to 127.0.0.1 read the config
listing. Now every one is refused, and the gateway still serves its trainer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gym_runtime import Client
from gym_runtime.gateway import Access, start
from gym_runtime.ops.nats_server import free_port
from tests.helpers import ROWS, weather

pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra")
from tests.test_view_browser import BROWSER, DRIVER, WAIT_S, browser  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (Path(DRIVER).exists() and Path(BROWSER).exists()),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)

TOKEN = "test-control-token-0123456789"
EVIL = "evil.example"  # resolved to 127.0.0.1 by the browser, as a rebinding attacker's DNS would

PAGE = """<!doctype html><title>loading</title><script>
(async () => {
  const gw = "GATEWAY", row = ROW, out = [];
  const attempts = [
    ["/run", {method: "POST", mode: "no-cors", body: JSON.stringify(row)}],
    ["/run", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: JSON.stringify(row)}],
    ["/pause", {method: "POST", mode: "no-cors", body: '{"mode":"drain"}'}],
    ["/pause", {method: "POST", mode: "no-cors", body: '{"mode":"abort"}'}],
    // a JSON POST needs a preflight, which the gateway refuses: fetch fails
    ["/pause", {method: "POST", headers: {"Content-Type": "application/json"}, body: '{"mode":"drain"}'}],
    ["/global_config_dict_yaml", {}],
  ];
  for (const [path, init] of attempts) {
    try {
      const r = await fetch(gw + path, init);
      out.push(r.type === "opaque" ? "opaque" : r.status + ":" + (await r.text()).slice(0, 40));
    } catch (e) {
      out.push("failed");
    }
  }
  document.title = "done " + JSON.stringify(out);
})();
</script>"""


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    d = browser(f"--host-resolver-rules=MAP {EVIL} 127.0.0.1")
    try:
        yield d
    finally:
        d.quit()


async def evil_site(page: str) -> AsyncIterator[str]:
    """The attacker's page, on an origin of its own (another port: another origin)."""

    async def serve(_: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", serve)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


def visit(driver: Any, url: str) -> str:
    from selenium.webdriver.support.wait import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, WAIT_S).until(lambda d: d.title.startswith("done"))
    return str(driver.title)


async def test_a_cross_origin_page_can_neither_run_nor_pause_the_policy(nats_server, driver: Any) -> None:
    async with Client(weather(), nats=nats_server.url) as client:
        served, port = await start(client, host="127.0.0.1", port=0, access=Access(token=TOKEN))
        (model,) = [w for w in client.workers if hasattr(w, "gate")]
        try:
            page = PAGE.replace("GATEWAY", f"http://127.0.0.1:{port}").replace("ROW", json.dumps(ROWS[0]))
            async for url in evil_site(page):
                title = await asyncio.to_thread(visit, driver, url)
            # the no-cors answers are opaque to the page either way: what matters is what the gateway did
            assert json.loads(title.removeprefix("done "))[4] == "failed", title  # the preflight refused
            assert model.gate.is_open, "a web page paused the policy"
            assert model.served == 0, "a web page ran a rollout on the policy"
        finally:
            await served.cleanup()


REBOUND = """
const done = arguments[arguments.length - 1], row = arguments[0], out = [];
(async () => {
  const json = {"Content-Type": "application/json"};
  for (const [path, init] of [
    ["/global_config_dict_yaml", {}],
    ["/run", {method: "POST", headers: json, body: JSON.stringify(row)}],
    ["/pause", {method: "POST", headers: json, body: '{"mode":"drain"}'}],
  ]) {
    const r = await fetch(path, init);
    out.push([r.status, (await r.text()).slice(0, 200)]);
  }
  done(out);
})().catch((e) => done(String(e)));
"""


async def test_a_rebound_name_reads_nothing(nats_server, driver: Any) -> None:
    """After a rebinding, the attacker's name resolves to 127.0.0.1: its page is same-origin with the gateway as
    far as the browser knows, so it may send JSON and read every answer. The gateway refuses the name (421)."""
    async with Client(weather(), nats=nats_server.url) as client:
        served, port = await start(client, host="127.0.0.1", port=0, access=Access(token=TOKEN))
        (model,) = [w for w in client.workers if hasattr(w, "gate")]
        try:

            def attack() -> Any:
                driver.get(f"http://{EVIL}:{port}/")  # the page, under the attacker's origin
                return driver.execute_async_script(REBOUND, ROWS[0])

            answers = await asyncio.to_thread(attack)
            assert [status for status, _ in answers] == [421, 421, 421], answers
            assert all("is not a name this gateway serves" in text for _, text in answers)
            assert model.gate.is_open and model.served == 0

            def trainer() -> str:  # the trainer's own address is served, in the same browser
                driver.get(f"http://127.0.0.1:{port}/global_config_dict_yaml")
                return str(driver.find_element("tag name", "body").text)

            assert "weather_agent" in await asyncio.to_thread(trainer)
        finally:
            await served.cleanup()
