"""Small helpers shared by the end-to-end tests (no test doubles here)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import msgspec

from gym_runtime.config import Config, ResolvedConfig, load_config, resolve_config, resolve_models
from gym_runtime.data.batches import Manifest, Owners, new_manifest, put_manifest
from gym_runtime.errors import ModelError
from gym_runtime.messages import CreateParams, Response
from gym_runtime.model import model_config
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import EmbeddedServer, free_port, port_taken
from gym_runtime.ops.permissions import Reach
from gym_runtime.ops.security import ensure_auth_dir
from gym_runtime.testing import text_response
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_results_stream, ensure_streams

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "tests" / "compat" / "nemo_gym"


# a config: the scripted policy (a test double) and agents.simple on tests.envs.flaky (its verify raises for rows
# marked "explode"), two attempts a task
FLAKY: dict[str, Any] = {
    "namespace": "gym",
    "models": {"policy": {"adapter": "scripted"}},
    "resources": {"env": {"server": "tests.envs.flaky"}},
    "agents": {
        "agent": {"agent": "agents.simple", "model": "policy", "resource": "env", "max_steps": 4, "max_attempts": 2}
    },
}


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | Path, rows: list[Any]) -> Path:
    p = Path(path)
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def prompt_key(input_items: Any) -> tuple[tuple[str, str], ...]:
    """Match a task row to a recorded rollout by role and content of its input messages."""
    if isinstance(input_items, str):
        return (("user", input_items),)
    return tuple((m.get("role", ""), json.dumps(m.get("content"))) for m in input_items)


def cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """Run the real `gym-runtime` entry point in a subprocess (``env`` over this process's environment)."""
    return subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def as_from_a_terminal() -> None:
    """``preexec_fn`` for a child a test will Ctrl-C: SIGINT and SIGQUIT at their defaults, as a terminal's
    process has them. A shell's background job (CI started with ``&``) ignores both, the ignore is inherited,
    and a Python started with SIGINT ignored never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def read_until(stream: IO[str], needle: str, timeout: float) -> tuple[bool, str]:
    """Read a child's output line by line until one holds ``needle``: (seen it, everything read)."""
    seen, deadline = "", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.2)
        if ready:
            line = stream.readline()
            if not line:  # the child closed it
                return False, seen
            seen += line
            if needle in line:
                return True, seen
    return False, seen


async def eventually(holds: Callable[[], object], within: float = 30.0) -> None:
    """Poll a state the test can see until it holds: an event, not a fixed sleep that a loaded machine
    outlasts; fails after ``within`` seconds (generous: only a broken run gets there)."""
    with anyio.fail_after(within):
        while not holds():
            await anyio.sleep(0.01)


def wait_healthy(url: str, proc: subprocess.Popen[Any], within: float, why: Callable[[], str]) -> None:
    """Wait until the server ``proc`` started answers ``url``/health with 200; ``RuntimeError(why())`` (say, its
    log's tail) once it has exited or ``within`` seconds have passed. A server still running then is killed
    first, so that ``why`` can read its output to the end."""
    deadline = time.monotonic() + within
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait(timeout=30)
                raise RuntimeError(why()) from None
            time.sleep(0.2)


def nats_server_pids(under: str | Path) -> set[int]:
    """nats-server processes whose config lives under ``under`` (a test's TMPDIR).

    Filtering by path keeps other test runs' servers on the same machine out.
    """
    import psutil

    pids = set()
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            cmd = p.info["cmdline"] or [""]
            if (p.info["name"] == "nats-server" or cmd[0].endswith("nats-server")) and str(under) in " ".join(cmd):
                pids.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


WEATHER = REPO / "resources/weather/config.yaml"


ROWS = read_jsonl(REPO / "resources/weather/data/example.jsonl")


