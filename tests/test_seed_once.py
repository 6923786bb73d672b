"""Set up once for the group (``resources.NAME.seed_once``: issue 78 item 2), on a real nats-server (and a real
Docker engine for the sandbox environment), every worker in process, the policy the scripted TEST DOUBLE: a batch
run both ways has the same rows and rewards; with it, ``seed`` runs once per task (K times without); a failed seed
fails every repeat of its task with its own class; the templates (sessions and their sandboxes) are closed once
their group is done; an environment that cannot snapshot is one line, exit 2, naming the key."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from gym_runtime.client import Client
from gym_runtime.config import load_config, resolve_config
from gym_runtime.config.resolved import ResolvedConfig
from gym_runtime.errors import ConfigError, UserError
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.workers.resource_worker import ResourceWorker
from tests.envs import seeded_box, seeded_ledger
from tests.helpers import cli, eventually
from tests.test_sandbox_fork import fork_images, fork_volumes
from tests.test_sandbox_worker import pool

__all__ = ["pool"]  # the fixture

REPEATS = 4


def config(tmp: Path, env: dict[str, Any], sandboxes: dict[str, Any] | None = None, name: str = "c") -> Path:
    cfg: dict[str, Any] = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted"}},
        "resources": {"env": env},
        "agents": {
            "agent": {"agent": "agents.simple", "model": "policy", "resource": "env", "max_steps": 4, "timeout_s": 120}
        },
    }
    if sandboxes:
        cfg["sandboxes"] = sandboxes
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def seeds(path: Path) -> list[str]:
    return sorted(path.read_text().split()) if path.exists() else []


def kept(row: dict[str, Any]) -> dict[str, Any]:
    """What a row says of its task, its turns and its grade (its run's identity, times and provenance left out)."""
    keys = ("_ng_task_index", "_ng_rollout_index", "reward", "error_class", "taken", "files")
    out = {k: row.get(k) for k in keys}
    out["said"] = [
        o.get("output") or o.get("arguments") or o.get("content")
        for o in row.get("response", {}).get("output", [])
        if o.get("type") in ("function_call", "function_call_output")
    ]
    return out


def resource_worker(client: Client) -> ResourceWorker:
    return next(w for w in client.workers if isinstance(w, ResourceWorker))


async def run_batch(
    url: str, cfg: ResolvedConfig, tasks: list[dict[str, Any]], left: Callable[[], Awaitable[list[str]]] | None
) -> list[dict[str, Any]]:
    async with Client(cfg, nats=url) as client:
        batch = await client.submit(tasks, repeats=REPEATS)
        with anyio.fail_after(240):
            rows = await batch.gather()
        worker = resource_worker(client)
        if worker.cfg.seed_once:  # the group is done: its templates go within their idle time, workers still up
            await eventually(lambda: len(worker.templates) == 0, within=60)
        if left is not None:
            with anyio.fail_after(60):
                while await left():
                    await anyio.sleep(0.1)
    return sorted((kept(r) for r in rows), key=lambda r: (r["_ng_task_index"], r["_ng_rollout_index"]))


async def both_ways(
    tmp: Path,
    url: str,
    env: dict[str, Any],
    tasks: list[dict[str, Any]],
    left: Callable[[], Awaitable[list[str]]] | None = None,
    **more: Any,
) -> None:
    """The batch without and with ``seed_once``: the same rows; seed run K times per task, then once."""
    out = {}
    for once in (False, True):
        log = tmp / f"seeds-{once}"
        entry = {
            **env,
            "seed_once": once,
            "seed_once_idle_s": 0.5,
            "options": {**env.get("options", {}), "seeds": str(log)},
        }
        cfg = resolve_config(load_config(config(tmp, entry, name=f"c{once}", **more)))
        out[once] = await run_batch(url, cfg, tasks, left)
        names = [t["name"] for t in tasks]
        assert seeds(log) == sorted(names * (1 if once else REPEATS)), once
    assert out[True] == out[False]
    assert len(out[True]) == REPEATS * len(tasks)
    assert {r["reward"] for r in out[True]} == {1.0}, out[True]  # each repeat saw its own state only


async def test_a_stateful_batch_is_the_same_set_up_once_and_seeds_once_per_task(
    tmp_path: Path, nats_server: EmbeddedServer
) -> None:
    tasks = [seeded_ledger.task("a"), seeded_ledger.task("b")]
    await both_ways(tmp_path, nats_server.url, {"server": "tests.envs.seeded_ledger"}, tasks)


async def test_a_sandbox_batch_is_the_same_set_up_once_with_forked_sandboxes_and_leaves_none(
    tmp_path: Path, nats_server: EmbeddedServer, engine: Engine, base_image: str, pool: str
) -> None:
    sandboxes = {
        pool: {
            "engine": f"unix://{engine.socket_path}",
            "capacity": 16,
            "limits": {"memory_mb": 64, "pids": 32, "disk_mb": 8, "timeout_s": 60},
        }
    }
    tasks = [seeded_box.task("a"), seeded_box.task("b")]

    async def left() -> list[str]:  # while the workers run: every rollout's fork closed, and the templates'
        return [c["Id"] for c in await engine.containers({POOL: f"gym.{pool}"})]

    env = {"server": "tests.envs.seeded_box", "sandbox": pool}
    await both_ways(tmp_path, nats_server.url, env, tasks, left, sandboxes=sandboxes)
    assert await left() == [] and await fork_images(engine, pool) == []
    assert await fork_volumes(engine, pool) == []  # the templates' snapshots too


async def test_repeats_wait_for_room_to_fork_on_a_full_worker(
    tmp_path: Path, nats_server: EmbeddedServer, engine: Engine, base_image: str, pool: str
) -> None:
    """A worker with room for the template and two forks: the other repeats' forks wait for a rollout's sandbox to
    go (a fork is refused at once where a create would wait), and every row is scored, none ``sandbox_unavailable``."""
    sandboxes = {pool: {"engine": f"unix://{engine.socket_path}", "capacity": 3}}
    env = {"server": "tests.envs.seeded_box", "sandbox": pool, "seed_once": True, "options": {"setup": "true"}}
    cfg = resolve_config(load_config(config(tmp_path, env, sandboxes)))
    async with Client(cfg, nats=nats_server.url) as client:
        batch = await client.submit([seeded_box.task("a")], repeats=6)
        with anyio.fail_after(240):
            rows = await batch.gather()
    assert [(r.get("error_class"), r["reward"]) for r in rows] == [(None, 1.0)] * 6, rows


async def test_a_failed_seed_fails_every_repeat_of_its_task_typed(tmp_path: Path, nats_server: EmbeddedServer) -> None:
    """The one seed raises: each repeat's row is the environment's ``tool_error`` naming it, none a hang."""
    env = {"server": "tests.envs.seeded_ledger", "seed_once": True, "options": {"seeds": str(tmp_path / "nope")}}
    cfg = resolve_config(load_config(config(tmp_path, env)))
    (tmp_path / "nope").mkdir()  # the seed's note cannot be written: it raises
    async with Client(cfg, nats=nats_server.url) as client:
        batch = await client.submit([seeded_ledger.task("a")], repeats=REPEATS)
        with anyio.fail_after(120):
            rows = await batch.gather()
    assert len(rows) == REPEATS
    for row in rows:
        assert row["error_class"] == "tool_error" and "seed raised IsADirectoryError" in row["error"], row


def test_an_environment_that_cannot_snapshot_is_one_line_naming_the_key(tmp_path: Path) -> None:
    path = config(tmp_path, {"server": "resources.weather", "seed_once": True})
    with pytest.raises(UserError, match=r"resources\.env\.seed_once: .* cannot snapshot its sessions"):

        async def start() -> None:
            async with Client(resolve_config(load_config(path)), nats="embedded"):
                pass

        anyio.run(start)
    out = cli("start", str(path), "--nats", "nats://127.0.0.1:1")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "resources.env.seed_once" in lines[0] and "snapshot" in lines[0], out.stderr


def test_a_hosted_nemo_gym_server_with_seed_once_is_refused_as_the_config_loads(tmp_path: Path) -> None:
    path = config(tmp_path, {"nemo_gym": "mcqa", "seed_once": True})
    with pytest.raises(ConfigError, match=r"resources\.env: seed_once: a hosted NeMo Gym server"):
        load_config(path)
