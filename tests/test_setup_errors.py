"""A plugin's setup that finds a mistake says it in one line naming the config key under its entry
(``agents.vf04.options.env``), whether the agent runs in its worker's process or in a guest process, and
verifiers 0.4's agent names its key once (not ``agents.*.agents.*.``)."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from gym_runtime.agents import verifiers_v1
from gym_runtime.config import AgentConfig, config_from_dict, resolve_config
from gym_runtime.errors import UserError
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.agent_worker import AgentWorker
from gym_runtime.workers.guest_agent import GuestAgent
from tests.helpers import cli, write_jsonl


async def setup_error(start: object) -> str:
    """The one error a worker's (or guest's) start raised, out of the task groups it went through."""
    with pytest.raises(BaseException) as e:  # noqa: PT011 - any: unwrapped below
        async with anyio.create_task_group() as tg:
            await tg.start(start)
    err: BaseException = e.value
    while isinstance(err, BaseExceptionGroup) and len(err.exceptions) == 1:
        err = err.exceptions[0]
    assert isinstance(err, UserError), repr(err)
    return str(err)


async def test_a_guest_agents_setup_mistake_names_its_entry() -> None:
    cfg = AgentConfig(agent="tests.envs.mistaken_setup", model="policy", isolation="process", options={"env": "x"})
    guest = GuestAgent("vf04", cfg, groups=False)
    assert await setup_error(guest.run_guest) == "agents.vf04.options.env: cannot load 'x'"


async def test_an_in_process_agents_setup_mistake_names_its_entry(bus: Bus) -> None:
    agent = {"agent": "tests.envs.mistaken_setup", "model": "policy", "isolation": "none", "options": {"env": "x"}}
    config = resolve_config(
        config_from_dict({"models": {"policy": {"adapter": "scripted"}}, "agents": {"vf04": agent}})
    )
    worker = AgentWorker(bus, "vf04", config)
    assert await setup_error(worker.run) == "agents.vf04.options.env: cannot load 'x'"


async def test_verifiers_04_names_its_key_once() -> None:
    cfg = AgentConfig(agent="agents.verifiers_v1", model="p", options={"env": {"taskset": {"id": "no_such_taskset"}}})
    with pytest.raises(UserError) as e:
        await verifiers_v1.setup(cfg)
    assert str(e.value).startswith("agents.*.options.env: cannot load the verifiers environment: "), e.value
    assert "no_such_taskset" in str(e.value)


def test_a_mistyped_verifiers_env_id_is_one_line_naming_the_entry(tmp_path: Path) -> None:
    """verifiers 0.3 in its default guest process, through the real CLI: one line, the entry's key, exit 2."""
    agent = {"agent": "agents.verifiers_env", "model": "policy", "options": {"env_id": "vf_suitx"}}
    cfg = {"nats": "embedded", "models": {"policy": {"adapter": "scripted"}}, "agents": {"vf": agent}}
    (tmp_path / "config.yaml").write_text(json.dumps(cfg))
    write_jsonl(tmp_path / "rows.jsonl", [{"responses_create_params": {"input": [{"role": "user", "content": "hi"}]}}])
    res = cli("run", str(tmp_path / "config.yaml"), "-i", str(tmp_path / "rows.jsonl"), "-o", str(tmp_path / "o.jsonl"))
    assert res.returncode == 2, res.stderr
    # a loaded machine may name the slow start first (a progress line): the mistake itself is one line
    [line] = [x for x in res.stderr.strip().splitlines() if "still starting" not in x]
    assert line.startswith("gym-runtime: error: agents.vf.options.env_id: cannot load verifiers environment 'vf_suitx'")