def weather_config(
    *,
    delay_s: float = 0.0,
    agent_concurrency: int | None = None,
    model_concurrency: int | None = None,
    model_replicas: int = 1,
    namespace: str = "gym",
) -> Config:
    """The weather config, loaded (its adapter's options parsed), for a test to change before it resolves it."""
    cfg = resolve_models(load_config(WEATHER)).config
    m = cfg.models["policy"]
    cfg.models["policy"] = msgspec.structs.replace(
        m,
        options=msgspec.structs.replace(m.options, delay_s=delay_s),
        concurrency=model_concurrency or m.concurrency,
        replicas=model_replicas,
    )
    a = cfg.agents["weather_agent"]
    cfg.agents = {
        **cfg.agents,
        "weather_agent": msgspec.structs.replace(a, concurrency=agent_concurrency or a.concurrency),
    }
    return msgspec.structs.replace(cfg, namespace=namespace)


def weather(
    *,
    delay_s: float = 0.0,
    agent_concurrency: int | None = None,
    model_concurrency: int | None = None,
    model_replicas: int = 1,
    namespace: str = "gym",
) -> ResolvedConfig:
    """The weather config, resolved (what workers, ``publish_batch`` and ``Client`` take)."""
    return resolve_config(
        weather_config(
            delay_s=delay_s,
            agent_concurrency=agent_concurrency,
            model_concurrency=model_concurrency,
            model_replicas=model_replicas,
            namespace=namespace,
        )
    )


def weather_on_vllm(base_url: str, **options: Any) -> ResolvedConfig:
    """The weather config one rollout at a time (a script is consumed in order), its policy the vllm adapter at
    ``base_url`` (the stub's vLLM emulator, a test double) with token ids; ``options`` over the adapter's."""
    cfg = weather_config(agent_concurrency=1)
    cfg.models["policy"] = model_config(
        {"adapter": "vllm", "base_url": base_url, "model": "tiny", "return_token_ids": True, "eos_token_id": 4}
        | options
    )
    return resolve_config(cfg)


def rows(n: int) -> list[dict[str, Any]]:
    """``n`` of the bundled weather rows, each a copy of its own: a test that marks some (``tasks[i]["forge"] =
    True``) changes nothing for the tests after it in the same process (a gateway test once got a marked row)."""
    return [copy.deepcopy(ROWS[i % len(ROWS)]) for i in range(n)]


async def put_batch(
    bus: Bus, batch: str, tasks: int, *, repeats: int = 1, agent: str = "a", published: bool = True
) -> Manifest:
    """The manifest ``publish`` stores, for a test that stores a batch's tasks or results itself: ``tasks``
    tasks of ``agent``, wholly ``published`` (then put it once they are stored: a reader may settle lost slots)."""
    manifest = new_manifest(batch, Owners.one(agent, tasks), repeats=repeats, input_path="-")
    manifest = msgspec.structs.replace(manifest, published=published)
    await ensure_streams(bus)
    if not bus.secured:  # a secured server provisioned it (from its config's agents, or one shared by all)
        await ensure_results_stream(bus, agent)
    await put_manifest(bus, manifest)
    return manifest


async def pool_bus(url: str, auth: str | Path, role: str, pool: str | None = None) -> Bus:
    """A connection to a secured server with one role's (or one pool's, ``agent.NAME.creds``) credentials."""
    return await Bus.connect(
        url,
        namespace="gym",
        telemetry=Telemetry(),
        name=f"t-{role}-{pool}",
        auth=ClientAuth(Path(auth)),
        role=role,
        pool=pool,
        initial_timeout=5,
    )


@contextlib.contextmanager
def secured_server(
    tmp_path: Path, pools: list[tuple[str, str]] | None = None, reach: Reach | None = None
) -> Iterator[tuple[EmbeddedServer, Path]]:
    """A ``server --secure`` server and its trust directory, with per-entry credentials for ``pools``
    (``server --secure DIR --pool ...``) and the environments each entry may call (``reach``)."""
    auth = ensure_auth_dir(tmp_path / "auth", pools=pools or [])
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"), secure_dir=str(auth), reach=reach)
    srv.start()
    try:
        yield srv, auth
    finally:
        srv.stop()


