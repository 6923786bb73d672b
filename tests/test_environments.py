"""The contract every bundled environment keeps, checked once for all of them.

An environment package holds a ``config.yaml`` that runs offline (the scripted policy), names
the Resource class of its own package, and ``data/example.jsonl`` rows that ``validate`` accepts;
an environment that mirrors a NeMo Gym server ships that server's example rows unchanged. What
is particular to one environment stays in its own ``tests/``.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest

from gym_runtime.config import load_config
from gym_runtime.data.validation import validate_files
from gym_runtime.plugins import bundled_environments
from gym_runtime.resource import load_resource_class
from tests.helpers import COMPAT

ENVIRONMENTS = bundled_environments()

# The NeMo Gym resources server each mirrored environment reproduces (its example rows ship unchanged).
MIRRORS = {
    "counter": "example_session_state_mgmt",
    "equivalence_llm_judge": "equivalence_llm_judge",
    "google_search": "google_search",
    "instruction_following": "instruction_following",
    "math": "math_with_judge",
    "math_advanced_calculations": "math_advanced_calculations",
    "mcqa": "mcqa",
    "multi_step": "example_multi_step",
    "reasoning_gym": "reasoning_gym",
    "structured_outputs": "structured_outputs",
    "weather": "example_single_tool_call",
    "workplace_assistant": "workplace_assistant",
}


def env_dir(name: str) -> Path:
    return Path(str(importlib.resources.files("gym_runtime.resources") / name))


def test_every_bundled_environment_is_checked() -> None:
    assert len(ENVIRONMENTS) >= 16 and set(MIRRORS) <= set(ENVIRONMENTS)


@pytest.mark.parametrize("name", ENVIRONMENTS)
def test_config_runs_offline_and_names_its_own_resource_class(name: str) -> None:
    cfg = load_config(env_dir(name) / "config.yaml")
    assert cfg.agents, f"{name}: the config names no agent"
    for agent in cfg.agents.values():
        assert cfg.models[agent.model].adapter in ("scripted", "replay"), f"{name}: runs without a model server"
        assert agent.resource in cfg.resources
    own = [r for r in cfg.resources.values() if load_resource_class(r.server, name).__module__.split(".")[2] == name]
    assert own, f"{name}: no resource entry names a class of gym_runtime.resources.{name}"


@pytest.mark.parametrize("name", ENVIRONMENTS)
def test_example_rows_validate(name: str) -> None:
    rows = env_dir(name) / "data" / "example.jsonl"
    report = validate_files(load_config(env_dir(name) / "config.yaml"), [rows])
    assert report.rows > 0 and report.problems == []


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_a_mirrored_environment_ships_nemo_gyms_example_rows_unchanged(name: str) -> None:
    ours = (env_dir(name) / "data" / "example.jsonl").read_bytes()
    assert ours == (COMPAT / MIRRORS[name] / "example.jsonl").read_bytes()
