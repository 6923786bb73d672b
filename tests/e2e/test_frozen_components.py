"""Gray failures (issue 77): a component frozen mid-batch with SIGSTOP (alive, doing nothing), found within 30 s
and worked around within 60 s, every row arriving once; real workers (``start`` processes) on a real nats-server,
the scripted policy as the LLM.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from gym_runtime.data.batches import Manifest, put_manifest
from gym_runtime.messages import RolloutResult
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.why import gather, render
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_streams
from tests.envs.many_steps import task
from tests.helpers import eventually, read_until, write_jsonl
from tests.pools import Pool, assert_exactly_once, publish, start_collect, wait_until

DETECT_S = 30.0  # the bounds: found within 30 s, worked around within 60 s
RECOVER_S = 60.0
STEPS = 6


def config(tmp: Path, *, delay_s: float, **agent: Any) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted", "delay_s": delay_s, "ack_wait_s": 2.0, "concurrency": 16}},
        "resources": {"env": {"server": "tests.envs.many_steps", "options": {"restorable": True}}},
        "agents": {
            "agent": {
                "agent": "agents.simple",
                "model": "policy",
                "resource": "env",
                "max_steps": STEPS + 2,
                "timeout_s": 300,
                "concurrency": 8,
                "ack_wait_s": 30.0,
                "checkpoint": "every_turn",
                **agent,
            }
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tasks(tmp: Path, n: int) -> Path:
    return write_jsonl(tmp / "tasks.jsonl", [task(STEPS, task_id=i) for i in range(n)])


def tag(pid: int) -> str:
    return f"{socket.gethostname()}/{pid}"


async def report(url: str) -> dict[str, Any]:
    bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test-frozen")
    try:
        return await gather(bus, wait_s=0.5)
    finally:
        await bus.close()


async def wait_async(holds: Any, within: float, seen: dict[str, Any]) -> None:
    """``holds()`` (async) until true, for ``within`` s; the last report in the failure's message."""
    import anyio

    try:
        with anyio.fail_after(within):
            while not await holds():
                await anyio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(render(seen["r"]) if "r" in seen else "no report") from None


def silent_lines(log: Path, process: str) -> list[str]:
    """The operator's lines (``worker.silent``) naming ``process``."""
    text = log.read_text() if log.exists() else ""
    return [line for line in text.splitlines() if "worker.silent" in line and process in line]


