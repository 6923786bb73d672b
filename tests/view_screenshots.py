"""The screenshots of ``docs/view.md``: ``python -m tests.view_screenshots docs/images/view`` (needs Debian's
chromium and chromium-driver, and selenium from the dev extra). The tests take theirs into a temporary folder;
only this command writes into the docs."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from selenium.webdriver.common.by import By

from gym_runtime.trainers.rows import sequence
from tests.test_view import serve
from tests.test_view_browser import browser, wait_for
from tests.view_rows import hostile_row, row, sample_run, write


def main(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a = sample_run(root / "baseline.jsonl")
        rows = [json.loads(line) for line in a.read_text().splitlines()]
        for r in rows:
            if r["_ng_task_index"] in (0, 1):
                r["provenance"]["grader"] = "judge:0123456789ab"
            if (r["_ng_task_index"], r["_ng_rollout_index"]) == (0, 0):
                r["reward"] = 1.0
        b = write(root / "new_grader.jsonl", rows)
        hostile = write(root / "hostile.jsonl", [row(0, 0, 1.0), hostile_row()])
        driver = browser()
        try:
            for site in serve(str(a), str(b), str(hostile)):
                for name, path, css in (
                    ("runs", "/", "table#runs"),
                    ("rollouts", "/rollouts?run=0&sort=busy&desc=true", "table#rollouts"),
                    ("trajectory", "/rollout/0/0/2", "dl#meta"),
                    ("diff", "/diff?a=0&b=1", "table#diff"),
                    ("hostile", "/rollout/2/0/1", "dl#meta"),
                ):
                    driver.get(site.entry(path))
                    wait_for(driver, css)
                    if name == "trajectory":
                        driver.find_element(By.CSS_SELECTOR, "details.logprobs summary").click()
                        driver.execute_script("window.scrollTo(0, 0)")
                    driver.save_screenshot(str(target / f"{name}.png"))
                    print(target / f"{name}.png")
            # the training pages, over the real TRL run the trainer tier wrote (tests/data/train_run)
            run = Path(__file__).resolve().parent / "data" / "train_run"
            train = root / "train_rows.jsonl"
            shutil.copyfile(run / "train_rows.jsonl", train)
            for site in serve(str(train), "--tokenizer", str(run / "tokenizer")):
                for name, path, css in (
                    ("train-runs", "/", "table#runs"),
                    ("group", "/group/0/0", "table#group"),
                    ("tokens", f"/tokens/0/0/{multi_turn(train)}", "p.toks"),
                    ("steps", "/steps/0", "figure#plot-reward"),
                ):
                    driver.get(site.entry(path))
                    wait_for(driver, css)
                    driver.save_screenshot(str(target / f"{name}.png"))
                    print(target / f"{name}.png")
        finally:
            driver.quit()


def multi_turn(path: Path) -> int:
    """The first row of the run whose rollout called the tool (its token view has tool tokens, mask 0)."""
    for i, line in enumerate(path.read_text().splitlines()):
        r = json.loads(line)
        if "error_class" not in r and 0 in sequence(r).env_mask:
            return i
    return 0


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images/view"))
