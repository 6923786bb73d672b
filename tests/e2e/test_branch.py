"""Branch a rollout at turn k into M continuations (issue 78, item 3): real nats-server, every worker in this
process (``Client``), the simple agent on ``tests/envs/many_steps.py`` (one tool call a turn; with ``restorable`` it
snapshots each step's count) and the scripted policy (a TEST DOUBLE for the LLM, with token ids).

A parent submitted with ``keep_checkpoints_s`` keeps its checkpoint, a part per turn, after its row; a branch at
turn k restores a session of its own from the snapshot kept at k and runs the rest: its reward is 1 only when every
step ran exactly once in its session (the prefix's steps carried by the restore, its own run once there, none seen
by a sibling). Only the parent's own agent pool branches it; a branch point none can take up is one
``invalid_task`` row naming why; the kept parts go by their TTL. A rollout whose session holds sandboxes:
tests/e2e/test_branch_boxes.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from gym_runtime import Client
from gym_runtime.errors import ClientError
from gym_runtime.rollout.checkpoint import Checkpointer, checkpoints_kv
from gym_runtime.transport.subjects import Subjects
from tests.envs.many_steps import task
from tests.helpers import cli, write_jsonl

STEPS = 6  # model turns with a tool call each, then a last one that answers
AT = 3  # the branch point: after the third turn's call was answered
KEEP_S = 600.0
DEAD = "nats://127.0.0.1:1"  # no server: a flag's mistake is said before one is reached


def config(tmp: Path) -> Path:
    """Agents ``a`` and ``b`` (two pools) on the restorable environment, ``plain`` on one that keeps no snapshot."""
    agent = {"agent": "agents.simple", "model": "policy", "timeout_s": 120, "checkpoint": "off", "concurrency": 4}
    raw: dict[str, Any] = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted", "token_ids": True, "concurrency": 8}},
        "resources": {
            "env": {"server": "tests.envs.many_steps", "options": {"restorable": True}},
            "bare": {"server": "tests.envs.many_steps"},
        },
        "agents": {
            "a": {**agent, "resource": "env"},
            "b": {**agent, "resource": "env"},
            "plain": {**agent, "resource": "bare"},
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


async def parent(client: Client, agent: str = "a", keep_s: float | None = KEEP_S) -> tuple[str, dict[str, Any]]:
    """One rollout of ``STEPS`` steps by ``agent``, kept for branching ``keep_s``: its key and its row."""
    handle = await client.submit([task(STEPS)], agent=agent, keep_checkpoints_s=keep_s)
    with anyio.fail_after(120):
        (row,) = await handle.gather()
    assert row["reward"] == 1.0, row
    return f"{handle.batch}:0:0", row


async def branches(client: Client, row: dict[str, Any], key: str, m: int, **kw: Any) -> list[dict[str, Any]]:
    handle = await client.branch(row, parent=key, turn=kw.pop("turn", AT), m=m, **kw)
    with anyio.fail_after(120):
        groups = [g async for g in handle.groups()]
    assert len(groups) == 1 and len(groups[0]) == m, groups  # a branch point's rows: one group
    return sorted(groups[0], key=lambda r: r["_ng_rollout_index"])


def generations(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in row["response"]["output"] if i.get("generation_token_ids")]


def up_to_turn(row: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    """The trajectory's items up to the end of model turn ``turn``'s tool outputs."""
    out, gens = row["response"]["output"], 0
    for n, item in enumerate(out):
        if item.get("generation_token_ids"):
            gens += 1
            if gens == turn + 1:
                return out[:n]
    raise AssertionError(f"fewer than {turn + 1} generations")


async def test_a_rollout_is_branched_only_by_its_own_agent_pool(nats_server, tmp_path: Path) -> None:
    """The attack: pool ``b`` names pool ``a``'s rollout (its key is in every row, an id is a name): nothing is
    found under ``b``'s keys, so nothing of ``a``'s session or trajectory is taken; ``a`` itself branches it."""
    async with Client(config(tmp_path), nats=nats_server.url) as client:
        key, row = await parent(client)
        stolen = await branches(client, row, key, 2, agent="b")
        for r in stolen:
            assert r["error_class"] == "invalid_task" and (r["branch_of"], r["branch_turn"]) == (key, AT), r
            assert f"no checkpoint of rollout {key} at turn {AT} is kept for agent b" in r["error"], r["error"]
            assert "counts" not in r  # never ran in a session restored from a's snapshot
        own = await branches(client, row, key, 2, agent="a")
        assert [r["reward"] for r in own] == [1.0, 1.0], own


async def test_branches_share_the_prefix_token_for_token_each_in_its_own_session(nats_server, tmp_path: Path) -> None:
    async with Client(config(tmp_path), nats=nats_server.url) as client:
        key, row = await parent(client)
        # kept after its row: each part still there (the row deleted none)
        kv = await checkpoints_kv(client.bus, 3600.0)
        rollout = Subjects.checkpoint_key("a", key.split(":")[0], 0, 0)
        for part in range(1, STEPS + 1):
            assert await kv.get(Subjects.checkpoint_part(rollout, part)) is not None, part
        rows = await branches(client, row, key, 3)
    prefix = up_to_turn(row, AT)
    for r in rows:
        assert (r["branch_of"], r["branch_turn"]) == (key, AT)
        assert "resumed_how" not in r  # a branch is not a resumed attempt
        # every step once in its session: the prefix's from the restored snapshot, its own run there (a session
        # shared with a sibling, or a fresh one, would count some twice or miss the prefix's)
        assert r["reward"] == 1.0 and set(r["counts"].values()) == {1}, r["counts"]
        assert up_to_turn(r, AT) == prefix  # the same items, token ids and all, up to the branch point
        gens = generations(r)
        assert len(gens) == STEPS + 1
        for before, after in zip(gens, gens[1:], strict=False):  # its own turns go on from the prefix's ids
            seen = before["prompt_token_ids"] + before["generation_token_ids"]
            assert after["prompt_token_ids"][: len(seen)] == seen


async def test_a_branch_point_none_can_take_up_is_one_clear_error(nats_server, tmp_path: Path) -> None:
    async with Client(config(tmp_path), nats=nats_server.url) as client:
        with pytest.raises(ClientError, match="'batch:task_index:rollout_index'"):
            await client.branch(task(STEPS), parent="nokey", turn=AT, m=2)
        with pytest.raises(ClientError, match="keep_checkpoints_s must be > 0"):
            await client.submit([task(STEPS)], keep_checkpoints_s=-1)
        unkept, row = await parent(client, keep_s=None)  # deleted with its row
        kept, _ = await parent(client)
        plain, plain_row = await parent(client, agent="plain")  # its environment keeps no snapshot
        for key, turn, agent, says in [
            (unkept, AT, "a", f"no checkpoint of rollout {unkept} at turn {AT}"),
            (kept, STEPS + 1, "a", f"no checkpoint of rollout {kept} at turn {STEPS + 1}"),  # its last: no call
            (plain, AT, "plain", "the session of bare kept no snapshot"),
        ]:
            (r,) = await branches(client, plain_row if agent == "plain" else row, key, 1, turn=turn, agent=agent)
            assert r["error_class"] == "invalid_task" and says in r["error"], r


async def test_kept_checkpoints_go_by_their_ttl(nats_server, tmp_path: Path) -> None:
    async with Client(config(tmp_path), nats=nats_server.url) as client:
        key, row = await parent(client, keep_s=1.0)
        kv = await checkpoints_kv(client.bus, 3600.0)
        rollout = Subjects.checkpoint_key("a", key.split(":")[0], 0, 0)
        with anyio.fail_after(60):  # each part 1 s from its write: reaped by the server, nothing deleted them
            for part in range(1, STEPS + 1):
                while await kv.get(Subjects.checkpoint_part(rollout, part)) is not None:
                    await anyio.sleep(0.1)
        (r,) = await branches(client, row, key, 1)
        assert r["error_class"] == "invalid_task" and "no checkpoint" in r["error"], r


async def test_publish_keeps_and_branches_a_rollout(nats_server, tmp_path: Path) -> None:
    """``publish --keep-checkpoints`` keeps a rollout for branching, ``publish --branch B:T:R --turn K --repeats M``
    branches it (its one row the input); a mistake in the flags is one line and exit 2, said before connecting."""
    path = config(tmp_path)
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [{**task(STEPS), "agent_ref": {"name": "a"}}])
    for flags, says in [
        (["--branch", "b:0:0"], "--branch b:0:0 needs --turn K"),
        (["--branch", "b:x:0", "--turn", "2"], "--branch: parent 'b:x:0' is not a rollout key"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints: keep_checkpoints_s must be > 0"),
    ]:
        res = await anyio.to_thread.run_sync(
            lambda f=flags: cli("publish", str(path), "-i", str(tasks), "--nats", DEAD, *f)
        )
        assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
        assert says in res.stderr, res.stderr
    async with Client(path, nats=nats_server.url):  # the workers

        def publish(*flags: str) -> None:
            res = cli("publish", str(path), "-i", str(tasks), "--nats", nats_server.url, *flags)
            assert res.returncode == 0, res.stderr

        def collect(batch: str) -> list[dict[str, Any]]:
            out = tmp_path / f"{batch}.jsonl"
            res = cli("collect", "--batch", batch, "--nats", nats_server.url, "-o", str(out), "--no-progress")
            assert res.returncode == 0, res.stderr
            return [json.loads(line) for line in out.read_text().splitlines()]

        await anyio.to_thread.run_sync(lambda: publish("--batch", "p", "--keep-checkpoints", "600"))
        (row,) = await anyio.to_thread.run_sync(lambda: collect("p"))
        assert row["reward"] == 1.0, row
        await anyio.to_thread.run_sync(
            lambda: publish("--batch", "q", "--branch", "p:0:0", "--turn", "2", "--repeats", "2")
        )
        rows = await anyio.to_thread.run_sync(lambda: collect("q"))
    assert sorted((r["branch_of"], r["branch_turn"], r["reward"]) for r in rows) == [("p:0:0", 2, 1.0)] * 2, rows


async def test_a_live_rollout_is_branched_while_it_runs(nats_server, tmp_path: Path) -> None:
    """The parent still running (the policy slowed to 1 s a call: 4 s of turns left after the branch point):
    once its turn-``AT`` part is stored, a branch of it runs and ends while the parent goes on in its own session;
    both score (each step once in each)."""
    path = config(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["models"]["policy"]["delay_s"] = 1.0
    path.write_text(yaml.safe_dump(raw))
    async with Client(path, nats=nats_server.url) as client:
        handle = await client.submit([task(STEPS)], agent="a", keep_checkpoints_s=KEEP_S)
        key = Subjects.checkpoint_key("a", handle.batch, 0, 0)
        with anyio.fail_after(120):
            while await Checkpointer(client.bus, key, "off").at_turn(AT) is None:
                await anyio.sleep(0.05)
        parent_row = task(STEPS) | {"agent_ref": {"name": "a"}}
        assert not handle.done  # still running
        branch = await client.branch(parent_row, parent=f"{handle.batch}:0:0", turn=AT, m=1)
        with anyio.fail_after(120):
            (row,) = await branch.gather()
            (parent,) = await handle.gather()
        assert row["reward"] == 1.0 and row["branch_turn"] == AT, row
        assert parent["reward"] == 1.0 and set(parent["counts"].values()) == {1}, parent["counts"]