async def test_a_frozen_resource_workers_sessions_resume_on_the_other(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """Its sessions' calls go silent: named (its process, from the seed's reply) within 3 s of a call reaching it,
    failed as ``worker_lost`` after the bus's 10 s liveness window, and their rollouts resume on the other worker
    from the environment's snapshot (the resume table's ``restored``); the server drops the frozen client within
    20 s (it answers no ping), so no new session is seeded on it. Every row once, each step run once."""
    cfg = config(tmp_path, delay_s=2.0)
    pool = Pool(cfg, nats_server.url)
    pool.start("model", "models.policy")
    frozen_one = pool.start("env1", "resources.env")
    pool.start("env2", "resources.env")
    agent_log = tmp_path / "agent.log"
    pool.start("agent", "agents.agent", log=agent_log)
    out = tmp_path / "out.jsonl"
    stopped = False
    n = 4
    try:
        publish(cfg, nats_server.url, tasks(tmp_path, n), "b1")
        seen: dict[str, Any] = {}
        me = tag(frozen_one.pid)

        async def running() -> bool:  # every rollout has its session (on either worker) and is past its seed
            seen["r"] = r = await report(nats_server.url)
            return r["in_flight"] >= 2 * n and all(e["rollout_s"] > 3 for e in r["rollouts"])

        async def named() -> bool:
            seen["r"] = r = await report(nats_server.url)
            return any(me in x for x in r["look_at"])

        async def worked_around() -> bool:  # no call waits on it, none is late: each moved on
            seen["r"] = r = await report(nats_server.url)
            return not r["late"] and not any(e.get("by") == me for e in r["rollouts"])

        await wait_async(running, 90, seen)
        frozen_one.send_signal(signal.SIGSTOP)
        stopped, t0 = True, time.monotonic()
        await wait_async(named, DETECT_S, seen)
        found = time.monotonic() - t0
        assert "LOOK AT: resources.env process " + me in render(seen["r"])
        await wait_async(worked_around, RECOVER_S, seen)
        moved = time.monotonic() - t0
        assert moved < RECOVER_S
        collect = start_collect(nats_server.url, "b1", out)
        wait_until(lambda: collect.poll() is not None, timeout=240)
        done = time.monotonic() - t0
        assert collect.returncode == 0, collect.stderr.read() if collect.stderr else ""
        rows = assert_exactly_once(out, n)
        assert all(r["reward"] == 1.0 for r in rows), rows  # each step ran once, in the session it ended in
        resumed = [r for r in rows if r.get("resumed_how")]
        assert resumed and all(r["resumed_how"] == "restored" for r in resumed), [r.get("resumed_how") for r in rows]
        wait_until(lambda: silent_lines(agent_log, me), timeout=30)  # the operator's one line, naming it
        print(f"frozen resource worker: named {found:.1f}s, calls moved {moved:.1f}s, batch done {done:.1f}s after")
    finally:
        if stopped:
            frozen_one.send_signal(signal.SIGCONT)
        pool.stop_all()


async def test_a_frozen_agent_worker_is_named_and_its_tasks_redelivered(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """Its peer hears no beacon from it for 3.5 s: its tasks are nak'd to the live worker, and its process named in
    ``why`` and in one line; every row once (the frozen one's late results, if any, are not stored twice)."""
    cfg = config(tmp_path, delay_s=2.0, ack_wait_s=60.0, concurrency=4)
    pool = Pool(cfg, nats_server.url)
    pool.start("model", "models.policy")
    pool.start("env", "resources.env")
    frozen_one = pool.start("agent1", "agents.agent")
    peer_log = tmp_path / "agent2.log"
    pool.start("agent2", "agents.agent", log=peer_log)
    out = tmp_path / "out.jsonl"
    stopped = False
    n = 4
    try:
        publish(cfg, nats_server.url, tasks(tmp_path, n), "b2")
        seen: dict[str, Any] = {}
        me = tag(frozen_one.pid)

        async def both_running() -> bool:
            seen["r"] = r = await report(nats_server.url)
            return len({e["agent_process"] for e in r["rollouts"]}) == 2

        async def named() -> bool:
            seen["r"] = r = await report(nats_server.url)
            return any(me in x for x in r["look_at"])

        await wait_async(both_running, 90, seen)
        frozen_one.send_signal(signal.SIGSTOP)
        stopped, t0 = True, time.monotonic()
        await wait_async(named, DETECT_S, seen)
        found = time.monotonic() - t0
        assert "LOOK AT: agents.agent process " + me in render(seen["r"])
        collect = start_collect(nats_server.url, "b2", out)
        wait_until(lambda: collect.poll() is not None, timeout=240)
        done = time.monotonic() - t0
        assert collect.returncode == 0, collect.stderr.read() if collect.stderr else ""
        rows = assert_exactly_once(out, n)
        assert all(r["reward"] == 1.0 for r in rows), rows
        assert silent_lines(peer_log, me)  # the operator's one line, naming it
        assert done < RECOVER_S + 30  # redelivered at once (not after the 60 s ack_wait_s), then 7 turns of 2 s
        print(f"frozen agent worker: named {found:.1f}s, batch done {done:.1f}s after")
    finally:
        if stopped:
            frozen_one.send_signal(signal.SIGCONT)
        pool.stop_all()


async def test_a_frozen_collector_named_and_both_collects_write_every_row_once(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    """A collector is a reader of the stored results (nothing is taken from the stream for it, nothing is
    acknowledged before its file is on disk), so a frozen one holds nothing back: a second ``collect`` of the
    same output says in one line that the first is stopped, and writes every row once; the first, resumed,
    writes the same file. Before, both wrote one spool (``OUT.partial``): the second truncated the first's and
    removed it when done, so the resumed one failed (its rows read from a file that was gone) or, still
    writing beside the second, wrote rows of the other's bytes."""
    n, batch = 24, "fc"
    await ensure_streams(bus, ["agent"])
    await put_manifest(bus, Manifest(batch=batch, expected=n, tasks=n, repeats=1, agents={"agent": n}, input="-"))

    async def store(indexes: range) -> None:  # results as a batch's agent workers store them
        for i in indexes:
            row = {"task_id": i, "reward": 1.0, "_ng_task_index": i, "_ng_rollout_index": 0}
            res = RolloutResult(batch=batch, task_index=i, rollout_index=0, agent="agent", row=row)
            await bus.js_publish(bus.subjects.result("agent", batch), res, msg_id=f"{batch}:{i}:0")

    out = tmp_path / "out.jsonl"
    await store(range(8))
    first = start_collect(nats_server.url, batch, out)
    stopped = False
    try:
        stream = await bus.ensure_results_stream("agent")

        async def has_read_them() -> bool:  # its consumer was handed what is stored so far: mid-batch
            infos = await bus.js.consumers_info(stream)
            return any(i.name.startswith("collect_") and i.delivered.stream_seq >= 8 for i in infos)

        await wait_async(has_read_them, 60, {})
        first.send_signal(signal.SIGSTOP)
        stopped, t0 = True, time.monotonic()
        await store(range(8, 16))  # the batch goes on while it is frozen
        second = start_collect(nats_server.url, batch, out)
        found, said = read_until(second.stderr, f"pid {first.pid}", timeout=DETECT_S)  # type: ignore[arg-type]
        assert found and "stopped" in said, said
        named = time.monotonic() - t0
        await store(range(16, n))
        await eventually(lambda: second.poll() is not None, within=RECOVER_S)
        done = time.monotonic() - t0
        assert second.returncode == 0, said + (second.stderr.read() if second.stderr else "")
        written = out.read_bytes()
        assert_exactly_once(out, n, 1)
        first.send_signal(signal.SIGCONT)
        stopped = False
        await eventually(lambda: first.poll() is not None, within=RECOVER_S)
        assert first.returncode == 0, first.stderr.read() if first.stderr else ""
        assert_exactly_once(out, n, 1)
        assert out.read_bytes() == written  # the same rows, whichever finished last
        assert not list(tmp_path.glob("*.partial*")) and not list(tmp_path.glob("*.tmp*"))  # no spool left
        print(f"frozen collector: named {named:.1f}s, batch written by the second {done:.1f}s after the freeze")
    finally:
        for p in (first, locals().get("second")):
            if p is not None and p.poll() is None:
                if stopped and p is first:
                    p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
