"""docs/trainer.md's TRL recipes, run as written: the config entry and each Python block, on the tiny policy."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import REPO
from tests.trainers.world import World, need, world

need("trl")


def block(text: str, heading: str, lang: str) -> str:
    """The first ```lang block under ``heading``."""
    section = text.split(heading, 1)[1]
    return section.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


SYNC = "## Recipe: TRL `GRPOTrainer` with `rollout_func`"


def recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heading: str) -> tuple[str, World]:
    """The block under ``heading``, and a world whose ``my_env/config.yaml`` holds the page's model entry."""
    page = (REPO / "docs/trainer.md").read_text()
    entry = yaml.safe_load(block(page, SYNC, "yaml"))["models"]["policy"]
    w = world(tmp_path)
    cfg = yaml.safe_load(w.config.read_text())
    cfg["models"]["policy"] = {**cfg["models"]["policy"], **entry}  # the page's entry as written (its keys win)
    (tmp_path / "my_env").mkdir()
    (tmp_path / "my_env/config.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    return block(page, heading, "python"), w


def test_the_trl_recipe_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, w = recipe(tmp_path, monkeypatch, SYNC)
    env = {"model": w.model, "tokenizer": w.tokenizer, "rows": w.rows}
    exec(compile(code, "docs/trainer.md", "exec"), env)
    trainer = env["trainer"]
    assert trainer.state.global_step == 2
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])  # TRL's summary of the run
    assert env["rollouts"].totals.rollouts == 8
    assert os.path.isdir(tmp_path / "out")


ASYNC = "## Recipe: TRL asynchronous GRPO"


def test_the_async_trl_recipe_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both blocks exactly as the page has them (no value overridden, no helper of the tests'), from a clone's root:
    the bundled weather rows, the tiny policy the package builds, the CPU attention the package ships."""
    need("trl.experimental.async_grpo")
    page = (REPO / "docs/trainer.md").read_text()
    (tmp_path / "runs").mkdir()  # what the recipe writes goes under the clone's runs/ (git ignores it)
    (tmp_path / "runs/trl_weather.yaml").write_text(block(page, ASYNC, "yaml"))
    (tmp_path / "resources").symlink_to(REPO / "resources")  # the clone's root: its bundled rows where the page reads
    monkeypatch.chdir(tmp_path)
    env: dict[str, Any] = {}
    exec(compile(block(page, ASYNC, "python"), "docs/trainer.md", "exec"), env)
    trainer, worker, transfer = env["trainer"], env["worker"], env["transfer"]
    assert trainer.state.global_step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resources", "runs"]  # nothing in the clone's root
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert transfer.version == 3  # the first sync, then one per step
    counts = worker.counts
    assert counts.groups > 0 and counts.failed_groups == 0
    assert worker.fill.over_budget == 0  # the page's token_budget fits its samples
    trained = dict(trainer.model.named_parameters())
    for name, param in transfer.live.model.named_parameters():  # the rollout copy holds the last step's weights
        assert param.detach().equal(trained[name].detach()), name


def run_recipe_with(tmp_path: Path, **changes: tuple[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """The async recipe as a user's script with their mistake in it (each change: the page's text, the user's),
    run as a script from a clone's root: (the finished process, the seconds it took)."""
    need("trl.experimental.async_grpo")
    page = (REPO / "docs/trainer.md").read_text()
    code = block(page, ASYNC, "python")
    for old, new in changes.values():
        assert old in code, old
        code = code.replace(old, new)
    (tmp_path / "runs").mkdir()  # what the recipe writes goes under the clone's runs/ (git ignores it)
    (tmp_path / "runs/trl_weather.yaml").write_text(block(page, ASYNC, "yaml"))
    (tmp_path / "resources").symlink_to(REPO / "resources")
    (tmp_path / "train.py").write_text(code)
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=280,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    return res, time.monotonic() - t0


def test_a_token_budget_every_sample_is_over_is_said_in_one_line(tmp_path: Path) -> None:
    """Issue 67: with the budget under every sample TRL dropped them all, and nothing said so for minutes."""
    res, took = run_recipe_with(tmp_path, budget=("token_budget = 256", "token_budget = 30"))
    assert res.returncode != 0, res.stderr[-3000:]
    # (TRL's progress bar may hold the line's start: the bar has no newline of its own)
    said = [line.partition("gym-runtime: ")[2] for line in res.stderr.splitlines() if "gym-runtime: a rollout" in line]
    assert said, res.stderr[-3000:]
    assert "longer than token_budget=30, so TRL drops it" in said[0]
    assert "raise AsyncGRPOConfig(token_budget=...)" in said[0], said[0]
    assert took < 200, took  # said and ended long before TRL's own 300 s health check


def test_a_step_that_cannot_fill_names_batch_size_instead_of_waiting(tmp_path: Path) -> None:
    """Issue 67: a step that packs more samples than admission lets start per version waited forever in silence."""
    res, took = run_recipe_with(tmp_path, batch=("batch_size=16", "batch_size=4"))
    assert res.returncode != 0
    assert "ClientError: a training step needs more samples than the rollout worker may start" in res.stderr, (
        res.stderr[-3000:]
    )
    assert "raise GymRolloutWorker(batch_size=...), e.g. to 8" in res.stderr
    assert took < 200, took
