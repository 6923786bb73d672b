"""docs/trainer.md's TRL recipe, run as written: its config entry and its Python block, on the tiny policy."""

from __future__ import annotations

import math
import os
from pathlib import Path

import yaml

from tests.helpers import REPO
from tests.trainers.world import need, world

need("trl")


def block(text: str, heading: str, lang: str) -> str:
    """The first ```lang block under ``heading``."""
    section = text.split(heading, 1)[1]
    return section.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def test_the_trl_recipe_runs_as_written(tmp_path: Path, monkeypatch) -> None:
    page = (REPO / "docs/trainer.md").read_text()
    heading = "## Recipe: TRL `GRPOTrainer` with `rollout_func`"
    entry = yaml.safe_load(block(page, heading, "yaml"))["models"]["policy"]
    code = block(page, heading, "python")
    w = world(tmp_path)
    cfg = yaml.safe_load(w.config.read_text())
    cfg["models"]["policy"] = {**entry, "max_new_tokens": 4}  # the page's entry, with short generations
    (tmp_path / "my_env").mkdir()
    (tmp_path / "my_env/config.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    env = {"model": w.model, "tokenizer": w.tokenizer, "rows": w.rows}
    exec(compile(code, "docs/trainer.md", "exec"), env)
    trainer = env["trainer"]
    assert trainer.state.global_step == 2
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])  # TRL's summary of the run
    assert env["rollouts"].totals.rollouts == 8
    assert os.path.isdir(tmp_path / "out")
