"""Reattach works for the hosted kinds whose session lives on a resource worker that is still alive (issue 69 item
5): an OpenEnv environment (``resources.openenv``, its ``Environment`` in the worker), an OpenReward (ORS) one
(``resources.openreward``, its SDK environment in the worker's guest process), a NeMo Gym resources server
(``nemo_gym: example_session_state_mgmt``, its own code in the guest, on its built environment) and a Harbor task
(``resources.harbor``, its container on a Docker sandbox pool, held by the session). Real nats-server,
real worker processes, the agent worker SIGKILLed between two turns (the LLM is a test double: ``scripted``, slowed
so the kill lands between them). The redelivered attempt reattaches to the same session: the row says so, each
tool ran once, ORS's ``submit`` sees the part ``fix`` repaired before the kill (a fresh session would say "still
broken") and NeMo Gym's counter read after the kill has the increment made before it.
Which kinds reattach, restore or only restart: docs/operations.md#resume-at-the-last-turn.
"""

from __future__ import annotations

import importlib
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.engine_http import Engine, socket_of
from gym_runtime.sandboxes.images import ensure_base
from tests.docker import docker_socket
from tests.helpers import REPO, read_jsonl
from tests.hosting import catalogue_root
from tests.long_rollout import Run, agent_entry, remove_containers, stored_checkpoint

ENVS = REPO / "tests" / "envs"


def _openenv_row() -> dict[str, Any]:
    from gym_runtime.resources.openenv import action_tool
    from tests.envs.openenv_counter import CountAction

    tools = [action_tool(CountAction)]
    return {"responses_create_params": {"input": [{"role": "user", "content": "count"}], "tools": tools}}


def _ors_row() -> dict[str, Any]:
    """Task r0 of ``ors_repair:Repair`` (its broken part is the scripted policy's example string), its tools in
    the order the policy calls them, one a turn: inspect, fix, submit."""
    from gym_runtime.resources.openreward.rows import rows_in_process

    if str(ENVS) not in sys.path:
        sys.path.insert(0, str(ENVS))
    row = rows_in_process(importlib.import_module("ors_repair").Repair, "train")[0]
    tools = {t["name"]: t for t in row["responses_create_params"]["tools"]}
    params = {**row["responses_create_params"], "tools": [tools[n] for n in ("inspect", "fix", "submit")]}
    return {**row, "responses_create_params": {**params, "parallel_tool_calls": False}}


def _nemo_gym_row() -> dict[str, Any]:
    """example_session_state_mgmt's first task (a counter per session, seeded at ``initial_count``): increment, then
    read the counter, one a turn."""
    root = catalogue_root("--server", "example_session_state_mgmt")
    (row, *_) = read_jsonl(root / "example_session_state_mgmt" / "data" / "example.jsonl")
    return {**row, "responses_create_params": {**row["responses_create_params"], "parallel_tool_calls": False}}


HARBOR_TASK = "read-file"


def _harbor() -> tuple[dict[str, Any], dict[str, Any]]:
    """A Harbor task of tests/harbor_tasks (its image built once per engine) on a sandbox pool of this test's own:
    the resources entry with its pool's, and the task's row (``bash`` offered: the policy calls it once)."""
    from gym_runtime.harbor import ImageOptions, find_tasks
    from gym_runtime.harbor.hosting import ensure_images, harbor_config
    from gym_runtime.resources.harbor import dataset_rows

    tasks = REPO / "tests" / "harbor_tasks"
    opts = ImageOptions(base_images={"debian:bookworm-slim": "base", "python:3.12-slim": "base"})

    async def build() -> None:
        async with Engine(docker_socket()) as e:
            await ensure_base(e)
            await ensure_images(e, [t for t in find_tasks(tasks) if t.name == HARBOR_TASK], opts)

    anyio.run(build)
    raw = harbor_config(str(tasks), opts, f"unix://{socket_of(docker_socket())}", 120)
    pool = f"rh{uuid.uuid4().hex[:6]}"
    entry = {**raw["resources"]["harbor"], "sandbox": pool}
    row = next(r for r in dataset_rows({"tasks": str(tasks)}, "train") if r["harbor_task"] == HARBOR_TASK)
    return {"env": entry, "sandboxes": {pool: raw["sandboxes"]["harbor"]}}, row


KINDS = {
    # kind: (its resources entry, its task, the checkpointed turn to kill the agent after)
    "openenv": ({"server": "resources.openenv", "options": {"env": "openenv_counter:CountEnv"}}, _openenv_row, 1),
    "openreward": ({"server": "resources.openreward", "options": {"env": "ors_repair:Repair"}}, _ors_row, 2),
    "nemo_gym": ({"nemo_gym": "example_session_state_mgmt"}, _nemo_gym_row, 1),
    "harbor": ({}, lambda: {}, 1),  # its entry and row: ``_harbor``
}


def _config(tmp: Path, resource: dict[str, Any], sandboxes: dict[str, Any] | None = None) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted", "delay_s": 4.0, "ack_wait_s": 2.0}},
        "sandboxes": sandboxes or {},
        "resources": {"env": resource},
        "agents": {"agent": agent_entry()},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_hosted_kinds_session_on_a_live_worker_is_reattached(
    nats_server: EmbeddedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ENVS))  # the environments' modules, for the workers (and ORS's guest)
    monkeypatch.setenv("OPENREWARD_DISABLE_UPDATE_CHECK", "1")  # the SDK would ask PyPI for its latest version
    resource, row, kill_after = KINDS[kind]
    pool = None
    if kind == "harbor":
        entries, task = _harbor()
        (pool,) = entries["sandboxes"]
        run = Run(tmp_path, nats_server.url, _config(tmp_path, entries["env"], entries["sandboxes"]))
        run.tasks = [task]
    else:
        run = Run(tmp_path, nats_server.url, _config(tmp_path, resource))
        run.tasks = [row()]
    try:
        run.start(pool)

        # between two turns: the next generation takes the policy 4 s
        cp = run.kill_agent_after(lambda cp: cp.turn >= kill_after and cp.phase == "answered")
        assert cp.turn == kill_after, cp
        run.pool.start("agents.agent#2", "agents.agent")
        row_out = run.row()
        assert (row_out["resumed_how"], row_out["resumed_from_turn"]) == ("reattached", kill_after)
        calls = [i["call_id"] for i in row_out["response"]["output"] if i["type"] == "function_call"]
        outputs = [i["call_id"] for i in row_out["response"]["output"] if i["type"] == "function_call_output"]
        assert outputs == calls and len(set(calls)) == len(calls)  # each call answered once
        if kind == "openreward":  # submit, after the kill, found the part fixed before it (same session)
            items = row_out["response"]["output"]
            names = [i["name"] for i in items if i["type"] == "function_call"]
            assert names == ["inspect", "fix", "submit"], names
            last = next(i for i in reversed(items) if i["type"] == "function_call_output")
            assert "works" in json.dumps(last["output"]), last
        if kind == "nemo_gym":  # the counter read after the kill has the increment made before it (same session)
            items = row_out["response"]["output"]
            (inc,) = [json.loads(i["arguments"]) for i in items if i.get("name") == "increment_counter"]
            last = json.loads(next(i for i in reversed(items) if i["type"] == "function_call_output")["output"])
            assert last["count"] == run.tasks[0]["initial_count"] + inc["count"], (last, inc)
        assert stored_checkpoint(nats_server.url) is None
    finally:
        run.close()
        if pool is not None:
            remove_containers(pool)
