"""Which agent a task row goes to, and what every row must be before it goes anywhere: the one row router that
``Client.submit``, the CLI's file path (``run``, ``publish``) and ``validate`` all use, each row checked and routed
once (``validation.TaskChecker`` adds its environment's checks; a publish lays its tasks out from the routes found).

A row goes to ``--agent`` if given, else to its ``agent_ref.name`` (NeMo Gym's: an object whose ``type`` is
``responses_api_agents``), else to the config's only agent.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from gym_runtime.errors import UserError
from gym_runtime.messages import ItemError, create_params

__all__ = ["AGENT_REF_TYPE", "Router", "check_agent_flag"]

AGENT_REF_TYPE = "responses_api_agents"  # NeMo Gym's agent_ref.type


def check_agent_flag(agent: str | None, agents: Iterable[str]) -> None:
    """``--agent NAME`` names an agent of the config: said once, with the nearest name, before any row is read."""
    names = list(agents)
    if agent is None or agent in names:
        return
    near = difflib.get_close_matches(agent, names, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]}?" if near else ""
    raise UserError(f"--agent {agent!r} is not an agent of this config ({', '.join(names)}){hint}")


class Router:
    """Routes rows to the agents of a config (``agent``: ``--agent``, checked here, once)."""

    def __init__(self, agents: Iterable[str], agent: str | None = None) -> None:
        self.agents = list(agents)
        check_agent_flag(agent, self.agents)
        self.agent = agent

    def check(self, row: Any) -> tuple[str | None, list[str]]:
        """(agent, problems) of one decoded row: a JSON object with valid ``responses_create_params``, routed.
        The agent is None when the row goes nowhere."""
        if not isinstance(row, dict):
            return None, [f"a row must be a JSON object, got {type(row).__name__}"]
        problems: list[str] = []
        params = row.get("responses_create_params")
        if params is None:
            problems.append("missing required field 'responses_create_params'")
        else:
            try:
                create_params(params)
            except (ItemError, ValueError) as e:
                problems.append(str(e))
        agent, routing = self.route(row)
        return agent, problems + routing

    def route(self, row: dict[str, Any]) -> tuple[str | None, list[str]]:
        """The agent a row goes to, or the problems that stop it from going anywhere."""
        agents = self.agents
        ref = row.get("agent_ref")
        if ref is not None:
            if not isinstance(ref, dict) or not isinstance(ref.get("name"), str):
                return None, ["agent_ref must be an object with a string 'name'"]
            if ref.get("type", AGENT_REF_TYPE) != AGENT_REF_TYPE:
                return None, [f"agent_ref.type must be {AGENT_REF_TYPE!r}, got {ref.get('type')!r}"]
            if self.agent is None:
                if ref["name"] not in agents:
                    one = len(agents) == 1
                    hint = f"; pass --agent {agents[0]} to run such rows with it" if one else "; pass --agent NAME"
                    listed = ", ".join(agents)
                    return None, [f"agent_ref.name {ref['name']!r} is not an agent of this config ({listed}){hint}"]
                return str(ref["name"]), []
        if self.agent is not None:
            return self.agent, []
        if len(agents) == 1:
            return agents[0], []
        if not agents:
            return None, ["the config has no agents"]
        return None, [f"row names no agent_ref and the config has several agents ({', '.join(agents)}); pass --agent"]

    def agent_of(self, row: dict[str, Any]) -> str:
        """The agent of a row no check routed before (a caller's own, published as it is): ``UserError`` saying
        why there is none."""
        agent, problems = self.route(row)
        if agent is None:
            raise UserError(problems[0])
        return agent
