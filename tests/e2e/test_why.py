"""``gym-runtime why`` and a frozen model worker: real workers (``start`` processes) on a real nats-server, the
scripted policy as the LLM (slow, so its calls are in flight), the model worker frozen with SIGSTOP.

``why`` names the frozen process (``node/pid``, as its keepalives named it) within 30 s of the freeze; with a
second replica the frozen one's calls move there and every row arrives once.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.why import gather, render
from gym_runtime.transport.bus import Bus
from tests.helpers import cli
from tests.pools import Pool, assert_exactly_once, publish, start_collect, tasks_file, wait_until

DETECT_S = 30.0  # the bound: a frozen component named within 30 s


def config(tmp: Path, *, delay_s: float, replicas: int = 1) -> Path:
    cfg = {
        "namespace": "gym",
        "models": {"policy": {"adapter": "scripted", "delay_s": delay_s, "ack_wait_s": 2.0, "concurrency": 8}},
        "resources": {"env": {"server": "resources.weather"}},
        "agents": {
            "agent": {
                "agent": "agents.simple",
                "model": "policy",
                "resource": "env",
                "max_steps": 4,
                "timeout_s": 180,
                "concurrency": 4,
                "ack_wait_s": 30.0,
            }
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tag(pid: int) -> str:
    return f"{socket.gethostname()}/{pid}"


async def report(url: str) -> dict[str, Any]:
    bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test-why")
    try:
        return await gather(bus, wait_s=0.5)
    finally:
        await bus.close()


async def test_why_names_a_frozen_model_worker_within_30_s(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    cfg = config(tmp_path, delay_s=25.0)  # a generation takes 25 s: the freeze lands mid-call
    pool = Pool(cfg, nats_server.url)
    model = pool.start("model", "models.policy")
    pool.start("env", "resources.env")
    pool.start("agent", "agents.agent")
    frozen = False
    try:
        publish(cfg, nats_server.url, tasks_file(tmp_path, 2), "b1")
        seen: dict[str, Any] = {}

        async def generating_on_the_replica() -> bool:
            seen["r"] = r = await report(nats_server.url)
            return any(e["stage"] == "generating" and e.get("by") == tag(model.pid) for e in r["rollouts"])

        async def named() -> bool:
            seen["r"] = r = await report(nats_server.url)
            return any(tag(model.pid) in x for x in r["look_at"])

        await wait_async(generating_on_the_replica, 60, seen)
        r = seen["r"]
        assert not r["late"] and not r["look_at"], render(r)  # a slow, progressing replica is not flagged
        model.send_signal(signal.SIGSTOP)
        frozen, t0 = True, time.monotonic()
        await wait_async(named, DETECT_S, seen)
        took = time.monotonic() - t0
        assert took < DETECT_S
        text = cli("why", "--nats", nats_server.url, timeout=60)
        assert text.returncode == 0, text.stderr
        assert "LOOK AT: models.policy process " + tag(model.pid) in text.stdout, text.stdout
        as_json = json.loads(cli("why", "--nats", nats_server.url, "--json", timeout=60).stdout)
        assert as_json["in_flight"] >= 1 and as_json["look_at"], as_json
        print(f"frozen model worker named after {took:.1f}s")
    finally:
        if frozen:
            model.send_signal(signal.SIGCONT)
        pool.stop_all()


async def test_a_frozen_model_replicas_calls_move_to_the_other_and_every_row_arrives_once(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """Today's liveness on a direct call (no keepalive for the model's patience: worker_lost) and the queue's
    redelivery (ack_wait_s) move a frozen replica's calls to the live one: the batch completes, once each."""
    cfg = config(tmp_path, delay_s=3.0)
    pool = Pool(cfg, nats_server.url)
    frozen_one = pool.start("model1", "models.policy")
    pool.start("model2", "models.policy")
    pool.start("env", "resources.env")
    pool.start("agent", "agents.agent")
    out = tmp_path / "out.jsonl"
    stopped = False
    try:
        n = 6
        publish(cfg, nats_server.url, tasks_file(tmp_path, n), "b2")
        seen: dict[str, Any] = {}

        async def on_the_first() -> bool:
            seen["r"] = r = await report(nats_server.url)
            return any(e.get("by") == tag(frozen_one.pid) for e in r["rollouts"])

        await wait_async(on_the_first, 60, seen)
        frozen_one.send_signal(signal.SIGSTOP)
        stopped, t0 = True, time.monotonic()
        collect = start_collect(nats_server.url, "b2", out)
        wait_until(lambda: collect.poll() is not None, timeout=240)
        took = time.monotonic() - t0
        assert collect.returncode == 0, collect.stderr.read() if collect.stderr else ""
        rows = assert_exactly_once(out, n)
        assert all("reward" in r for r in rows)
        print(f"batch of {n}x2 done {took:.1f}s after the freeze")
    finally:
        if stopped:
            frozen_one.send_signal(signal.SIGCONT)
        pool.stop_all()


async def wait_async(holds: Any, within: float, seen: dict[str, Any]) -> None:
    """``holds()`` (async) until true, for ``within`` s; the last report in the failure's message."""
    import anyio

    try:
        with anyio.fail_after(within):
            while not await holds():
                await anyio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(render(seen["r"]) if "r" in seen else "no report") from None


async def test_why_counts_the_tasks_a_frozen_agent_worker_holds(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    """A frozen agent worker answers nothing: its rollouts are the tasks its queue handed out that no answering
    worker holds, said as such within 30 s (the queue hands them out again after the agent's ack_wait_s)."""
    cfg = config(tmp_path, delay_s=25.0)
    pool = Pool(cfg, nats_server.url)
    pool.start("model", "models.policy")
    pool.start("env", "resources.env")
    agent = pool.start("agent", "agents.agent")
    frozen = False
    try:
        publish(cfg, nats_server.url, tasks_file(tmp_path, 2), "b3")
        seen: dict[str, Any] = {}

        async def running() -> bool:
            seen["r"] = r = await report(nats_server.url)
            return r["in_flight"] == 4  # 2 tasks x 2 repeats, the agent's 4 slots

        async def counted() -> bool:
            seen["r"] = r = await report(nats_server.url)
            return any(u.startswith("4 task(s) of agent agent held by workers that did not answer") for u in
                       r["unanswered"])  # fmt: skip

        await wait_async(running, 60, seen)
        assert not seen["r"]["unanswered"], render(seen["r"])
        agent.send_signal(signal.SIGSTOP)
        frozen, t0 = True, time.monotonic()
        await wait_async(counted, DETECT_S, seen)
        print(f"frozen agent worker's tasks counted after {time.monotonic() - t0:.1f}s")
    finally:
        if frozen:
            agent.send_signal(signal.SIGCONT)
        pool.stop_all()
