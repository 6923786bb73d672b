"""``view``'s training pages in Chromium over a real TRL run's rows: ``tests/data/train_run`` (written by
``tests/trainers/test_train_rows.py``: TRL's GRPOTrainer on CPU training the tiny policy, its advantages read back;
the main suite has no TRL). The group page, the token view (decoded with the run's tokenizer) and the plots show
that run's advantages, masks and rewards; keyboard navigation moves through it; an exported bundle opens from
``file://`` with every link resolving; hostile rows stay inert on every new page."""

from __future__ import annotations

import json
import math
import shutil
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from gym_runtime.trainers.rows import sequence
from tests.helpers import cli
from tests.test_view import Served, serve
from tests.test_view_browser import browser, no_dialog, requests_made, until, wait_for
from tests.view_rows import HOSTILE, hostile_row, write

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra")
from selenium.webdriver.common.by import By  # noqa: E402

from tests.test_view_browser import pytestmark  # noqa: E402,F401  (chromium or a skip)

RUN = Path(__file__).resolve().parent / "data" / "train_run"


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (RUN / "train_rows.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train_view")
    train = root / "train_rows.jsonl"
    shutil.copyfile(RUN / "train_rows.jsonl", train)  # (view keeps its index beside the file)
    bad = hostile_row()
    gen = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": HOSTILE}],
        "prompt_token_ids": [1, HOSTILE],
        "generation_token_ids": [HOSTILE, 7],
        "generation_log_probs": [HOSTILE, -0.5],
        "policy_version": HOSTILE,
    }
    bad["response"]["output"].append(gen)
    bad |= {"train_step": 0, "train_group": HOSTILE, "train_reward": HOSTILE, "train_advantage": HOSTILE}
    failed = {"error_class": HOSTILE, "error": HOSTILE, "failure_attribution": HOSTILE, "_ng_task_index": 99}
    failed |= {"_ng_rollout_index": 1, "train_step": 0, "train_group": HOSTILE, "train_reward": None}
    hostile = write(root / "hostile_train.jsonl", [bad, failed])
    return {"train": train, "hostile": hostile, "root": root}


@pytest.fixture(scope="module")
def site(files: dict[str, Path]) -> Iterator[Served]:
    yield from serve(str(files["train"]), str(files["hostile"]), "--tokenizer", str(RUN / "tokenizer"))


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    d = browser()
    try:
        yield d
    finally:
        d.quit()


def groups_of(rows: list[dict[str, Any]]) -> dict[int, list[tuple[int, dict[str, Any]]]]:
    out: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for line, r in enumerate(rows):
        out[r["train_group"]].append((line, r))
    return out


def test_the_group_page_shows_the_advantages_trl_computed(driver: Any, site: Served, rows: list[Any]) -> None:
    groups = groups_of(rows)
    spread = [g for g, members in groups.items() if len({m["train_reward"] for _, m in members}) > 1]
    assert spread, "the fixture run has a group with a learning signal"
    g = spread[0]
    driver.get(site.entry(f"/group/0/{g}"))
    wait_for(driver, "table#group")
    shown = [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        for tr in driver.find_elements(By.CSS_SELECTOR, "table#group tbody tr")
    ]
    members = [m for _, m in groups[g]]
    assert [row[4] for row in shown] == [f"{m['train_advantage']:+.3f}" for m in members]  # TRL's, read back
    rewards = [m["train_reward"] for m in members]
    mean = sum(rewards) / len(rewards)
    assert driver.find_element(By.ID, "group-mean").text == f"{mean:.3f}".rstrip("0").rstrip(".")
    assert "zero spread" not in driver.find_element(By.ID, "group-spread").text
    # the runs page counts and lists the groups whose members all got the same reward
    zero = [g for g, members in groups.items() if len({m["train_reward"] for _, m in members}) == 1]
    driver.get(site.entry("/"))
    assert driver.find_element(By.ID, "zero-0").text.startswith(f"{len(zero)} with zero spread")
    # from a trajectory, its group is one link away
    line = groups[g][0][0]
    driver.get(site.entry(f"/rollout/0/0/{line}"))
    driver.find_element(By.ID, "key-u").click()
    until(driver, lambda d: d.current_url.endswith(f"/group/0/{g}"))
    shot(driver, files_root(site), "group")


def files_root(site: Served) -> Path:
    return Path(site.proc.args[-3]).parent  # (the run's folder: screenshots go beside it)


def shot(driver: Any, root: Path, name: str) -> None:
    (root / "screenshots").mkdir(exist_ok=True)
    assert driver.save_screenshot(str(root / "screenshots" / f"{name}.png"))


