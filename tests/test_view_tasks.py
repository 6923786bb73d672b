"""Issue 79 item 3: ``view``'s training pages show which tasks the sampler favoured and each task's pass rate over
steps, from a training rows file as the trainer adapters write it (``TrainRowsWriter``, each row with the sampler's
key of its task, ``train_task``). The signal shown is the sampler's own estimate (``data.sampling``) of those
outcomes."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from gym_runtime.data.sampling import TaskStats, observe, signal, task_key
from gym_runtime.trainers.train_rows import TrainRowsWriter
from tests.test_view import serve

EASY = {"responses_create_params": {"input": [{"role": "user", "content": "say a"}]}, "word": "a"}
HARD = {"responses_create_params": {"input": [{"role": "user", "content": "say b"}]}, "word": "b"}


def rollout(task: int, k: int, reward: float | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"_ng_task_index": task, "_ng_rollout_index": k, **extra}
    if reward is not None:
        out["reward"] = reward
    return out


def test_the_tasks_page_says_which_tasks_were_favoured_and_each_ones_pass_rate_over_steps(tmp_path: Path) -> None:
    path = tmp_path / "train_rows.jsonl"
    writer = TrainRowsWriter(path)
    easy, hard = task_key(EASY), task_key(HARD)
    picked = {easy: [], hard: []}  # type: dict[str, list[dict[str, Any]]]
    # three steps: the easy task in a group every step (its pass rate rising), the hard one at step 0 only, one of
    # its rows an environment failure (no outcome)
    plan = [
        (0, easy, [1.0, 0.0, 0.0, 0.0]),
        (0, hard, [0.0, None, 0.0, 0.0]),
        (1, easy, [1.0, 1.0, 0.0, 0.0]),
        (2, easy, [1.0, 1.0, 1.0, 0.0]),
    ]
    for n, (step, key, rewards) in enumerate(plan):
        g = writer.group()
        for k, r in enumerate(rewards):
            extra = {"error_class": "sandbox_error", "failure_attribution": "infrastructure"} if r is None else {}
            row = rollout(n, k, r, **extra)
            picked[key].append(row)
            writer.write(row, step=step, group=g, reward=r, task=key)
    writer.close()
    for site in serve(str(path)):
        status, _, body = site.get("/")
        assert status == 200 and b'href="/tasks/0"' in body
        status, _, body = site.get("/tasks/0")
        assert status == 200, body[:500]
        page = html.unescape(body.decode())
        rows = re.findall(r"<tr>\s*<td><a href=\"/task/0/([0-9a-f]+)\">.*?</tr>", page, re.S)
        assert rows == [easy, hard]  # the most picked first
        easy_row = page[page.index(f"/task/0/{easy}") :]
        assert re.search(r'favoured">1\.50<', easy_row)  # 3 of 4 groups, against a uniform share of 2
        assert "0: 25.0% · 1: 50.0% · 2: 75.0%" in easy_row
        hard_row = page[page.index(f"/task/0/{hard}") :]
        assert re.search(r'favoured">0\.50<', hard_row) and "0: 0.0%" in hard_row
        for key in (easy, hard):  # the sampler's own estimate of the same outcomes
            want = signal(observe(TaskStats(), picked[key]))
            assert f"{want:.3f}" in page[page.index(f"/task/0/{key}") :].split("</tr>")[0]
        status, _, body = site.get(f"/task/0/{easy}")
        assert status == 200 and b'id="plot-task"' in body and b"75.0%" in body
        assert site.get("/task/0/ffff")[0] == 404
