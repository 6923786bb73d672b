"""Exit codes and messages a scheduler can trust: real CLI processes, a real nats-server.

server port taken -> 2; start exits 1 when a role cannot start; a wrong URL is
reported within 15 s; the supervisor's workers die with it; `health` for probes;
`purge` / `collect --purge`; collect says when an agent has no worker.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import anyio
import psutil
import pytest
import yaml

from gym_runtime.nemo_gym.hosting.env import VERIFIERS_MIN_PYTHON, VERIFIERS_PYTHON_ENV, EnvError, find_python
from gym_runtime.ops.nats_server import EmbeddedServer, free_port
from gym_runtime.plugins import bundled_environments
from tests.helpers import REPO, cli, read_jsonl, read_until
from tests.pools import N_RESULTS, publish_results, tasks_file, write_config


def popen(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", *args],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_server_with_its_port_taken_exits_2_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = cli("server", "--port", str(port), "--store-dir", str(tmp_path / "js"), timeout=30)
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"gym-runtime: error: client port 127.0.0.1:{port} is already in use (another server running?): give a "
        "free port, e.g. --port "
    ), lines


def test_routes_without_cluster_is_a_usage_error() -> None:
    res = cli("server", "--routes", "nats://127.0.0.1:6222", timeout=30)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--routes needs --cluster NAME" in res.stderr


def test_clustered_server_serves_monitoring_on_loopback_and_stops_on_sigterm(tmp_path: Path) -> None:
    port, http, route = free_port(), free_port(), free_port()
    proc = popen(
        "server",
        "--port",
        str(port),
        "--http-port",
        str(http),
        "--cluster",
        "c1",
        "--cluster-port",
        str(route),
        "--routes",
        f"nats://127.0.0.1:{route}",
        "--name",
        "solo",
        "--store-dir",
        str(tmp_path / "js"),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"nats://127.0.0.1:{port}"
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/varz", timeout=5) as r:
            varz = json.loads(r.read())
        assert varz["server_name"] == "solo" and varz["cluster"]["name"] == "c1"
        assert varz["cluster"]["addr"] == "127.0.0.1" and varz["cluster"]["cluster_port"] == route
        assert varz["http_host"] == "127.0.0.1" and varz["http_port"] == http
        assert varz["jetstream"]["config"].get("sync_always") is True  # acknowledged means on disk, by default
        conf = (tmp_path / "js" / "nats-server.conf").read_text()
        assert 'http: "127.0.0.1:%d"' % http in conf
    finally:
        proc.send_signal(signal.SIGTERM)
        # 0.5 s alone; once past 15 s in CI's fresh-clone suite (4 xdist workers beside it): the bound is for
        # a hang, the exit code is what the test checks
        assert proc.wait(60) == 0


def test_start_exits_non_zero_when_a_role_cannot_start(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    config = write_config(tmp_path, resource="tests.envs.no_such_module")
    res = cli(
        "start", str(config), "--nats", nats_server.url, "--only", "resources.env", "--replicas", "2", timeout=120
    )
    assert res.returncode == 2  # a user mistake (a module that does not exist): said before any child starts
    assert res.stderr.count("no such resource module 'tests.envs.no_such_module'") == 1, res.stderr[-3000:]


def test_start_with_a_wrong_url_says_so_within_15_s(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    proc = popen(
        "start", str(config), "--nats", f"nats://127.0.0.1:{free_port()}", "--only", "agents.agent", "--in-process"
    )
    try:
        found, seen = read_until(proc.stderr, "nats.unreachable", 15.0)
        assert found, seen
    finally:
        proc.kill()
        proc.wait()


def test_start_takes_a_list_of_urls_and_its_workers_die_with_it(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    config = write_config(tmp_path)
    raw = yaml.safe_load(config.read_text())
    raw["nats"] = [f"nats://127.0.0.1:{free_port()}", nats_server.url]  # a dead node first, then a live one
    config.write_text(yaml.safe_dump(raw))
    proc = popen("start", str(config), "--only", "resources.env", "--replicas", "2")
    try:
        found, seen = read_until(proc.stdout, "workers ready (2 processes)", 60.0)
        assert found, seen
        children = psutil.Process(proc.pid).children()
        assert len(children) == 2
        proc.send_signal(signal.SIGKILL)  # the supervisor dies without a chance to stop anyone
        proc.wait(10)
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"workers outlived their supervisor: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_health_for_liveness_and_readiness(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    ok = cli("health", "--nats", nats_server.url, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr
    not_ready = cli("health", "--nats", nats_server.url, "--role", "agents.agent", timeout=60)
    assert not_ready.returncode == 1
    assert not_ready.stderr.strip() == "gym-runtime: error: unhealthy: agents.agent: 0 worker(s) registered, need 1"
    config = write_config(tmp_path)
    worker = popen("start", str(config), "--nats", nats_server.url, "--only", "agents.agent", "--in-process")
    try:
        assert worker.stdout is not None and "ready" in worker.stdout.readline()
        ready = cli("health", "--nats", nats_server.url, "--role", "agents.agent", timeout=60)
        assert ready.returncode == 0, ready.stderr
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    down = cli("health", "--nats", f"nats://127.0.0.1:{free_port()}", "--timeout", "1", timeout=60)
    assert down.returncode == 1 and "unhealthy: cannot reach a NATS server" in down.stderr
    bad = cli("health", "--nats", nats_server.url, "--role", "agent", timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_collect_purge_frees_the_batch_and_purge_reports_counts(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    n = N_RESULTS
    anyio.run(lambda: publish_results(nats_server.url, range(n), manifest=True))
    out = tmp_path / "out.jsonl"
    first = cli("collect", "--batch", "long", "--nats", nats_server.url, "-o", str(out), "--no-progress", timeout=120)
    assert first.returncode == 0, first.stderr
    again = cli(
        "collect",
        "--batch",
        "long",
        "--nats",
        nats_server.url,
        "-o",
        str(tmp_path / "again.jsonl"),
        "--no-progress",
        "--purge",
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again.jsonl").read_bytes() == out.read_bytes()  # kept until purged: a rerun is the same
    gone = cli(
        "collect",
        "--batch",
        "long",
        "--nats",
        nats_server.url,
        "-o",
        str(tmp_path / "x.jsonl"),
        "--wait",
        "0",
        timeout=60,
    )
    assert gone.returncode == 2 and "no batch 'long'" in gone.stderr
    anyio.run(lambda: publish_results(nats_server.url, range(n, n + 5), manifest=True))  # new ids: no dedupe
    res = cli("purge", "--batch", "long", "--nats", nats_server.url, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "batch long: purged 5 results"
    assert len(read_jsonl(out)) == n


def test_collect_says_when_an_agent_has_no_worker(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    config = write_config(tmp_path)
    worker = popen("start", str(config), "--nats", nats_server.url, "--only", "agents.agent", "--in-process")
    assert worker.stdout is not None and "ready" in worker.stdout.readline()
    worker.send_signal(signal.SIGTERM)  # the agent pool went away; its durable queue stays
    assert worker.wait(30) == 0
    res = cli(
        "publish", str(config), "-i", str(tasks_file(tmp_path, 2)), "--nats", nats_server.url, "--batch", "lonely"
    )
    assert res.returncode == 0, res.stderr
    proc = popen("collect", "--batch", "lonely", "--nats", nats_server.url, "-o", str(tmp_path / "o.jsonl"))
    try:
        found, seen = read_until(proc.stderr, "no worker serves agent 'agent'", 20.0)
        assert found, seen
    finally:
        proc.kill()
        proc.wait()
    status = cli("status", "--nats", nats_server.url, timeout=60)
    assert "agent_agent: pending=2 ack_pending=0 redelivered=0 waiting_pulls=0  NO WORKERS" in status.stdout


def run_weather_with(tmp_path: Path, setting: str) -> subprocess.CompletedProcess[str]:
    """``gym-runtime run`` on weather's example rows with one ``--set``."""
    return cli(
        "run",
        str(REPO / "resources/weather/config.yaml"),
        "-i",
        str(REPO / "resources/weather/data/example.jsonl"),
        "-o",
        str(tmp_path / "o.jsonl"),
        "--set",
        setting,
        "--no-progress",
        timeout=120,
    )