def test_the_token_view_shows_the_masks_logprobs_and_decoded_tokens(driver: Any, site: Served, rows: list[Any]) -> None:
    line, row = next((i, r) for i, r in enumerate(rows) if "error_class" not in r and 0 in sequence(r).env_mask)
    seq = sequence(row)
    driver.get(site.entry(f"/tokens/0/0/{line}"))
    wait_for(driver, "p.toks")
    gen = driver.find_elements(By.CSS_SELECTOR, "p.toks span.t.gen")
    env = driver.find_elements(By.CSS_SELECTOR, "p.toks span.t.env")
    prompt = driver.find_elements(By.CSS_SELECTOR, "p.toks span.t.prompt")
    assert (
        len(gen) == seq.env_mask.count(1) and len(env) == seq.env_mask.count(0) and len(prompt) == len(seq.prompt_ids)
    )
    lps = [lp for lp, m in zip(seq.logprobs, seq.env_mask, strict=True) if m]
    assert [s.get_attribute("title").split("logprob ")[1].split(" ")[0] for s in gen] == [f"{lp:.4f}" for lp in lps]
    assert [int(s.get_attribute("title").split(" ")[1]) for s in gen] == [
        t for t, m in zip(seq.completion_ids, seq.env_mask, strict=True) if m
    ]
    # decoded with the run's tokenizer: words, not ids
    assert any(s.text.strip() and not s.text.strip().isdigit() for s in gen)
    assert driver.find_element(By.ID, "version-ranges").text == f"tokens 0–{len(gen) - 1}: {row['train_step']}"
    shot(driver, files_root(site), "tokens")


def test_the_plots_show_the_runs_rewards_and_failures_per_step(driver: Any, site: Served, rows: list[Any]) -> None:
    driver.get(site.entry("/"))
    driver.find_element(By.ID, "steps-0").click()
    wait_for(driver, "figure#plot-reward")
    assert not driver.find_elements(By.TAG_NAME, "script") or all(
        s.get_attribute("src").endswith("/static/keys.js") for s in driver.find_elements(By.TAG_NAME, "script")
    )
    by_step: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if "error_class" not in r:
            by_step[r["train_step"]].append(r["reward"])
    titles = [
        t.get_attribute("textContent") for t in driver.find_elements(By.CSS_SELECTOR, "figure#plot-reward circle title")
    ]

    def spread(v: list[float]) -> float:
        return math.sqrt(sum((x - sum(v) / len(v)) ** 2 for x in v) / len(v))

    assert titles == [
        f"mean reward, step {s}: {sum(v) / len(v):.3g} (± {spread(v):.3g})" for s, v in sorted(by_step.items())
    ]
    failures = [
        t.get_attribute("textContent") for t in driver.find_elements(By.CSS_SELECTOR, "#plot-failures rect title")
    ]
    failed = [r for r in rows if "error_class" in r]
    assert failures == [f"step {r['train_step']}: 1 {r['failure_attribution']}" for r in failed]  # who caused it
    assert len(driver.find_elements(By.CSS_SELECTOR, "figure#plot-length circle")) == len(by_step)
    for fig in ("plot-reward", "plot-pass", "plot-failures", "plot-tasks", "plot-length"):
        labels = driver.find_element(By.ID, fig).find_elements(By.CSS_SELECTOR, "text.label")
        assert [t.text for t in labels][0] == "step", fig  # axes labelled
    shot(driver, files_root(site), "steps")


def test_keyboard_navigation_moves_through_rollouts_groups_and_turns(
    driver: Any, site: Served, rows: list[Any]
) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    def press(key: str) -> None:
        ActionChains(driver).send_keys(key).perform()

    driver.get(site.entry("/rollout/0/0/0"))
    wait_for(driver, "nav#keys")
    press("j")
    until(driver, lambda d: d.current_url.endswith("/rollout/0/0/1"))
    press("k")
    until(driver, lambda d: d.current_url.endswith("/rollout/0/0/0"))
    groups = groups_of(rows)
    second = groups[rows[0]["train_group"] + 1][0][0]
    press("g")
    until(driver, lambda d: d.current_url.endswith(f"/rollout/0/0/{second}"))
    first_of_next_step = next(i for i, r in enumerate(rows) if r["train_step"] != rows[second]["train_step"])
    press("s")
    until(driver, lambda d: d.current_url.endswith(f"/rollout/0/0/{first_of_next_step}"))
    failed = next(i for i, r in enumerate(rows) if "error_class" in r)
    driver.get(site.entry("/rollout/0/0/0"))
    wait_for(driver, "nav#keys")
    press("f")
    until(driver, lambda d: d.current_url.endswith(f"/rollout/0/0/{failed}"))
    press("v")
    until(driver, lambda d: d.current_url.endswith(f"/tokens/0/0/{failed}"))
    press("r")
    until(driver, lambda d: d.current_url.endswith(f"/rollout/0/0/{failed}"))
    # next turn: the page scrolls to the next item, a key at a time
    multi = next(i for i, r in enumerate(rows) if "error_class" not in r and 0 in sequence(r).env_mask)
    driver.get(site.entry(f"/tokens/0/0/{multi}"))
    wait_for(driver, "section#turn-2")
    driver.set_window_size(1400, 300)
    try:

        def top(turn: int) -> int:
            return int(driver.execute_script(f"return document.getElementById('turn-{turn}').offsetTop"))

        press("t")  # turn 1 to the top
        until(driver, lambda d: d.execute_script("return window.scrollY") == top(1))
        press("t")  # turn 2
        until(driver, lambda d: d.execute_script("return window.scrollY") > top(1))
        press("T")  # back to turn 1
        until(driver, lambda d: d.execute_script("return window.scrollY") == top(1))
    finally:
        driver.set_window_size(1400, 1000)


