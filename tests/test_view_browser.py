"""``gym-runtime view``'s pages in a real browser: Debian's chromium driven by Selenium through its matching
chromium-driver (``.ci/run`` installs both; as root, chromium needs ``--no-sandbox``). Each page opened, a
filter applied, a trajectory opened and left; the hostile row stays inert; screenshots go to a temporary
folder (``docs/view.md`` says how to make the docs' own)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.helpers import cli
from tests.pools import Pool, tasks_file, write_config
from tests.test_view import Served, serve
from tests.view_rows import BIG, HOSTILE, hostile_row, row, sample_run, write

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra")
from selenium.common.exceptions import NoAlertPresentException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402
from selenium.webdriver.support.wait import WebDriverWait  # noqa: E402

DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
BROWSER = shutil.which("chromium") or "/usr/bin/chromium"
WAIT_S = 60

pytestmark = pytest.mark.skipif(
    not (Path(DRIVER).exists() and Path(BROWSER).exists()),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)


def browser(*extra: str) -> webdriver.Chrome:
    """Headless chromium; ``extra``: more command-line switches (e.g. ``--host-resolver-rules=...``)."""
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = BROWSER
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        *extra,
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(WAIT_S * 2)
    driver.set_script_timeout(WAIT_S)
    return driver


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    d = browser()
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("view")
    a = sample_run(root / "a.jsonl")
    # b: the same tasks, a new grader on every row; task 0's rollouts flipped from 0 to 1, task 1's 1 to 0
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    for r in rows:
        r["provenance"]["grader"] = "judge:0123456789ab"
        if r["_ng_task_index"] == 0 and r["_ng_rollout_index"] == 0:
            r["reward"] = 1.0
        if r["_ng_task_index"] == 1 and r["_ng_rollout_index"] == 1:
            r["reward"] = 0.0
    b = write(root / "b.jsonl", rows)
    hostile = write(root / "hostile.jsonl", [row(0, 0, 1.0), hostile_row()])
    return {"a": a, "b": b, "hostile": hostile, "shots": root / "screenshots"}


@pytest.fixture(scope="module")
def site(files: dict[str, Path]) -> Iterator[Served]:
    yield from serve(str(files["a"]), str(files["b"]), str(files["hostile"]))


def shot(driver: webdriver.Chrome, files: dict[str, Path], name: str) -> None:
    files["shots"].mkdir(exist_ok=True)
    path = files["shots"] / f"{name}.png"
    assert driver.save_screenshot(str(path)) and path.stat().st_size > 1000


def until(driver: webdriver.Chrome, pred: Callable[[webdriver.Chrome], object], timeout: float = WAIT_S) -> None:
    """Wait for ``pred``; an element the page replaced meanwhile (a form's submit loads the next page between
    finding an element and reading it: CI's stale element) is looked for again."""
    WebDriverWait(driver, timeout, ignored_exceptions=[StaleElementReferenceException]).until(pred)


def wait_for(driver: webdriver.Chrome, css: str) -> None:
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, css))


def requests_made(driver: webdriver.Chrome) -> list[str]:
    """The URLs the page asked for since the last call (Chrome's performance log: every request it sent)."""
    out = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            out.append(msg["params"]["request"]["url"])
    return out


def no_dialog(driver: webdriver.Chrome) -> None:
    try:
        text = driver.switch_to.alert.text
    except NoAlertPresentException:
        return
    raise AssertionError(f"a dialog opened: {text!r}")


def test_the_runs_page_shows_each_run(driver: webdriver.Chrome, site: Served, files: dict[str, Path]) -> None:
    driver.get(site.entry("/"))
    wait_for(driver, "table#runs")
    rows = driver.find_elements(By.CSS_SELECTOR, "table#runs tbody tr")
    assert [r.find_element(By.CSS_SELECTOR, "td").text for r in rows] == ["a.jsonl", "b.jsonl", "hostile.jsonl"]
    first = [td.text for td in rows[0].find_elements(By.CSS_SELECTOR, "td")]
    assert first[1:3] == ["13", "2"] and "pass@1" in first[4] and "pass@2" in first[4] and "USD" in first[7]
    assert driver.find_elements(By.CSS_SELECTOR, "figure.hist svg rect")  # the histograms, as SVG
    assert "timeout" in driver.find_element(By.CSS_SELECTOR, "table.failures").text
    shot(driver, files, "runs")