def test_three_replicas_on_one_server_is_one_clear_error(tmp_path: Path) -> None:
    res = run_weather_with(tmp_path, "jetstream.replicas=3")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "gym-runtime: error: stream GYM_TASKS: jetstream.replicas=3 was refused by the server (replicas > 1 not "
        "supported in non-clustered mode); it needs a NATS cluster of at least 3 nodes "
        "(gym-runtime server --cluster NAME --routes ...)"
    ]


def test_a_max_bytes_the_server_cannot_reserve_is_one_clear_error(tmp_path: Path) -> None:
    """JetStream reserves every stream's max_bytes on the server's disk: more than it has is the config's
    mistake (a 20GB deploy config on a small disk failed CI with a traceback)."""
    res = run_weather_with(tmp_path, "jetstream.max_bytes=100000GB")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gym-runtime: error: stream GYM_"), lines
    assert "cannot reserve jetstream.max_bytes" in lines[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "o.jsonl").exists() or not (tmp_path / "o.jsonl").read_text()


def test_a_missing_input_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    res = cli("run", "weather", "-i", str(missing), "-o", str(tmp_path / "out.jsonl"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"gym-runtime: error: {missing}: file not found; give -i the path of a JSONL file of task rows (a bundled "
        "environment's are its data/example.jsonl: `gym-runtime run weather` runs them) (nothing was published)"
    ]
    assert not (tmp_path / "out.jsonl").exists()


HARBOR_TASK = REPO / "tests" / "harbor_tasks"


def test_parity_harbor_names_a_mistyped_path_before_the_engine(tmp_path: Path) -> None:
    """The user's own arguments come first: a typo in the task path is named as such, whether the engine is
    missing (DOCKER_HOST empty) or its socket is dead; nothing is built."""
    typo = tmp_path / "harbor_taks"
    for host in ("", f"unix://{tmp_path / 'dead.sock'}"):
        res = cli("parity", "--harbor", str(typo), env={"DOCKER_HOST": host}, timeout=60)
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip().splitlines() == [
            f"gym-runtime: error: {typo}: no such directory; give a task folder (task.toml, instruction.md, "
            "environment/Dockerfile, tests/test.sh; solution/solve.sh for parity) or a folder of them"
        ], host


def test_parity_harbor_with_no_engine_answering_is_one_line(tmp_path: Path) -> None:
    """Good arguments, an engine that does not answer: one line naming the socket, no traceback."""
    dead = tmp_path / "dead.sock"
    res = cli("parity", "--harbor", str(HARBOR_TASK), env={"DOCKER_HOST": f"unix://{dead}"}, timeout=60)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, lines
    assert lines[0].startswith("gym-runtime: error: parity --harbor: the container engine does not answer")
    assert str(dead) in lines[0]
    res = cli("parity", "--harbor", str(HARBOR_TASK), env={"DOCKER_HOST": "tcp://127.0.0.1:9"}, timeout=60)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "gym-runtime: error: parity --harbor: DOCKER_HOST: only unix sockets are supported, not "
        "'tcp://127.0.0.1:9' (the engine stays on this machine)"
    ], res.stderr


