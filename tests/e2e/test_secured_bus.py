"""``server --secure``: TLS, nkey users and per-role permissions on a real nats-server.

Every attack here is tried for real against the server (no mocks): clients
without credentials or with another cluster's CA, a ``model`` forging results
and tasks, a ``publisher`` pulling or sniffing tasks. The full batch goes through
the real CLI in subprocesses, each node holding only its own roles' files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gym_runtime.config import resolve_config
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import free_port
from gym_runtime.ops.secrets import check_argv_secret
from gym_runtime.ops.security import ROLES, ensure_auth_dir, unnamed
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.connect import ServerUnreachable, connect
from gym_runtime.transport.jetstream import message_count
from gym_runtime.transport.subjects import Subjects
from tests.helpers import COMPAT, REPO, cli, node_dir, read_jsonl, read_until, write_jsonl

JUDGE_CFG = "resources/equivalence_llm_judge/config.yaml"
JUDGE_DATA = REPO / "resources/equivalence_llm_judge/data/example.jsonl"


def test_auth_dir_is_written_once_then_reused(tmp_path: Path) -> None:
    from cryptography import x509

    d = ensure_auth_dir(tmp_path / "auth")
    names = {"ca.pem", "ca-key.pem", "server.pem", "server-key.pem", *(f"{r}.creds" for r in ROLES)}
    assert {p.name for p in d.iterdir()} == names
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    for secret in ("ca-key.pem", "server-key.pem", *(f"{r}.creds" for r in ROLES)):
        assert stat.S_IMODE((d / secret).stat().st_mode) == 0o600, secret
    seeds = {before[f"{r}.creds"] for r in ROLES}
    assert len(seeds) == len(ROLES) and all(s.startswith(b"SU") for s in seeds)  # user nkey seeds, all distinct
    ensure_auth_dir(d)  # a filled dir (e.g. copied to another node) is reused as is
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    # a node given the dir without a server certificate gets its own, from the same CA
    (d / "server.pem").unlink()
    (d / "server-key.pem").unlink()
    ensure_auth_dir(d, names=["node2.cluster.example"])
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((d / "server.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "node2.cluster.example" in sans.get_values_for_type(x509.DNSName)
    assert unnamed(d, ["node2.cluster.example", "127.0.0.1", "elsewhere.example"]) == ["elsewhere.example"]
    assert (d / "ca.pem").read_bytes() == before["ca.pem"]


async def test_unauthenticated_and_foreign_clients_are_refused(secured, tmp_path: Path) -> None:
    srv, auth = secured
    other = ensure_auth_dir(tmp_path / "other-cluster")
    with pytest.raises(ServerUnreachable, match="requires TLS and credentials"):
        await connect(srv.url, name="anon", initial_timeout=5)
    with pytest.raises(ServerUnreachable, match="not signed by our CA"):  # another CA: the server is not trusted
        await connect(srv.url, name="foreign", initial_timeout=5, options=ClientAuth(other).connect_options("admin"))
    # right CA, another cluster's seed: the server refuses the nkey
    mixed = node_dir(other, tmp_path / "mixed", "admin")
    shutil.copy(auth / "ca.pem", mixed / "ca.pem")
    with pytest.raises(ServerUnreachable, match="Authorization Violation"):
        await connect(srv.url, name="mixed", initial_timeout=5, options=ClientAuth(mixed).connect_options("admin"))
    # and this cluster's own admin gets in
    nc = await connect(srv.url, name="ok", initial_timeout=5, options=ClientAuth(auth).connect_options("admin"))
    await nc.close()


async def test_a_client_with_credentials_refuses_a_server_without_tls(nats_server, tmp_path: Path) -> None:
    """No downgrade: with --auth-dir a client speaks TLS first, so a plaintext impostor gets no nonce signed."""
    auth = ensure_auth_dir(tmp_path / "auth")
    with pytest.raises(ServerUnreachable, match="TLS handshake failed"):
        await connect(
            nats_server.url, name="downgrade", initial_timeout=5, options=ClientAuth(auth).connect_options("agent")
        )


async def test_a_namespace_the_secured_server_does_not_serve_is_one_clear_error(secured) -> None:
    srv, auth = secured
    with pytest.raises(ValueError, match="does not serve namespace 'exp2'.*--namespace exp2"):
        await Bus.connect(
            srv.url,
            namespace="exp2",
            telemetry=Telemetry(),
            name="t",
            auth=ClientAuth(auth),
            role="publisher",
            initial_timeout=5,
        )


async def test_model_cannot_publish_results_or_tasks_nor_delete_streams(buses: dict[str, Bus]) -> None:
    import nats.errors

    model, admin, agent = buses["model"], buses["admin"], buses["agent"]
    names = Subjects("gym")
    forged = json.dumps({"reward": 1337}).encode()
    await model.nc.publish("gym.result.b1", forged)  # core publish: the stream would store it
    await model.nc.publish("gym.task.weather_agent", forged)
    for subject in ("gym.result.b1", "gym.task.weather_agent"):
        with pytest.raises(nats.errors.TimeoutError):  # no stream ack: the server dropped it
            await model.js.publish(subject, forged, timeout=1.0)
    with pytest.raises(nats.errors.TimeoutError):
        await model.nc.request(f"$JS.API.STREAM.DELETE.{names.tasks_stream}", b"", timeout=1.0)
    await model.flush()
    assert await message_count(admin, names.shared_results_stream) == 0
    assert await message_count(admin, names.tasks_stream) == 0
    assert (await admin.js.stream_info(names.tasks_stream)).config.name == names.tasks_stream
    # the role that may does: an agent's result is stored
    await agent.js.publish("gym.result.a.b1", b"{}", timeout=5.0)
    assert await message_count(admin, names.shared_results_stream) == 1


async def test_publisher_cannot_pull_or_sniff_tasks(buses: dict[str, Bus]) -> None:
    import anyio
    import nats.errors

    from gym_runtime.transport.jetstream import ensure_consumer

    pub, agent = buses["publisher"], buses["agent"]
    stream = Subjects("gym").tasks_stream
    seen: list[str] = []

    async def spy(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(msg.subject)

    for subject in ("gym.task.>", "_INBOX.>", "_INBOX.agent.>"):
        await pub.nc.subscribe(subject, cb=spy)  # refused by the server: nothing is ever delivered
    await ensure_consumer(agent, stream, "agent_a", "gym.task.a.>", ack_wait=30.0)
    await pub.js.publish("gym.task.a.b1", b"task-0", timeout=5.0)  # publishing tasks is the publisher's job
    req = json.dumps({"batch": 1, "expires": 1_000_000_000}).encode()

    async def pull(bus: Bus, *, expect_task: bool) -> list[bytes]:
        """A raw pull request for one task (what ``PullWorker`` sends): what arrives until the task does, if one
        is expected (an event; 30 s only fails a broken run), else within a 2 s span (a span with nothing in it:
        load only stretches it, so it never fails falsely)."""
        inbox = bus.nc.new_inbox()
        sub = await bus.nc.subscribe(inbox)
        await bus.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.agent_a", req, reply=inbox)
        got = []
        with anyio.fail_after(30) if expect_task else anyio.move_on_after(2.0):
            while True:
                m = await sub.next_msg(timeout=None)
                got.append(m)
                if m.data:
                    break
        await sub.unsubscribe()
        return got

    assert await pull(pub, expect_task=False) == []  # refused: not even a "no messages" status comes back
    with pytest.raises(nats.errors.TimeoutError):  # nor may it create a consumer of its own on the tasks
        await pub.js.add_consumer(stream, durable_name="thief", filter_subject="gym.task.a.>", timeout=1.0)
    got = await pull(agent, expect_task=True)
    msg = got[-1]
    assert msg.data == b"task-0"  # the agent gets the task the publisher could not
    await msg.ack()
    await anyio.sleep(0.3)  # a span with nothing in it (the spy hears nothing): load only stretches it
    assert seen == []


async def test_one_process_run_holds_exactly_its_roles(secured, tmp_path: Path) -> None:
    """``run --nats`` runs publisher, agent, model and resource: one connection each, no admin seed needed."""
    from gym_runtime.config import load_config
    from gym_runtime.service.runner import run_batch

    srv, auth = secured
    node = node_dir(auth, tmp_path / "node", "publisher", "agent", "model", "resource")
    cfg = load_config(REPO / "resources/weather/config.yaml")
    data = REPO / "resources/weather/data/example.jsonl"
    result = await run_batch(
        resolve_config(cfg),
        srv.url,
        input_path=data,
        out=tmp_path / "out.jsonl",
        telemetry=Telemetry(),
        auth=ClientAuth(node),
    )
    assert result.stats.failures == 0 and result.stats.rows == len(read_jsonl(data))
    assert [r["reward"] for r in read_jsonl(tmp_path / "out.jsonl")] == [1.0] * result.stats.rows
    reader = await Bus.connect(
        srv.url, namespace=cfg.namespace, telemetry=Telemetry(), name="reader", auth=ClientAuth(node), role="publisher"
    )
    model_queue = await reader.js.stream_info(Subjects(cfg.namespace).model_stream)
    await reader.close()
    assert model_queue.state.last_seq == 0  # the roles' permissions admit direct model calls: none was queued
    (node / "model.creds").unlink()  # a role whose file this node lacks: one clear error, before any work
    with pytest.raises(ValueError, match=r"no model\.creds"):
        await run_batch(
            resolve_config(cfg),
            srv.url,
            input_path=data,
            out=tmp_path / "out2.jsonl",
            telemetry=Telemetry(),
            auth=ClientAuth(node),
        )


def _start_server(tmp_path: Path, auth: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "server",
            "--secure",
            str(auth),
            "--port",
            str(port),
            "--store-dir",
            str(tmp_path / "js"),
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    assert url == f"nats://127.0.0.1:{port}", proc.stderr.read() if proc.stderr else ""
    return proc, url


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_secured_batch_across_nodes_with_judge_big_body_status_and_reverify(tmp_path: Path) -> None:
    """The secured walkthrough of docs/security.md: server, workers, publisher and re-verifier each with
    their own files."""
    auth = tmp_path / "auth"
    server, url = _start_server(tmp_path, auth, "--max-payload", "1MB")
    workers_node = node_dir(auth, tmp_path / "workers-node", "agent", "model", "resource")
    client_node = node_dir(auth, tmp_path / "client-node", "publisher")
    reverify_node = node_dir(auth, tmp_path / "reverify-node", "publisher", "resource")
    rows = read_jsonl(JUDGE_DATA)
    rows[1]["attachment"] = "x" * 1_300_000  # over the server's max payload: goes through the object store
    data = write_jsonl(tmp_path / "tasks.jsonl", rows)
    workers = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", JUDGE_CFG, "--nats", url, "--auth-dir", str(workers_node)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert workers.stdout is not None
        assert "workers ready" in workers.stdout.readline()
        pub = cli("publish", JUDGE_CFG, "-i", str(data), "--nats", url, "--auth-dir", str(client_node), "--batch", "b1")
        assert pub.returncode == 0, pub.stderr
        out = tmp_path / "out.jsonl"
        col = cli(
            "collect",
            "--batch",
            "b1",
            "--nats",
            url,
            "-o",
            str(out),
            "--no-progress",
            env={"GYM_AUTH_DIR": str(client_node)},
        )
        assert col.returncode == 0, col.stderr
        got = read_jsonl(out)
        assert len(got) == len(rows) and not (tmp_path / "out_failures.jsonl").exists()
        assert len(got[1]["attachment"]) == 1_300_000
        for row in got:
            assert row["reward"] == 0.0  # the scripted judge never says [[A=B]]
            assert row["judge_evaluations"], "the resource's judge call (resource -> model) did not happen"
        status = cli("status", "--nats", url, "--json", "--auth-dir", str(client_node))
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert {w["role"] for w in report["workers"]} >= {"agent", "model", "resource"}
        assert report["results_stored"] == len(rows)
        re_out = tmp_path / "re.jsonl"
        rev = cli(
            "reverify", JUDGE_CFG, "-i", str(out), "-o", str(re_out), "--nats", url, "--auth-dir", str(reverify_node)
        )
        assert rev.returncode == 0, rev.stderr + rev.stdout
        assert [r["reward"] for r in read_jsonl(re_out)] == [r["reward"] for r in got]
    finally:
        _stop(workers)
        _stop(server)
    assert workers.returncode == 0


@pytest.mark.parametrize("command", ["publish", "status", "collect", "run", "reverify"])
def test_wrong_credentials_exit_2_within_15s(command: str, secured, tmp_path: Path) -> None:
    srv, _ = secured
    other = ensure_auth_dir(tmp_path / "other-cluster")
    args = {
        "publish": ["publish", JUDGE_CFG, "-i", str(JUDGE_DATA)],
        "status": ["status"],
        "collect": ["collect", "--batch", "b1", "-o", str(tmp_path / "o.jsonl")],
        "run": ["run", JUDGE_CFG, "-i", str(JUDGE_DATA), "-o", str(tmp_path / "o.jsonl")],
        "reverify": [
            "reverify",
            JUDGE_CFG,
            "-i",
            str(COMPAT / "equivalence_llm_judge/example_rollouts.jsonl"),
            "-o",
            str(tmp_path / "o.jsonl"),
        ],
    }[command]
    t0 = time.monotonic()
    # a connect timeout of 2 minutes: a command that took the refusal for a server not up yet would retry until
    # then, so giving up in under one minute is the refusal read as final, whatever the machine's load
    res = cli(*args, "--nats", srv.url, "--auth-dir", str(other), timeout=180, env={"GYM_CONNECT_TIMEOUT_S": "120"})
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr
    assert took < 60, f"{command} took {took:.1f}s to give up"
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert srv.url in lines[0] and "certificate" in lines[0]


def test_start_keeps_retrying_a_refusing_server_quietly(secured, tmp_path: Path) -> None:
    srv, auth = secured
    wrong = node_dir(ensure_auth_dir(tmp_path / "other-cluster"), tmp_path / "wrong", "model")
    shutil.copy(auth / "ca.pem", wrong / "ca.pem")  # the right CA, the wrong seed: refused on every attempt
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "start",
            JUDGE_CFG,
            "--only",
            "models.policy",
            "--nats",
            srv.url,
            "--auth-dir",
            str(wrong),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        refused, said = read_until(proc.stderr, "Authorization Violation", timeout=120)  # the first refusal
        assert refused, said
        time.sleep(3)  # the claim is about a span of time: ~12 more refused attempts, none of them said
        assert proc.poll() is None, "a service must keep retrying"
    finally:
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    refusals = [line for line in (said + err).splitlines() if "Authorization Violation" in line]
    assert len(refusals) == 1, err  # said once
    assert "workers ready" not in out


def test_literal_secrets_on_the_command_line_are_refused(tmp_path: Path) -> None:
    res = cli(
        "run",
        JUDGE_CFG,
        "-i",
        str(JUDGE_DATA),
        "-o",
        str(tmp_path / "o.jsonl"),
        "--set",
        "models.policy.api_key=sk-live-0123456789",
    )
    assert res.returncode == 2 and "sk-live" not in res.stderr
    assert "${MY_VAR}" in res.stderr and "env.yaml" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("status", "--nats", "nats://gym:hunter2@127.0.0.1:4222")
    assert res.returncode == 2 and "hunter2" not in res.stderr and "--auth-dir" in res.stderr
    # a reference to the environment is what we ask for: it passes the check (and fails later, on the input)
    res = cli(
        "run",
        JUDGE_CFG,
        "-i",
        str(tmp_path / "missing.jsonl"),
        "-o",
        str(tmp_path / "o.jsonl"),
        "--set",
        "models.policy.adapter=openai",
        "--set",
        "models.policy.api_key=${POLICY_API_KEY}",
        env={"POLICY_API_KEY": "sk-env"},
    )
    assert res.returncode == 2 and "file not found" in res.stderr and "every local user" not in res.stderr
    for ok in (
        "models.policy.model=gpt-4.1",
        "models.policy.api_key=${KEY}",
        "agents.a.max_steps=3",
        "models.policy.max_tokens=512",
        "resources.r.options.stop_token=[DONE]",
        "models.x.headers.Authorization=Bearer ${TOKEN}",
        "models.x.base_url=https://host/v1",
    ):
        check_argv_secret("--set", ok)
    for bad in (
        "resources.r.options.access_token=abc",
        "models.judge.api_key=EMPTY-but-literal",
        "models.x.headers.Authorization=Bearer abc",
        "models.x.headers.api-key=abc",
        "models.x.temperature=sk-0123456789",
        "models.x.base_url=https://u:p@host/v1",
    ):
        with pytest.raises(ValueError):
            check_argv_secret("--set", bad)


def test_start_children_get_no_secret_in_argv(nats_server, tmp_path: Path) -> None:
    """A URL with credentials in the config never reaches the worker processes' command lines."""
    import psutil

    url = nats_server.url.replace("nats://", "nats://gym:s3cret-pw@")
    cfg = tmp_path / "config.yaml"
    cfg.write_text((REPO / "resources/weather/config.yaml").read_text().replace("nats: embedded", f"nats: {url}"))
    assert f"nats: {url}" in cfg.read_text()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(cfg), "--only", "models.policy", "--replicas", "2"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "POLICY_API_KEY": "sk-env-only"},
    )
    try:
        assert proc.stdout is not None
        assert "workers ready (2 processes)" in proc.stdout.readline()
        children = psutil.Process(proc.pid).children()
        assert len(children) == 2
        for c in [psutil.Process(proc.pid), *children]:
            cmdline = " ".join(c.cmdline())
            assert "s3cret" not in cmdline and "sk-env-only" not in cmdline, cmdline
    finally:
        _stop(proc)


