"""Check task rows against the environment each one routes to, before any rollout runs.

A row is checked and routed to an agent of the config by the one row router
(``routing.Router``: its ``agent_ref.name``, ``--agent``, or the only agent), and
through the agent to its resource class. The row is then checked for what that
environment needs: the task fields the class declares (``Resource.task_fields``, a msgspec Struct, plus
its ``check_task``), and tools the class really has. Every problem is reported,
not only the first, so a dataset is fixed in one pass.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.config import Config
from gym_runtime.data.batches import Owners
from gym_runtime.data.inputs import Plan, validate
from gym_runtime.data.routing import Router
from gym_runtime.data.sources import parse_source, read_jsonl, read_source
from gym_runtime.errors import InputError
from gym_runtime.messages import RowCheck
from gym_runtime.resource import Resource, config_resource_class


@dataclass(slots=True)
class Report:
    """What a validation found: rows per agent and ``where: reason`` problems."""

    rows: int = 0
    agents: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _struct_error(e: msgspec.ValidationError) -> str:
    """``Expected `int`, got `str` - at `$.n``` → ``n: expected int, got str``."""
    msg = str(e)
    m = re.match(r"Object missing required field `([^`]+)`(?: - at `\$\.?([^`]*)`)?", msg)
    if m:
        where = f"{m.group(2)}." if m.group(2) else ""
        return f"missing task field '{where}{m.group(1)}'"
    m = re.match(r"(.*?) - at `\$\.?([^`]*)`", msg)
    if m:
        text = m.group(1).replace("`", "")
        return f"task field '{m.group(2)}': {text[0].lower()}{text[1:]}"
    return msg


class TaskChecker:
    """Checks rows against a config: routing, create params, task fields, tools."""

    def __init__(
        self, cfg: Config, *, agent: str | None = None, any_tools: bool = False, importable_only: bool = False
    ) -> None:
        """``any_tools``: rows may offer tools the environment does not have (answer channels the verifier
        reads from the call), for every environment, as a class's ``row_tools = "any"`` says for its own.
        ``importable_only``: an environment this process cannot import (it is installed on the worker nodes
        only) is not checked here; without it, that is an error (``validate``)."""
        self.router = Router(cfg.agents, agent)  # (``agent`` checked here, once)
        self.cfg = cfg
        self.any_tools = any_tools
        self.classes: dict[str, type[Resource] | None] = {}
        for name, a in cfg.agents.items():
            if not a.resource:  # an agent without resource sessions: no task fields to check
                self.classes[name] = None
                continue
            try:
                self.classes[name] = config_resource_class(cfg.resources[a.resource], f"resources.{a.resource}.server")
            except ValueError:
                if not importable_only:
                    raise
                self.classes[name] = None

    def check(self, row: Any) -> tuple[str | None, list[str]]:
        """(agent, problems) for one decoded row: the router's checks and route, then its environment's."""
        agent, problems = self.router.check(row)
        if agent is None:
            return None, problems
        cls = self.classes[agent]
        if cls is None:  # not importable here: its workers check what it needs
            return agent, problems
        params = row.get("responses_create_params")
        problems += row_problems(cls, self.cfg.agents[agent].resource, row, params, any_tools=self.any_tools)
        return agent, problems


def row_problems(cls: type[Resource], env: str, row: dict[str, Any], params: Any, *, any_tools: bool) -> list[str]:
    """What ``env``'s class refuses in ``row``: its task fields, its ``check_task``, tools it does not have
    (unless ``any_tools``). Publishers run it; a resource worker runs it at seed time for rows its
    publisher could not check (``RolloutTask.check``)."""
    problems: list[str] = []
    if cls.task_fields is not None:
        try:
            msgspec.convert(row, cls.task_fields)
        except msgspec.ValidationError as e:
            problems.append(f"{env}: {_struct_error(e)}")
        else:
            try:
                cls.check_task(row)
            except (ValueError, TypeError, KeyError) as e:
                problems.append(f"{env}: {str(e).removeprefix('task row: ')}")
    if cls.row_tools == "resource" and not any_tools and isinstance(params, dict):
        for tool in params.get("tools") or []:
            if isinstance(tool, dict) and tool.get("type", "function") == "function":
                name = tool.get("name")
                if name not in cls.tools:
                    have = ", ".join(sorted(cls.tools)) or "none"
                    problems.append(f"{env}: tool {name!r} is not a tool of this environment (it has: {have})")
    return problems


def check_rows(checker: TaskChecker, rows: Iterable[tuple[str, Any]], report: Report | None = None) -> Report:
    """Check ``(where, row)`` pairs; ``where`` prefixes each problem (``file:line``)."""
    report = report or Report()
    for where, row in rows:
        report.rows += 1
        if isinstance(row, msgspec.DecodeError):
            report.problems.append(f"{where}: not valid JSON ({row})")
            continue
        agent, problems = checker.check(row)
        report.problems += [f"{where}: {p}" for p in problems]
        if agent is not None and not problems:
            report.agents[agent] = report.agents.get(agent, 0) + 1
    return report


@dataclass(frozen=True, slots=True)
class CheckedRows:
    """Rows checked once, before any is published (``check_before_publish``): each row's agent, in row order
    (``routes``: its route, what the task carries), and the check each agent's resource workers make at seed time
    where this process cannot import the environment (``seed_checks``: its tasks' ``RolloutTask.check``)."""

    routes: list[str]
    seed_checks: dict[str, RowCheck]

    def owners(self) -> Owners:
        """The routes as the batch manifest records them."""
        owners = Owners()
        for agent in self.routes:
            owners.add(agent)
        return owners


def check_before_publish(
    cfg: Config, rows: Iterable[tuple[str, Any]], *, agent: str | None = None, any_tools: bool = False
) -> CheckedRows:
    """The checks of ``validate`` on rows about to be published (``Client.submit`` and ``run``; a file's:
    ``plan_publish``), each row checked once: ``InputError`` listing every problem, so nothing is published that
    ``validate`` would refuse; else each row's route and the seed-time checks (``CheckedRows``), which the
    publisher reuses rather than routing the rows again."""
    checker = _publish_checker(cfg, agent, any_tools)
    problems: list[str] = []
    routes: list[str] = []
    for where, row in rows:
        name, found = checker.check(row)
        problems += [f"{where}: {p}" for p in found]
        if name is not None:
            routes.append(name)
    if problems:
        raise InputError(problems)
    return CheckedRows(routes=routes, seed_checks=_seed_checks(checker, any_tools))


def plan_publish(
    cfg: Config, path: str | Path, *, agent: str | None = None, limit: int | None = None, any_tools: bool = False
) -> Plan:
    """What ``run`` and ``publish`` will send from a JSONL file, checked before anything starts, in one read:
    each row decoded (``inputs.validate``), checked and routed once, as ``check_before_publish`` checks
    (``InputError`` listing every problem)."""
    checker = _publish_checker(cfg, agent, any_tools)
    plan = validate(path, list(cfg.agents), agent=agent, limit=limit, check=checker.check)
    return dataclasses.replace(plan, seed_checks=_seed_checks(checker, any_tools))


def _publish_checker(cfg: Config, agent: str | None, any_tools: bool) -> TaskChecker:
    return TaskChecker(cfg, agent=agent, any_tools=any_tools, importable_only=True)


def _seed_checks(checker: TaskChecker, any_tools: bool) -> dict[str, RowCheck]:
    """The agents whose environment this process cannot import, with the check their workers make at seed time."""
    agents = checker.cfg.agents
    return {
        name: RowCheck(any_tools=any_tools)
        for name, cls in checker.classes.items()
        if cls is None and agents[name].resource
    }


def validate_files(
    cfg: Config, paths: list[str | Path], *, agent: str | None = None, any_tools: bool = False
) -> Report:
    """Check every row against ``cfg``; problems as ``file:line: reason`` (``file[index]`` for rows
    read through ``datasets``: Parquet, JSON or a hub id, as ``prepare`` takes them)."""
    checker = TaskChecker(cfg, agent=agent, any_tools=any_tools)
    report = Report()
    for p in map(Path, paths):
        before = report.rows
        if p.suffix == ".jsonl" or p.is_file() and p.suffix not in (".json", ".parquet"):
            if not p.is_file():
                report.problems.append(f"{p}: file not found; give -i the path of a JSONL file of task rows")
                continue
            check_rows(checker, ((f"{p}:{n}", row) for n, row in read_jsonl(p)), report)
        else:
            check_rows(checker, read_source(parse_source(str(p))), report)
        if report.rows == before:
            report.problems.append(f"{p}: no rows")
    return report