def test_filter_then_a_trajectory_then_back(driver: webdriver.Chrome, site: Served, files: dict[str, Path]) -> None:
    driver.get(site.entry("/rollouts"))
    wait_for(driver, "form#filters")
    assert driver.find_element(By.ID, "count").text.startswith("30 rollouts")
    Select(driver.find_element(By.NAME, "run")).select_by_visible_text("a.jsonl")
    Select(driver.find_element(By.NAME, "agent")).select_by_visible_text("other_agent")
    driver.find_element(By.ID, "apply").click()
    until(driver, lambda d: d.find_element(By.ID, "count").text == "1 rollout")
    shot(driver, files, "rollouts")
    driver.find_element(By.CSS_SELECTOR, "table#rollouts tbody a").click()
    wait_for(driver, "dl#meta")
    body = driver.find_element(By.TAG_NAME, "main").text
    assert "partly cloudy" in body and "other_agent" in body and "get_weather" in body
    assert "I should call the tool." in body  # reasoning
    shot(driver, files, "trajectory")
    driver.back()
    until(driver, lambda d: d.find_elements(By.ID, "count"))
    assert driver.find_element(By.ID, "count").text == "1 rollout"
    assert Select(driver.find_element(By.NAME, "agent")).first_selected_option.text == "other_agent"

    driver.get(site.entry("/rollouts?run=0&failure=timeout"))
    assert driver.find_element(By.ID, "count").text == "1 rollout"
    driver.get(site.entry("/rollouts?q=partly+cloudy"))
    assert driver.find_element(By.ID, "count").text == "2 rollouts"  # a.jsonl's and b.jsonl's
    driver.get(site.entry("/rollouts?pv=1&run=0"))
    assert driver.find_element(By.ID, "count").text == "6 rollouts"
    driver.get(site.entry("/rollouts?sort=busy&desc=true"))
    assert driver.find_element(By.CSS_SELECTOR, "table#rollouts tbody tr td:nth-child(9)").text == "1105 ms"


def test_tokens_logprobs_versions_cost_and_provenance(driver: webdriver.Chrome, site: Served) -> None:
    driver.get(site.entry("/rollout/0/0/2"))  # task 1 rollout 0: policy version 1
    wait_for(driver, "dl#meta")
    main = driver.find_element(By.TAG_NAME, "main")
    assert "3 prompt tokens · 4 generated tokens · policy version 1" in main.text
    assert "policy_version_ranges [[0, 4, 1]]" in main.text
    details = driver.find_element(By.CSS_SELECTOR, "details.logprobs")
    details.find_element(By.TAG_NAME, "summary").click()
    assert "-1.5000" in details.text and "per-token logprobs (4)" in details.text
    assert "policy" in driver.find_element(By.ID, "cost").text
    prov = driver.find_element(By.ID, "provenance").text
    assert "a1b2c3d4e5f6" in prov and "w-agent-1" in prov


def test_the_diff_page_shows_the_known_flips(driver: webdriver.Chrome, site: Served, files: dict[str, Path]) -> None:
    driver.get(site.entry("/diff?a=0&b=1"))
    wait_for(driver, "table#diff")
    assert driver.find_element(By.ID, "flips").text == "pass→fail 1, fail→pass 1"
    assert driver.find_element(By.ID, "classes").text == "REUSE 0, REGRADE 13, RERUN 0"
    flips = {
        (tr.find_elements(By.TAG_NAME, "td")[0].text, tr.find_elements(By.TAG_NAME, "td")[5].text)
        for tr in driver.find_elements(By.CSS_SELECTOR, "table#diff tbody tr")
    }
    assert ("0", "fail→pass") in flips and ("1", "pass→fail") in flips
    shot(driver, files, "diff")
    driver.get(site.entry("/diff?a=0&b=2"))
    assert "REUSE 1" in driver.find_element(By.ID, "classes").text  # hostile.jsonl's task 0 rollout 0: as in a


def test_the_hostile_row_stays_inert(driver: webdriver.Chrome, site: Served, files: dict[str, Path]) -> None:
    requests_made(driver)  # what earlier tests asked for, dropped
    driver.get(site.entry("/rollouts?run=2"))
    wait_for(driver, "table#rollouts")
    no_dialog(driver)
    driver.find_element(By.LINK_TEXT, "99").click()
    until(driver, lambda d: d.find_elements(By.ID, "meta"))
    no_dialog(driver)
    main = driver.find_element(By.TAG_NAME, "main")
    # the markup is on the page as text; none of it became an element
    assert HOSTILE.split("<a href")[0] in main.text
    for css in ("main script", "main img", "main iframe", "main a[href^='javascript']", "main link", "main style"):
        assert not driver.find_elements(By.CSS_SELECTOR, css), css
    scripts = [s.get_attribute("src") for s in driver.find_elements(By.TAG_NAME, "script")]
    assert scripts == [site.base + "/static/keys.js"] and not driver.find_elements(By.TAG_NAME, "iframe")  # its own
    assert "lone \\ud800 surrogate \\udfff end" in main.text  # shown as its escape, not dropped
    assert "<script>alert('agent')</script>" in driver.find_element(By.ID, "meta").text
    # the 5 MB tool output: collapsed, and whole once opened
    big = next(d for d in driver.find_elements(By.CSS_SELECTOR, "section.output details.long"))
    big.find_element(By.TAG_NAME, "summary").click()
    size = driver.execute_script("return arguments[0].querySelector('pre').textContent.length", big)
    assert size >= BIG and size == len(hostile_row()["response"]["output"][2]["output"])
    shot(driver, files, "hostile")
    # still responsive: a click and a script answer, and nothing was asked of anyone but the server
    t0 = time.monotonic()
    driver.find_element(By.ID, "nav-runs").click()
    wait_for(driver, "table#runs")
    assert driver.execute_script("return 1 + 1") == 2 and time.monotonic() - t0 < WAIT_S
    no_dialog(driver)
    asked = requests_made(driver)
    assert asked and all(u.startswith(site.base + "/") for u in asked), asked
    logs = [e["message"] for e in driver.get_log("browser")]
    assert not [m for m in logs if "Content Security Policy" in m], logs  # nothing even tried to run