def test_an_exported_bundle_opens_from_disk_and_every_link_resolves(
    driver: Any, files: dict[str, Path], rows: list[Any]
) -> None:
    out = files["root"] / "bundle"
    done = cli("view", str(files["train"]), "--export", str(out), "--filter", "run=0")
    assert done.returncode == 0, done.stderr
    pages = sorted(out.glob("*.html"))
    assert len(list(out.glob("rollout-*.html"))) == len(rows) == len(list(out.glob("tokens-*.html")))
    assert len(list(out.glob("group-*.html"))) == len(groups_of(rows))
    for page in pages:
        html = page.read_text()
        assert '<meta http-equiv="Content-Security-Policy"' in html and "script-src 'self'" in html, page
    checked = 0
    for page in [out / "index.html", out / "rollouts.html", out / "group-0-0.html", out / "rollout-0-0-0.html"]:
        driver.get(page.as_uri())
        wait_for(driver, "main")
        no_dialog(driver)
        for a in driver.find_elements(By.CSS_SELECTOR, "a[href], link[href], script[src]"):
            url = a.get_attribute("href") or a.get_attribute("src")
            parts = urlsplit(url)
            assert parts.scheme == "file", url
            assert Path(unquote(parts.path)).is_file(), (page.name, url)
            checked += 1
    assert checked > 50
    # every link of every page of the bundle names a file of it
    for page in pages:
        for target in page.read_text().split('href="')[1:]:
            target = target.split('"', 1)[0]
            assert target.startswith("#") or (out / target).is_file(), (page.name, target)
    # the bundle's script runs from disk: j goes to the next rollout
    from selenium.webdriver.common.action_chains import ActionChains

    driver.get((out / "rollout-0-0-0.html").as_uri())
    wait_for(driver, "nav#keys")
    ActionChains(driver).send_keys("j").perform()
    until(driver, lambda d: d.current_url.endswith("/rollout-0-0-1.html"))
    logs = [e["message"] for e in driver.get_log("browser")]
    assert not [m for m in logs if "Content Security Policy" in m or "Refused" in m], logs
    # a bundle of hostile rows: inert from disk too
    hostile = files["root"] / "hostile_bundle"
    done = cli("view", str(files["hostile"]), "--export", str(hostile))
    assert done.returncode == 0, done.stderr
    for name in ("rollout-0-0-0.html", "rollout-0-0-1.html", "tokens-0-0-0.html", "group-0-0.html", "steps-0.html"):
        driver.get((hostile / name).as_uri())
        wait_for(driver, "main")
        no_dialog(driver)
        for css in ("main script", "main img", "main iframe", "main a[href^='javascript']", "main link", "main style"):
            assert not driver.find_elements(By.CSS_SELECTOR, css), (name, css)
        scripts = [x.get_attribute("src") for x in driver.find_elements(By.TAG_NAME, "script")]
        assert scripts == [(hostile / "static" / "keys.js").as_uri()], (name, scripts)


def test_hostile_rows_stay_inert_on_every_new_page(driver: Any, site: Served) -> None:
    requests_made(driver)
    for path in ("/", "/group/1/0", "/tokens/1/0/0", "/tokens/1/0/1", "/steps/1", "/rollout/1/0/0", "/rollout/1/0/1"):
        driver.get(site.entry(path))
        wait_for(driver, "main")
        no_dialog(driver)
        for css in ("main script", "main img", "main iframe", "main a[href^='javascript']", "main link", "main style"):
            assert not driver.find_elements(By.CSS_SELECTOR, css), (path, css)
        scripts = [s.get_attribute("src") for s in driver.find_elements(By.TAG_NAME, "script")]
        assert scripts == [site.base + "/static/keys.js"], (path, scripts)
        assert not driver.find_elements(By.TAG_NAME, "iframe")
    driver.get(site.entry("/group/1/0"))
    assert HOSTILE.split("<a href")[0] in driver.find_element(By.TAG_NAME, "h1").text  # its group's name, as text
    driver.get(site.entry("/tokens/1/0/0"))
    assert HOSTILE.split("<a href")[0] in driver.find_element(By.TAG_NAME, "main").text  # a "token id", as text
    asked = requests_made(driver)
    assert asked and all(u.startswith(site.base + "/") for u in asked), asked
    logs = [e["message"] for e in driver.get_log("browser")]
    assert not [m for m in logs if "Content Security Policy" in m], logs
