"""A plugin's setup that finds a mistake says it in one line naming the config key under its entry
(``agents.vf04.options.env``), whether the agent runs in its worker's process or in a guest process, and
verifiers 0.4's agent names its key once (not ``agents.*.agents.*.``)."""

from __future__ import annotations

import anyio
import pytest

from gym_runtime.agents import verifiers_v1
from gym_runtime.config import AgentConfig, config_from_dict, resolve_config
from gym_runtime.errors import UserError
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.agent_worker import AgentWorker
from gym_runtime.workers.guest_agent import GuestAgent


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
