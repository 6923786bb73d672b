"""docs/trainer.md's TRL recipes, run as written: the config entry and each Python block, on the tiny policy."""

from __future__ import annotations

import math
import os
from pathlib import Path

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
    cfg["models"]["policy"] = {**entry, "max_new_tokens": 4}  # the page's entry, with short generations
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


def test_the_async_trl_recipe_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need("trl.experimental.async_grpo")
    from tests.trainers.cpu_attention import install

    code, w = recipe(tmp_path, monkeypatch, "## Recipe: TRL asynchronous GRPO")
    install()  # the CUDA-only FlashAttention-3 kernel and MFU metric, replaced on CPU as the page says
    w.model.save_pretrained(tmp_path / "model")
    w.tokenizer.save_pretrained(tmp_path / "model")
    env = {"path": str(tmp_path / "model"), "tokenizer": w.tokenizer, "rows": w.rows}
    exec(compile(code, "docs/trainer.md", "exec"), env)
    trainer, worker, transfer = env["trainer"], env["worker"], env["transfer"]
    assert trainer.state.global_step == 2
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert transfer.version == 3  # the first sync, then one per step
    assert worker.counts.groups > 0 and worker.counts.failed_groups == 0
    trained = dict(trainer.model.named_parameters())
    for name, param in transfer.live.model.named_parameters():  # the rollout copy holds the last step's weights
        assert param.detach().equal(trained[name].detach()), name