@pytest.mark.parametrize("harbor", [False, True])
def test_parity_keep_that_is_not_a_directory_is_one_line_before_anything_is_built(tmp_path: Path, harbor: bool) -> None:
    """``--keep`` a file, or a path under one: one line and exit 2, before an environment is built or an engine
    is asked (the cache is empty and no engine is set: either would be a different line)."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    server = ["--harbor", str(HARBOR_TASK)] if harbor else ["mcqa"]
    env = {"GYM_ENV_CACHE": str(tmp_path / "cache"), "DOCKER_HOST": ""}
    for keep, why in ((a_file, "not a directory"), (a_file / "sub", "cannot create it (Not a directory)")):
        res = cli("parity", *server, "--keep", str(keep), env=env, timeout=60)
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip().splitlines() == [f"gym-runtime: error: --keep {keep}: {why}"]
    assert a_file.read_text() == "mine\n"
    assert not (tmp_path / "cache").exists()


def offline_index(tmp_path: Path, *versions: str) -> dict[str, str]:
    """pip pointed at a local simple index listing verifiers ``versions`` (and no other index, link or config):
    the failure path of ``env build --verifiers`` needs no network. The listed wheels are never fetched."""
    page = tmp_path / "index" / "verifiers" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text(
        "".join(f'<a href="verifiers-{v}-py3-none-any.whl">verifiers-{v}-py3-none-any.whl</a>\n' for v in versions)
    )
    return {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": "",
        "PIP_INDEX_URL": (tmp_path / "index").as_uri(),
        "GYM_ENV_CACHE": str(tmp_path / "envs"),
    }


def verifiers_python() -> str:
    try:
        return find_python(minimum=VERIFIERS_MIN_PYTHON, var=VERIFIERS_PYTHON_ENV)
    except EnvError as e:
        pytest.skip(f"no interpreter to build verifiers' layer on: {e}")


def test_env_build_of_a_verifiers_release_the_index_lacks_is_one_line_and_builds_nothing(tmp_path: Path) -> None:
    verifiers_python()
    env = offline_index(tmp_path, "0.3.1", "0.4.0", "0.4.1.dev3")
    res = cli("env", "build", "--verifiers", "9.9.9", env=env, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and res.stdout == "", res.stderr
    assert lines[0].startswith("gym-runtime: error: verifiers 9.9.9: no such release for Python 3.")
    assert lines[0].endswith(f"(its latest: 0.3.1, 0.4.0; pip looked in {env['PIP_INDEX_URL']})")
    assert not (tmp_path / "envs").exists()  # nothing built, not even the layer's directory


def test_env_build_of_a_config_whose_agent_needs_an_unknown_verifiers_release(tmp_path: Path) -> None:
    """An agent module naming a verifiers release (as agents.verifiers_v1 does) that the index lacks."""
    verifiers_python()
    (tmp_path / "vf_future_agent.py").write_text('verifiers_version = "9.9.9"\n\n\nasync def run(ctx):\n    pass\n')
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": {"policy": {"adapter": "scripted"}},
                "resources": {"weather": {"server": "resources.weather"}},
                "agents": {"vf": {"agent": "vf_future_agent", "model": "policy", "resource": "weather"}},
            }
        )
    )
    env = {**offline_index(tmp_path, "0.4.0"), "PYTHONPATH": str(tmp_path)}
    res = cli("env", "build", str(config), env=env, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gym-runtime: error: verifiers 9.9.9: no such release"), lines
    assert not (tmp_path / "envs").exists()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--verifiers", "latest"], "verifiers 'latest': not a release version (e.g. 0.4.0)"),
        (
            ["--verifiers", "0.3.1"],
            "verifiers 0.3.1: the verifiers layer needs 0.4 or later (its Taskset x Harness API)",
        ),
        (["--server", "no/such/server"], "no/such/server: not a NeMo Gym resources server (no app.py there)"),
        (["--agent", "no-such"], "no-such: not a NeMo Gym agent server (no app.py there)"),
        (
            ["no/such/config.yaml"],
            "no/such/config.yaml: config file not found; give a config YAML's path, or a bundled environment's name "
            f"({', '.join(bundled_environments())})",
        ),
        # a good release with a mistyped server: the server is named before verifiers' layer is built
        (
            ["--verifiers", "0.4.0", "--server", "no/such/server"],
            "no/such/server: not a NeMo Gym resources server (no app.py there)",
        ),
    ],
)
def test_env_build_mistakes_are_one_line_before_anything_is_built(tmp_path: Path, args: list[str], line: str) -> None:
    """Versions, server paths and names, the config's path: each is one line, exit 2, and no layer is built
    (a mistyped --server path used to build the NeMo Gym base layer first: 6 minutes, 1.4 GB)."""
    res = cli("env", "build", *args, env={"GYM_ENV_CACHE": str(tmp_path / "envs")}, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [f"gym-runtime: error: {line}"]
    assert not (tmp_path / "envs").exists()


OPAQUE_ENV = """
from gym_runtime.resource import Resource, tool


class Opaque:
    pass


class OpaqueEnv(Resource):
    tool_arguments = "nemo_gym"

    @tool
    async def poke(self, thing: Opaque) -> str:
        return "poked"

    async def verify(self, task, response):
        return 1.0
"""


def test_a_tool_argument_type_pydantic_cannot_validate_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """An environment author's mistake, found when its worker starts (``publish`` reads tools without pydantic)."""
    (tmp_path / "opaque_env.py").write_text(OPAQUE_ENV)
    cfg = yaml.safe_load((REPO / "resources/weather/config.yaml").read_text())
    cfg["resources"]["weather"]["server"] = "opaque_env"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"responses_create_params": {"input": "hi"}}) + "\n")
    res = cli(
        "run", str(tmp_path / "config.yaml"), "-i", str(tmp_path / "rows.jsonl"), "-o", str(tmp_path / "out.jsonl"),
        env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    [line] = res.stderr.strip().splitlines()
    assert line.startswith("gym-runtime: error: OpaqueEnv.poke: a nemo_gym tool's arguments must be types pydantic")
    assert "opaque_env.Opaque" in line  # pydantic's own first line names the type