def test_a_trajectorys_turns_start_on_the_first_screen(driver: webdriver.Chrome, tmp_path: Path) -> None:
    """Forty tools offered: their JSON folded under one line, so the first turn is on the first screen."""
    r = row(0, 0, 1.0)
    r["responses_create_params"]["tools"] = [
        {"type": "function", "name": f"tool_{n}", "parameters": {"type": "object", "properties": {"x": {}}}}
        for n in range(40)
    ]
    for site in serve(str(write(tmp_path / "tools.jsonl", [r]))):
        driver.get(site.entry("/rollout/0/0/0"))
        wait_for(driver, "details#tools")
        first = driver.find_element(By.XPATH, "//h3[starts-with(normalize-space(.), 'turn 1')]")
        screen = driver.execute_script("return window.innerHeight")  # (reads the page: no script on it)
        assert first.location["y"] < screen, (first.location, screen)
        assert "tool_39" in driver.find_element(By.CSS_SELECTOR, "details#tools summary").text


def test_live_mode_follows_a_running_batch(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    """``view --batch B --nats URL`` on a batch published before its agent runs: the runs page says 0 of 6 and
    refreshes; once the agent's worker starts, the rows appear, and the table lists them."""
    config = write_config(tmp_path, delay_s=0.3, agent_concurrency=1)
    pool = Pool(config, nats_server.url)
    driver = browser()
    seen: set[str] = set()

    def all_in(d: webdriver.Chrome) -> bool:
        text = d.find_element(By.ID, "live-0").text if d.find_elements(By.ID, "live-0") else ""
        seen.add(text)
        return text == "all 6 in"

    try:
        for only in ("models.policy", "resources.env"):
            pool.start(only, only)
        published = cli(
            "publish", str(config), "-i", str(tasks_file(tmp_path, 6)), "--nats", nats_server.url, "--batch", "live1"
        )
        assert published.returncode == 0, published.stderr
        for site in serve("--batch", "live1", "--nats", nats_server.url):
            driver.get(site.entry("/"))
            wait_for(driver, "#live-0")
            assert driver.find_element(By.ID, "live-0").text == "live: 0 of 6"
            assert driver.find_elements(By.CSS_SELECTOR, "meta[http-equiv='refresh']")
            pool.start("agents.agent", "agents.agent")
            # the page refreshes itself (an element read as it goes is read again)
            WebDriverWait(driver, 180, 0.2, ignored_exceptions=[StaleElementReferenceException]).until(all_in)
            assert "live: 0 of 6" in seen and len(seen) >= 2
            assert not driver.find_elements(By.CSS_SELECTOR, "meta[http-equiv='refresh']")  # done: no more refresh
            named = driver.find_element(By.CSS_SELECTOR, "section.run p.path").text
            assert named == "batch live1 (followed on the bus)", named  # not the spool's temporary path
            driver.get(site.entry("/rollouts"))
            assert driver.find_element(By.ID, "count").text == "6 rollouts"
            driver.find_element(By.CSS_SELECTOR, "table#rollouts tbody a").click()
            wait_for(driver, "dl#meta")
            assert "get_weather" in driver.find_element(By.TAG_NAME, "main").text
    finally:
        driver.quit()
        pool.stop_all()


def test_live_mode_with_a_dead_bus_or_no_such_batch_is_one_error_line(nats_server: EmbeddedServer) -> None:
    dead = cli("view", "--batch", "b", "--nats", "nats://127.0.0.1:9", env={"GYM_CONNECT_TIMEOUT_S": "1"})
    assert dead.returncode == 2 and "Traceback" not in dead.stderr
    lines = dead.stderr.splitlines()  # the error alone: no "trying again" notice before it
    assert len(lines) == 1 and "error: cannot reach a NATS server at nats://127.0.0.1:9" in lines[0], dead.stderr
    absent = cli("view", "--batch", "nope", "--nats", nats_server.url, "--port", "0")
    assert absent.returncode == 2 and absent.stderr.strip().splitlines() == [
        "gym-runtime: error: --batch nope: no batch 'nope' in namespace 'gym' (published here? purged?); "
        "namespace 'gym' holds no batch; --namespace NAME reads another namespace"
    ], absent.stderr