def test_routes_between_nodes_are_tls_authenticated_by_the_cluster_ca(tmp_path: Path) -> None:
    """Two nodes with the same DIR form a cluster over TLS routes; a node with another CA cannot join."""
    import anyio

    from gym_runtime.ops.nats_server import find_binary
    from gym_runtime.ops.permissions import route_tls, server_config

    auth, other = ensure_auth_dir(tmp_path / "auth"), ensure_auth_dir(tmp_path / "other")
    procs: list[subprocess.Popen[bytes]] = []

    def node(name: str, d: Path, peer: str, ports: dict[str, tuple[int, int]]) -> str:
        client, route = ports[name]
        conf = tmp_path / f"{name}.conf"
        cluster = {
            "name": "gym",
            "listen": f"127.0.0.1:{route}",
            "tls": route_tls(d),
            "routes": [f"nats-route://127.0.0.1:{ports[peer][1]}"],
        }
        conf.write_text(
            f'server_name: {name}\nlisten: "127.0.0.1:{client}"\n'
            + server_config(d, ["gym"])
            + f"cluster: {json.dumps(cluster)}\n"
        )
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen([find_binary(), "-c", str(conf)], stdout=log, stderr=log))
        return f"nats://127.0.0.1:{client}"

    def listening(proc: subprocess.Popen[bytes], url: str, name: str) -> bool:
        """Whether the node came up (False: it lost a port picked free to another process, and is retried)."""
        port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                return True
            time.sleep(0.05)
        log = (tmp_path / f"{name}.log").read_text(errors="replace")
        assert "address already in use" in log, f"node {name} did not start:\n{log[-2000:]}"
        return False

    for _ in range(5):
        ports = {n: (free_port(), free_port()) for n in ("a", "b", "c")}
        urls = node("a", auth, "b", ports), node("b", auth, "a", ports), node("c", other, "a", ports)
        if all(listening(p, u, n) for p, u, n in zip(procs, urls, "abc", strict=True)):
            break
        for p in procs:
            p.kill()
            p.wait()
        procs.clear()
    else:
        pytest.fail("five tries of free ports were each taken by another process before the nodes bound them")
    url_a, url_b, url_c = urls

    async def check() -> None:
        nc_a = await connect(url_a, name="a", initial_timeout=10, options=ClientAuth(auth).connect_options("admin"))
        nc_b = await connect(url_b, name="b", initial_timeout=10, options=ClientAuth(auth).connect_options("admin"))
        nc_c = await connect(url_c, name="c", initial_timeout=10, options=ClientAuth(other).connect_options("admin"))
        got: list[bytes] = []

        async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
            got.append(msg.data)

        await nc_a.subscribe("probe", cb=on_msg)
        await nc_a.flush()
        with anyio.fail_after(20):  # the route comes up (TLS both ways) and carries b's message to a
            while b"from-b" not in got:
                await nc_b.publish("probe", b"from-b")
                await anyio.sleep(0.2)
        for _ in range(10):
            await nc_c.publish("probe", b"from-c")
        await anyio.sleep(1.0)  # a span with nothing in it: load only stretches it, never fails a sound run
        assert b"from-c" not in got  # c's route was refused: its certificate is from another CA
        for nc in (nc_a, nc_b, nc_c):
            await nc.close()

    try:
        anyio.run(check)
    finally:
        for p in procs:
            p.kill()
            p.wait()