def node_dir(src: Path, dst: Path, *roles: str) -> Path:
    """What one node holds: the CA certificate and only its roles' seeds."""
    dst.mkdir()
    for name in ("ca.pem", *(f"{r}.creds" for r in roles)):
        shutil.copy(src / name, dst / name)
    return dst


async def connect_as(srv: EmbeddedServer, auth: Path, role: str, pool: str | None = None) -> Bus:
    """A bus on a secured server (``secured_server``) with ``role``'s credential (or one ``pool``'s)."""
    return await pool_bus(srv.url, auth, role, pool)


def without_run_identity(row: dict[str, Any]) -> dict[str, Any]:
    """A row less what two runs of the same rollout differ in by design: its ``provenance`` (the workers that
    served it, the config's fingerprint) and the timings in its ``cost`` (calls and tokens stay)."""
    out = {k: v for k, v in row.items() if k != "provenance"}
    if isinstance(row.get("cost"), dict):
        models = row["cost"].get("models") or {}
        out["cost"] = {n: {k: v for k, v in m.items() if not k.endswith("_ms")} for n, m in models.items()}
    return out


def resolved(**sections: Any) -> ResolvedConfig:
    """A resolved config of just these entries (``models={"policy": cfg}``): for a test that builds one worker."""
    return resolve_config(Config(**sections))


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections' source ports."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def node_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports nothing listens on, below the kernel's ephemeral range when it leaves room.

    ``free_port`` gives one from that range, where any outgoing connection (another test's client) may take it as
    its source port before the node binds it: seen in CI, a route port taken between its choice and the node's
    start. Below the range only another test choosing the same port can collide (``LocalCluster.start`` then
    chooses again)."""
    low = _ephemeral_low()
    if low - 10_000 < 4 * n:
        return [free_port() for _ in range(n)]
    rng = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(10_000, low)
        if port not in ports and not port_taken("127.0.0.1", port):
            ports.append(port)
    return ports


class FailsFirst:
    """An LLM test double (the real adapters are under ``models/``): its first generation fails as an endpoint's
    error would, every later one answers."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        self.calls += 1
        if self.calls == 1:
            raise ModelError("the endpoint answered 400")
        return text_response("fine")

    async def aclose(self) -> None:
        pass


LATE_READS = """
import os

read, seen = os.read, set()


def late_read(fd, n):  # the first read of each of the command's (non-blocking) pipes, not of Popen's own
    if fd not in seen and not os.get_blocking(fd):
        seen.add(fd)
        try:
            while os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
                pass  # until the command has written and ended: a zombie, not yet reaped
        except ChildProcessError:
            pass  # already reaped
        raise BlockingIOError
    return read(fd, n)


os.read = late_read
"""


def with_late_reads(cwd: Path, code: str) -> str:
    """Run ``code`` in a fresh Python whose first read of each of a command's pipes comes back empty only once the
    command has ended: a payload must still take what the command wrote (CI once lost it in that order).
    What ``code`` prints."""
    script = LATE_READS + textwrap.dedent(code)
    res = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def freeze(pid: int, within_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it shows as stopped: ``kill`` returns before they all are
    (some of nats-server's 8 threads were not yet in 77 of 200 tries here; a dockerd under load answered a request
    sent right after), so that nothing the test sends next can be served."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within_s
    while not all(_thread_state(t) == "T" for t in Path(f"/proc/{pid}/task").glob("*/stat")):
        assert time.monotonic() < deadline, f"process {pid} did not stop within {within_s} s of SIGSTOP"
        time.sleep(0.001)


def _thread_state(stat: Path) -> str:
    """A thread's state letter in ``/proc/PID/task/TID/stat`` (``T``: stopped by a signal; one that has ended since
    it was listed runs no more either)."""
    try:
        return stat.read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "T"
