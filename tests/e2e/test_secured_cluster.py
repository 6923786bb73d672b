"""A secured three-node cluster (`gym-runtime server --secure DIR --cluster ...`), nodes started one after another.

No client role may create streams on a secured server, so the servers provision them as admin. On a
cluster that must give every stream, bucket and the blob store the replicas and size limits the run's
config asks for (``--config``; with none, min(3, nodes) replicas), and nodes started one at a time, each
waited for, must not wait on each other: replicated streams need the quorum that the next nodes bring.
Then the node leading the results stream is SIGKILLed mid-batch: nothing is lost.
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_runtime.ops.nats_server import free_port
from tests.cluster import stop, tasks_file, write_config
from tests.helpers import REPO, cli, node_ports, read_jsonl

NODES = 3
N_TASKS = 300
STREAMS = ("GYM_TASKS", "GYM_RESULTS_agent", "GYM_MODEL", "GYM_BLOBS_AGENT", "KV_GYM_BATCHES", "KV_GYM_CONTROL")


def _get(url: str) -> dict[str, Any]:
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@dataclass
class Node:
    name: str
    argv: list[str]
    url: str
    monitor: str
    log: Path
    proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 20.0) -> float:
        """Start it and wait for the URL line it prints once it listens; returns the seconds that took."""
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=subprocess.PIPE, stderr=self.log.open("a"), text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        assert line.strip() == self.url, f"{self.name} did not start within {timeout} s: {self.log.read_text()[-2000:]}"
        return time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL the launcher; its nats-server dies with it (parent-death signal)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class SecuredCluster:
    auth: Path
    config: Path  # the workers' and publisher's config
    nodes: list[Node] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def streams(self, node: Node | None = None) -> dict[str, dict[str, Any]]:
        """Every stream (KV buckets are streams too) as a live node's /jsz reports it, with its config."""
        for n in [node] if node else self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            data = _get(f"{n.monitor}/jsz?streams=true&config=true")
            return {s["name"]: s for a in data.get("account_details") or [] for s in a.get("stream_detail") or []}
        return {}

    def stored_results(self) -> int:
        best = -1
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                s = self.streams(n).get("GYM_RESULTS_agent")
                best = max(best, s["state"]["messages"] if s else -1)
        return best


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredCluster]:
    tmp = tmp_path_factory.mktemp("secured-cluster")
    auth = tmp / "auth"  # empty: the first server writes it, the others reuse it
    workers_config = write_config(tmp, agent_concurrency=32, delay_s=0.05)  # jetstream.replicas: 3
    # the servers' config: the run's, with size limits and no replicas (the cluster default applies)
    raw = yaml.safe_load(workers_config.read_text())
    raw["jetstream"] = {"max_age_s": 3600, "results_max_bytes": "256MB", "tasks_max_bytes": "128MB"}
    server_config = tmp / "server.yaml"
    server_config.write_text(yaml.safe_dump(raw))
    c = SecuredCluster(auth=auth, config=workers_config)
    ports = node_ports(3 * NODES)  # below the ephemeral range: no client's source port takes one meanwhile
    route_ports = ports[:NODES]
    routes = ",".join(f"nats://127.0.0.1:{p}" for p in route_ports)  # every node's, itself included
    for i in range(NODES):
        port, http = ports[NODES + i], ports[2 * NODES + i]
        name = f"s{i + 1}"
        argv = [sys.executable, "-m", "gym_runtime.cli", "server", "--secure", str(auth), "--config",
                str(server_config), "--port", str(port), "--name", name, "--cluster", "gymsec", "--cluster-port",
                str(route_ports[i]), "--routes", routes, "--http-port", str(http), "--store-dir",
                str(tmp / "store" / name)]  # fmt: skip
        c.nodes.append(Node(name, argv, f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{http}", tmp / f"{name}.log"))
    try:
        for n in c.nodes:  # one after another, each waited for, as a user in three terminals would
            c.start_s.append(n.start())
        yield c
    finally:
        for n in c.nodes:
            n.stop()


def wait_healthy(c: SecuredCluster, timeout: float = 40.0) -> float:
    """`health` (as the Slurm recipe polls it) until it says ok: the namespace is provisioned."""
    t0 = time.monotonic()
    while True:
        res = cli("health", "--nats", c.url, "--auth-dir", str(c.auth), "--timeout", "3")
        if res.returncode == 0:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, (res.stderr, [n.log.read_text()[-1500:] for n in c.nodes])
        time.sleep(0.5)


def start_workers(c: SecuredCluster, tmp_path: Path) -> subprocess.Popen[str]:
    """The config's workers in one process (their log in ``workers.log``), once they say they are ready."""
    log = tmp_path / "workers.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(c.config), "--nats", c.url,
         "--replicas", "1", "--in-process", "--auth-dir", str(c.auth)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
    )  # fmt: skip
    assert worker.stdout is not None
    if "ready" not in worker.stdout.readline():
        stop([worker])
        raise AssertionError(log.read_text()[-2000:])
    return worker


def test_nodes_started_one_after_another_provision_every_stream_at_three_replicas(secured: SecuredCluster) -> None:
    assert all(s < 15.0 for s in secured.start_s), secured.start_s  # no node waits for the next one
    healthy = wait_healthy(secured)
    print(f"nodes listening after {[round(s, 1) for s in secured.start_s]} s; healthy {healthy:.1f} s later")
    deadline = time.monotonic() + 20
    while True:  # every node sees every stream with three current replicas
        views = [secured.streams(n) for n in secured.nodes]
        ok = all(
            name in v and v[name]["config"]["num_replicas"] == 3 and len(v[name]["cluster"].get("replicas") or []) == 2
            for v in views
            for name in STREAMS
        )
        if ok:
            break
        assert time.monotonic() < deadline, {
            n: {k: v["config"]["num_replicas"] for k, v in s.items()}
            for n, s in zip([x.name for x in secured.nodes], views, strict=True)
        }
        time.sleep(0.2)
    streams = views[0]
    # the size limits of the servers' --config, not the defaults
    assert streams["GYM_RESULTS_agent"]["config"]["max_bytes"] == 256 * 1024**2
    assert streams["GYM_TASKS"]["config"]["max_bytes"] == 128 * 1024**2
    assert streams["GYM_RESULTS_agent"]["config"]["max_age"] == 3600 * 10**9  # nanoseconds
    said = "provisioned namespace gym: streams, buckets and blob store at 3 replicas"
    while not all(said in n.log.read_text() for n in secured.nodes):  # every node tried, and says so
        assert time.monotonic() < deadline + 10, [n.log.read_text()[-1000:] for n in secured.nodes]
        time.sleep(0.2)
    assert not any("stream.replicas_differ" in n.log.read_text() for n in secured.nodes)


def test_killing_the_results_leader_mid_batch_loses_nothing(secured: SecuredCluster, tmp_path: Path) -> None:
    wait_healthy(secured)
    auth = ["--auth-dir", str(secured.auth)]
    worker = start_workers(secured, tmp_path)
    collector: subprocess.Popen[str] | None = None
    try:
        tasks = tasks_file(tmp_path, N_TASKS)
        res = cli("publish", str(secured.config), "-i", str(tasks), "--nats", secured.url, "--batch", "k", *auth)
        assert res.returncode == 0, res.stderr
        out = tmp_path / "out.jsonl"
        collector = subprocess.Popen(
            [sys.executable, "-m", "gym_runtime.cli", "collect", "--batch", "k", "--nats", secured.url,
             "-o", str(out), "--no-progress", *auth],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while secured.stored_results() < N_TASKS // 5:
            assert time.monotonic() < deadline, "the batch did not get going"
            time.sleep(0.05)
        leader_name = secured.streams()["GYM_RESULTS_agent"]["cluster"]["leader"]
        victim = next(n for n in secured.nodes if n.name == leader_name)
        victim.kill()
        before = secured.stored_results()
        assert before < N_TASKS, "the batch ended before the kill: make it longer"
        killed_at = time.monotonic()
        while secured.stored_results() <= before + 10:
            assert time.monotonic() - killed_at < 20, "no rollouts completed for 20 s after the kill"
            time.sleep(0.1)
        print(f"killed {leader_name} at {before} results; rollouts again after {time.monotonic() - killed_at:.1f} s")
        victim.start()  # same store: it catches up, and provisions again (nothing to do)
        stdout, stderr = collector.communicate(timeout=120)
        assert collector.returncode == 0, stderr[-2000:]
        assert f"{N_TASKS} rows, 0 failed" in stdout, stdout
        rows = read_jsonl(out)
        assert sorted(r["task_id"] for r in rows) == list(range(N_TASKS))
        logs = (tmp_path / "workers.log").read_text() + stderr + res.stderr
        assert "stream.replicas_differ" not in logs
    finally:
        stop([p for p in (worker, collector) if p is not None])


def test_a_collector_started_while_the_cluster_has_no_quorum_waits_for_it(
    secured: SecuredCluster, tmp_path: Path
) -> None:
    """A JetStream that does not answer is waited for (said once), not an error at once: CI's loaded machine
    once took over 20 s, the window then, to elect a meta leader after a node was killed."""
    wait_healthy(secured)
    auth = ["--auth-dir", str(secured.auth)]
    up, down = secured.nodes[0], secured.nodes[1:]
    for n in down:  # one node of three: no meta leader, so no JetStream API
        n.kill()
    deadline = time.monotonic() + 60
    while (_get(f"{up.monitor}/jsz").get("meta_cluster") or {}).get("leader"):  # until it knows it leads nothing
        assert time.monotonic() < deadline, "the last node still names a meta leader"
        time.sleep(0.2)
    collector = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "collect", "--batch", "q", "--nats", up.url,
         "-o", str(tmp_path / "out.jsonl"), "--no-progress", "--wait", "120", *auth],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    worker: subprocess.Popen[str] | None = None
    try:
        assert collector.stderr is not None
        line = collector.stderr.readline()  # the wait, said once (or the error, which fails below)
        assert "jetstream.unanswered" in line, line + collector.stderr.read()[-2000:]
        said_at = time.monotonic()
        while time.monotonic() - said_at < 25:  # past the old 20 s window, the collector still waits
            assert collector.poll() is None, collector.stderr.read()[-2000:]
            time.sleep(0.2)
        for n in down:
            n.start()
        wait_healthy(secured)
        worker = start_workers(secured, tmp_path)
        tasks = tasks_file(tmp_path, 20)
        res = cli("publish", str(secured.config), "-i", str(tasks), "--nats", secured.url, "--batch", "q", *auth)
        assert res.returncode == 0, res.stderr
        stdout, stderr = collector.communicate(timeout=120)
        assert collector.returncode == 0, stderr[-2000:]
        assert "20 rows, 0 failed" in stdout, stdout
        assert "does not answer yet" not in stderr
    finally:
        for n in secured.nodes:  # the cluster whole again for the next test
            if n.proc is None or n.proc.poll() is not None:
                n.start()
        stop([p for p in (worker, collector) if p is not None])


def _server(tmp_path: Path, *argv: str) -> Any:
    """What `gym-runtime server --secure DIR ARGV...` would start, without starting it."""
    from gym_runtime.cli import build_parser
    from gym_runtime.cli.server import build

    return build(build_parser().parse_args(["server", "--secure", str(tmp_path / "auth"), *argv]))


def _routes(*ports: int) -> list[str]:
    return ["--routes", ",".join(f"nats://127.0.0.1:{p}" for p in ports)]


def test_what_a_secured_server_provisions_comes_from_replicas_then_config_then_the_cluster_size(
    tmp_path: Path,
) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text("jetstream: {max_age_s: 3600, results_max_bytes: 2GB}\n")
    two = tmp_path / "two.yaml"
    two.write_text("jetstream: {replicas: 2}\n")
    three_nodes = ["--cluster", "c", "--cluster-port", "7001", *_routes(7001, 7002, 7003)]  # itself listed
    assert _server(tmp_path).jetstream.replicas == 1  # a single server
    assert _server(tmp_path, *three_nodes).jetstream.replicas == 3
    assert _server(tmp_path, "--cluster", "c", "--cluster-port", "7001", *_routes(7002, 7003)).jetstream.replicas == 3
    assert _server(tmp_path, "--cluster", "c", "--cluster-port", "7001", *_routes(7001, 7002)).jetstream.replicas == 2
    five = ["--cluster", "c", "--cluster-port", "7001", *_routes(7001, 7002, 7003, 7004, 7005)]
    assert _server(tmp_path, *five).jetstream.replicas == 3
    srv = _server(tmp_path, *three_nodes, "--config", str(limits))  # limits from the config, replicas by default
    assert (srv.jetstream.replicas, srv.jetstream.max_age_s, srv.jetstream.results_max_bytes) == (3, 3600, "2GB")
    assert _server(tmp_path, *three_nodes, "--config", str(two)).jetstream.replicas == 2  # the config said so
    assert _server(tmp_path, *three_nodes, "--config", str(two), "--replicas", "1").jetstream.replicas == 1


def test_replicas_a_server_cannot_hold_are_one_line_and_exit_2(tmp_path: Path) -> None:
    three = tmp_path / "three.yaml"
    three.write_text("jetstream: {replicas: 3}\n")
    auth = str(tmp_path / "auth")
    cases = [
        (["--replicas", "3"], "--replicas is read for what --secure DIR provisions"),
        (["--secure", auth, "--replicas", "3"], "--replicas 3: a single server (no --cluster) cannot hold 3 replicas"),
        (["--secure", auth, "--config", str(three)], f"jetstream.replicas: 3 in {three}: a single server"),
        (["--secure", auth, "--replicas", "0"], "--replicas 0: must be between 1 and 5"),
    ]
    for argv, said in cases:
        res = cli("server", "--port", str(free_port()), *argv, timeout=60)
        assert res.returncode == 2 and said in res.stderr and len(res.stderr.strip().splitlines()) == 1, (argv, res)