async def test_secured_workers_ride_out_a_server_restart(secured, tmp_path: Path) -> None:
    """Reconnects go through TLS first and the nkey again; the restarted server re-provisions idempotently."""
    import anyio

    from gym_runtime.config import load_config
    from gym_runtime.service.runner import run_batch, serve

    srv, auth = secured
    cfg = resolve_config(load_config(REPO / "resources/weather/config.yaml"))
    workers_node = node_dir(auth, tmp_path / "workers", "agent", "model", "resource")
    client_node = node_dir(auth, tmp_path / "client", "publisher")
    ready = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(
                cfg, srv.url, only=None, telemetry=Telemetry(), auth=ClientAuth(workers_node), ready=ready.set
            )
        )
        with anyio.fail_after(30):
            await ready.wait()
        srv.kill()
        await anyio.sleep(1.0)
        await anyio.to_thread.run_sync(srv.start)  # same port, store and auth dir
        with anyio.fail_after(60):
            result = await run_batch(
                cfg,
                srv.url,
                input_path=REPO / "resources/weather/data/example.jsonl",
                out=tmp_path / "out.jsonl",
                telemetry=Telemetry(),
                auth=ClientAuth(client_node),
                start_local_workers=False,
            )
        tg.cancel_scope.cancel()
    assert result.stats.failures == 0 and [r["reward"] for r in read_jsonl(tmp_path / "out.jsonl")] == [1.0] * 5
