"""Issue 25: the rough edges a new user hits between documented paths, each tried as that user would.

Every test runs the real CLI in a subprocess against a real nats-server (or a
port nothing listens on), with real files; each wait it names has an upper
bound asserted, so a regression to a silent or long wait fails here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.ops.nats_server import EmbeddedServer, free_port, port_taken
from gym_runtime.ops.security import ensure_auth_dir
from gym_runtime.service.supervisor import cpu_seconds
from tests.helpers import REPO, as_from_a_terminal, cli, read_jsonl, write_jsonl

WEATHER = "resources/weather/config.yaml"
EXAMPLE = REPO / "resources/weather/data/example.jsonl"


def assert_one_line(res: subprocess.CompletedProcess[str], *fragments: str, code: int = 2) -> None:
    """A user's mistake: one line (JSON log lines aside, and the notice of a server being tried again), the
    exit code, no traceback."""
    assert res.returncode == code, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr
    lines = [
        line
        for line in res.stderr.splitlines()
        if line.strip() and not line.startswith("{") and "yet (" not in line.partition("no NATS server answers")[2]
    ]
    assert len(lines) == 1, res.stderr
    for f in fragments:
        assert f in res.stderr, (f, res.stderr)


def cli_closed_stdout(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The CLI with a stdout whose reader is gone, as ``| head -1`` leaves it once head has its line."""
    r, w = os.pipe()
    os.close(r)  # every write to stdout now fails with EPIPE (Python ignores SIGPIPE)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gym_runtime.cli", *args],
            cwd=REPO,
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=timeout,
        )
    finally:
        os.close(w)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", proc.stderr)


# ------------------------------------------------------------------------- 1. tracebacks for user actions


def test_run_piped_into_head_ends_quietly_with_its_own_exit_code(tmp_path: Path) -> None:
    res = cli_closed_stdout("run", "weather", "-o", str(tmp_path / "o.jsonl"), "--quiet")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr
    assert len(read_jsonl(tmp_path / "o.jsonl")) == 5  # the work itself was done and written


def test_collect_piped_into_head_ends_quietly(tmp_path: Path, nats_server: EmbeddedServer) -> None:
    pub = cli(
        "run",
        WEATHER,
        "-i",
        str(EXAMPLE),
        "-o",
        str(tmp_path / "a.jsonl"),
        "--nats",
        nats_server.url,
        "--batch",
        "b1",
        "--quiet",
    )
    assert pub.returncode == 0, pub.stderr
    res = cli_closed_stdout(
        "collect", "--batch", "b1", "--nats", nats_server.url, "-o", str(tmp_path / "c.jsonl"), "--quiet"
    )
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr


@pytest.mark.parametrize("damage", ["truncated", "edited"])
@pytest.mark.parametrize("command", ["status", "publish", "collect", "purge"])
def test_a_creds_file_that_is_not_an_nkey_seed_is_one_line_naming_it(command: str, damage: str, tmp_path: Path) -> None:
    auth = tmp_path / "auth"
    ensure_auth_dir(auth)
    with EmbeddedServer(store_dir=str(tmp_path / "js"), secure_dir=str(auth)) as srv:
        for role in ("publisher", "admin"):
            p = auth / f"{role}.creds"
            seed = p.read_text().strip()
            p.write_text(seed[:20] + "\n" if damage == "truncated" else seed[:-3] + "xyz\n")
        argv = {
            "status": ["status"],
            "publish": ["publish", WEATHER, "-i", str(EXAMPLE)],
            "collect": ["collect", "--batch", "b", "-o", str(tmp_path / "o.jsonl")],
            "purge": ["purge", "--batch", "b"],
        }[command]
        t0 = time.monotonic()
        # a 2-minute connect timeout: a command that retried on the bad seed would wait it out, so under a minute
        # is the seed refused at once, however loaded the machine
        res = cli(*argv, "--nats", srv.url, "--auth-dir", str(auth), timeout=180, env={"GYM_CONNECT_TIMEOUT_S": "120"})
        assert time.monotonic() - t0 < 60
    role = "admin" if command == "purge" else "publisher"
    assert_one_line(res, f"{auth}/{role}.creds", "not a valid nkey seed")
    assert seed[:20] not in res.stderr  # never the secret itself


# ------------------------------------------------------------------------------------ 6. wrong words


WEATHER_YAML = """\
namespace: gym
nats: embedded
models:
  policy: {adapter: scripted}
resources:
  weather: {server: resources.weather, replicas: 1}
agents:
  weather_agent: {agent: agents.simple, model: policy, resource: weather, max_steps: 8}
"""


def test_a_config_path_with_dotdot_is_reported_as_given(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.yaml").write_text(WEATHER_YAML)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "run",
            "../m/w.yaml",
            "-o",
            str(tmp_path / "o.jsonl"),
            "--set",
            "agents.weather_agent.max_steps=abc",
        ],
        cwd=tmp_path / "m",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_line(res, "../m/w.yaml: agents.weather_agent.max_steps: Expected `int | null`, got `str`")


@pytest.mark.parametrize(
    ("key", "module", "expected"),
    [
        (
            "resources.weather.server",
            "resources.wether",
            "no such resource module 'resources.wether'; did you mean 'weather'?",
        ),
        ("resources.weather.server", "resources.does_not_exist", "no such resource module 'resources.does_not_exist'"),
        ("agents.weather_agent.agent", "agents.simpel", "no such agent module 'agents.simpel'; did you mean 'simple'?"),
    ],
)
def test_a_mistyped_module_is_no_such_module_with_the_nearest_bundled_name(
    key: str, module: str, expected: str, tmp_path: Path
) -> None:
    res = cli("run", "weather", "-o", str(tmp_path / "o.jsonl"), "--set", f"{key}={module}", timeout=60)
    assert_one_line(res, f"{key}: {expected}")
    assert "pip install" not in res.stderr  # the verifier packages are installed: the name is wrong


@pytest.mark.parametrize("command", ["run", "publish", "validate"])
def test_an_unknown_agent_flag_is_one_line_with_the_nearest_name(command: str, tmp_path: Path) -> None:
    """Not one line per row: the flag is checked once, before any row is read."""
    extra = {"run": ["-o", str(tmp_path / "o.jsonl")], "publish": ["--nats", "nats://127.0.0.1:1"], "validate": []}
    res = cli(command, WEATHER, "-i", str(EXAMPLE), "--agent", "weather_agnt", *extra[command])
    assert_one_line(
        res, "--agent 'weather_agnt' is not an agent of this config (weather_agent); did you mean weather_agent?"
    )


@pytest.mark.parametrize(
    ("typo", "fixed", "suggestion"),
    [
        (
            "max_steps: 8",
            "max_stepz: 8",
            "agents.weather_agent.max_stepz: unknown key; did you mean agents.weather_agent.max_steps?",
        ),
        (
            "replicas: 1",
            "replica: 1",
            "resources.weather.replica: unknown key; did you mean resources.weather.replicas?",
        ),
        (
            "adapter: scripted",
            "adaptr: scripted",
            "models.policy.adaptr: unknown key; did you mean models.policy.adapter?",
        ),
        ("namespace: gym", "namespce: gym", "namespce: unknown key; did you mean namespace?"),
    ],
)
def test_a_key_typo_inside_a_config_file_gets_did_you_mean(
    typo: str, fixed: str, suggestion: str, tmp_path: Path
) -> None:
    config = tmp_path / "w.yaml"
    config.write_text(WEATHER_YAML.replace(typo, fixed))
    res = cli("validate", str(config), "-i", str(EXAMPLE), timeout=60)
    assert_one_line(res, f"{config}: {suggestion}")


def test_output_under_a_file_says_which_path_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    res = cli("run", "weather", "-o", str(tmp_path / "afile" / "o.jsonl"), timeout=60)
    assert_one_line(res, f"{tmp_path / 'afile'} is a file, not a directory")
    assert "File exists" not in res.stderr


def test_one_problem_in_one_row_is_singular(tmp_path: Path) -> None:
    rows = write_jsonl(
        tmp_path / "rows.jsonl", [{"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "nope"}}]
    )
    res = cli("validate", "weather", "-i", str(rows), timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines()[-1] == "gym-runtime: error: 1 problem in 1 row", res.stderr


# ------------------------------------------------------------------------------------- 8. interrupts


def popen_cli(*args: str, cwd: Path = REPO) -> subprocess.Popen[str]:
    """The CLI as a terminal starts it (SIGINT not ignored, unlike a shell's background job)."""
    return subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", *args],
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=as_from_a_terminal,
    )


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.01)


def handles(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (sig - 1) & 1)


class Tail:
    """A child's output stream read to its end by a thread as it comes, so a test waits on what the child
    says (a pipe read only after the child stops would hide when it said it)."""

    def __init__(self, stream: Any) -> None:
        self._parts: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in iter(stream.readline, ""):
            self._parts.append(line)

    def text(self) -> str:
        return "".join(self._parts)

    def all(self) -> str:
        """Everything, once the child has ended."""
        self._thread.join(30)
        return self.text()


def signal_and_wait(proc: subprocess.Popen[str], sig: int, timeout: float = 30) -> tuple[int, float]:
    t0 = time.monotonic()
    proc.send_signal(sig)
    code = proc.wait(timeout=timeout)
    return code, time.monotonic() - t0


def stop_and_time(proc: subprocess.Popen[str], sig: int, timeout: float = 30) -> tuple[int, float, str, str]:
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, time.monotonic() - t0, out, err


def stop_and_measure(proc: subprocess.Popen[str], sig: int, timeout: float = 30) -> tuple[int, float, float, str]:
    """Signal ``proc`` and wait for it to end: its exit code, the wall seconds that took, the CPU seconds it
    spent after the signal (its own, not an embedded nats-server's: work shows there whatever the load, which
    stretches only wall time; read from the zombie before it is reaped, its final count), and its stderr."""
    before = cpu_seconds(proc.pid) or 0.0
    t0 = time.monotonic()
    proc.send_signal(sig)
    ended = threading.Thread(target=os.waitid, args=(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT), daemon=True)
    ended.start()
    ended.join(timeout)
    took = time.monotonic() - t0
    after = cpu_seconds(proc.pid) if not ended.is_alive() else None
    after = float("inf") if after is None else after
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, took, after - before, err


@pytest.mark.parametrize("when", ["while rollouts arrive", "while the file is written"])
def test_ctrl_c_during_run_exits_130_at_once_and_leaves_no_partial_file(when: str, tmp_path: Path) -> None:
    """One task --repeats 8000 (8,000 rollouts, one process): Ctrl-C is acted on at once whether it comes while
    results arrive or while the file and its pass@k for every k up to 8,000 are being written (that takes ~4
    CPU-s here, twice the 2 it may spend after the signal); the spool (<out>.partial: results in arrival order,
    no index, nothing can resume from it) is removed."""
    one, out = tmp_path / "one.jsonl", tmp_path / "out" / "o.jsonl"
    write_jsonl(one, read_jsonl(REPO / "resources/weather/data/example.jsonl")[:1])
    out.parent.mkdir()
    proc = popen_cli(
        "run", WEATHER, "-i", str(one), "-o", str(out), "--repeats", "8000", "--processes", "one", "--quiet"
    )
    spool, tmp = Path(f"{out}.partial"), Path(f"{out}.tmp")
    if when == "while rollouts arrive":
        wait_for(lambda: spool.exists() and spool.stat().st_size > 1_000_000, 120, "results spooled")
    else:
        wait_for(lambda: tmp.exists(), 600, "the file being written")
    code, took, cpu, err = stop_and_measure(proc, signal.SIGINT)
    print(f"{when}: ended {took:.2f} s after Ctrl-C, {cpu:.2f} CPU s")
    assert code == 130, err[-2000:]
    # acted on at once: it stops working (CPU seconds after the signal, which load does not stretch: going on
    # with 8,000 rollouts or 8,000 pass@k would burn far more), and stops waiting (a wall bound for that alone,
    # generous, as a load of 30 stretches even a short exit's wall time many times)
    assert cpu < 2.0, cpu
    assert took < 20, took
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("gym-runtime: error: interrupted: "), err[-2000:]
    # issue 75: what was kept, where (nothing: -o is written whole, and this run's embedded server kept no store)
    assert f"{out} is written whole when a batch ends, and this run's embedded server kept nothing" in last, last
    assert not spool.exists() and not tmp.exists() and not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == []


@pytest.mark.parametrize("pool", [False, True])
def test_start_exits_130_on_ctrl_c_and_0_on_sigterm(pool: bool, nats_server: EmbeddedServer) -> None:
    replicas = ["--replicas", "2"] if pool else []
    for sig, expected in ((signal.SIGINT, 130), (signal.SIGTERM, 0)):
        proc = popen_cli("start", WEATHER, "--nats", nats_server.url, "--only", "resources.weather", *replicas)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "workers ready"
        assert "ready" in line, proc.stderr.read() if proc.stderr else ""
        code, took, _, err = stop_and_time(proc, sig, timeout=60)
        assert code == expected, (sig, err[-2000:])
        assert took < 30, took  # a start that ignored the signal would run on: halfway to the 60 s wait


@pytest.mark.parametrize("pool", [False, True])
def test_start_stopped_while_still_connecting_stops_at_once_without_blaming_anyone(pool: bool) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    replicas = ["--replicas", "2"] if pool else []
    proc = popen_cli("start", WEATHER, "--nats", dead, "--only", "resources.weather", *replicas)
    # the workers wait for a server that is not there: once start handles SIGTERM (past its imports, which a
    # loaded machine may take seconds over), it is waiting to connect
    wait_for(lambda: handles(proc.pid, signal.SIGTERM), 60, "start handling SIGTERM")
    time.sleep(1)
    code, took, _, err = stop_and_time(proc, signal.SIGTERM)
    assert code == 0, err[-2000:]
    assert took < 15, took  # a start that waited to connect would never stop by itself: halfway to the 30 s wait
    assert "its error is above" not in err and "not_started" not in err, err


@pytest.mark.parametrize("pool", [False, True])
def test_start_stopped_after_its_server_died_exits_quietly(pool: bool, tmp_path: Path) -> None:
    """The scheduler's SIGTERM (or the parent-death signal) after the server went away first, as at the end
    of a job: the workers drain what they can and exit 0, without an internal error about a closed socket."""
    replicas = ["--replicas", "2"] if pool else []
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"))
    srv.start()
    try:
        proc = popen_cli("start", WEATHER, "--nats", srv.url, "--only", "resources.weather", *replicas)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "workers ready"
        assert "ready" in line, proc.stderr.read() if proc.stderr else ""
    finally:
        srv.stop()
    time.sleep(1)  # the workers see the connection drop and start reconnecting (a settle; nothing is asserted on it)
    code, took, _, err = stop_and_time(proc, signal.SIGTERM, timeout=60)
    assert "internal error" not in err and "Traceback" not in err, err[-3000:]
    assert code == 0, err[-2000:]
    assert took < 30, took  # reconnecting, it would wait for the server forever: halfway to the 60 s wait


def test_start_whose_server_stops_with_it_mid_batch_exits_within_seconds(tmp_path: Path) -> None:
    """A scheduler cancelling a whole job stops its server together with its workers (Slurm: SIGTERM to every
    step at once, SIGKILL after KillWait, 30 s by default): rollouts in flight can neither finish nor be handed
    back, so the drain stops waiting once the server is gone, and the pool exits 0 well within KillWait (it
    waited for its calls' timeouts and stores, and was SIGKILLed); the tasks stay unacknowledged in the store."""
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"))
    srv.start()
    slow = ["--set", "models.policy.delay_s=30"]
    proc = popen_cli("start", WEATHER, "--nats", srv.url, *slow)
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        published = cli("publish", WEATHER, "-i", str(EXAMPLE), "--nats", srv.url, "-q", *slow)
        assert published.returncode == 0, published.stderr
        wait_for(lambda: _in_flight(srv.url) > 0, 30, "rollouts in flight")
    finally:
        srv.stop()  # the server and the pool stop together, as a cancelled job's steps do
    code, took, _, err = stop_and_time(proc, signal.SIGTERM, timeout=90)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    # within KillWait (30 s), and short of the 30 s model calls it would otherwise wait out: 20 s is both
    assert took < 20, took


def _in_flight(url: str) -> int:
    """Tasks delivered to the agent and not yet acknowledged (its durable's ack pending)."""
    res = cli("status", "--nats", url, "--json", timeout=30)
    if res.returncode != 0:
        return 0
    consumers = json.loads(res.stdout)["consumers"]
    return sum(int(c["ack_pending"]) for c in consumers if str(c["consumer"]).startswith("agent_"))


def test_status_watch_runs_until_interrupted_past_the_batch_end(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    res = cli(
        "run",
        WEATHER,
        "-i",
        str(EXAMPLE),
        "-o",
        str(tmp_path / "o.jsonl"),
        "--nats",
        nats_server.url,
        "--batch",
        "done1",
        "--quiet",
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    proc = popen_cli("status", "--nats", nats_server.url, "--batch", "done1", "--watch", "--interval", "0.5")
    tail = Tail(proc.stdout)  # pending is 0 from the start: it still watches, refreshed again and again
    wait_for(lambda: tail.text().count("pending") >= 3 or proc.poll() is not None, 120, "three refreshes")
    assert proc.poll() is None, (tail.all(), proc.stderr.read() if proc.stderr else "")
    code, took = signal_and_wait(proc, signal.SIGINT, timeout=60)
    assert code == 0, proc.stderr.read() if proc.stderr else ""
    assert took < 30  # a watch that went on would never end: halfway to the 60 s wait


# --------------------------------------------------------------------------------- 2. silent or long waits


def test_start_all_roles_with_a_mistyped_module_against_a_dead_server_says_so_at_once(tmp_path: Path) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    res = cli("start", WEATHER, "--nats", dead, "--set", "resources.weather.server=resources.wether", timeout=90)
    took = time.monotonic() - t0
    assert_one_line(
        res, "resources.weather.server: no such resource module 'resources.wether'; did you mean 'weather'?"
    )
    assert took < 45, took  # waiting for the dead server would run to the 90 s timeout: halfway tells them apart
    assert "models.policy" not in res.stderr


def test_collect_of_an_unknown_batch_says_so_at_once(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    t0 = time.monotonic()
    res = cli("collect", "--batch", "nope", "--nats", nats_server.url, "-o", str(tmp_path / "o.jsonl"), timeout=90)
    assert time.monotonic() - t0 < 45  # waiting for the batch would run to the 90 s timeout: halfway tells them apart
    assert_one_line(res, "no batch 'nope' in namespace 'gym'", "--wait S")
    assert not (tmp_path / "o.jsonl").exists()


def test_purge_of_an_unknown_batch_is_an_error_not_purged_0(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    res = cli("purge", "--batch", "nope", "--nats", nats_server.url, timeout=60)
    assert_one_line(res, "no batch 'nope' in namespace 'gym'")
    assert "purged 0" not in res.stdout


def test_commands_with_no_config_read_gym_nats(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    """The deploy files export GYM_NATS: `status`/`collect`/`purge`/`health` take it when --nats is not given."""
    live = cli("status", "--json", env={"GYM_NATS": nats_server.url}, timeout=60)
    assert live.returncode == 0, live.stderr
    assert "workers" in json.loads(live.stdout)
    gone = cli("purge", "--batch", "nope", env={"GYM_NATS": nats_server.url}, timeout=60)
    assert_one_line(gone, "no batch 'nope' in namespace 'gym'")
    env = {k: v for k, v in os.environ.items() if k != "GYM_NATS"}
    res = subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", "health"], capture_output=True, text=True, env=env, timeout=60
    )
    assert_one_line(res, "health needs --nats URL or GYM_NATS")


def test_a_dead_nats_url_says_why(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    res = cli("status", "--nats", url, env={"GYM_CONNECT_TIMEOUT_S": "2"}, timeout=60)
    assert time.monotonic() - t0 < 10
    assert_one_line(res, f"cannot reach a NATS server at {url}: connection refused", "(waited 2s)")


@pytest.mark.parametrize(
    "command",
    [
        ["publish", str(REPO / WEATHER), "-i", str(EXAMPLE)],
        ["collect", "--batch", "b", "-o", "o.jsonl"],
        ["run", str(REPO / WEATHER), "-i", str(EXAMPLE), "-o", "o.jsonl"],
    ],
)
def test_a_dead_nats_url_is_said_at_once_with_what_is_tried(command: list[str], tmp_path: Path) -> None:
    """Not ~10 s of silence: the first failed try says what is tried and for how long, while it goes on."""
    url = f"nats://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", *command, "--nats", url],
        cwd=tmp_path,
        env={**os.environ, "GYM_CONNECT_TIMEOUT_S": "30"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert proc.poll() is None, first  # said while still trying, not at the end
        assert first.strip() == (
            f"gym-runtime: no NATS server answers at {url} yet (connection refused, no server listens on "
            f"127.0.0.1:{url.rsplit(':', 1)[1]}); trying again for up to 30s (GYM_CONNECT_TIMEOUT_S)"
        )
    finally:
        proc.kill()
        proc.wait(30)


QUERIES = [["status"], ["view", "--batch", "b"], ["explain", "b", "0"], ["purge", "--batch", "b"]]


def dead_bus_error(url: str, waited: int) -> str:
    return (
        f"gym-runtime: error: cannot reach a NATS server at {url}: connection refused, no server listens on "
        f"127.0.0.1:{url.rsplit(':', 1)[1]} (waited {waited}s); start one (`gym-runtime server`), or give --nats the "
        "URL of a running one"
    )


@pytest.mark.parametrize("command", QUERIES, ids=lambda c: c[0])
def test_a_query_on_a_dead_bus_is_one_error_line_alone(command: list[str], tmp_path: Path) -> None:
    """A one-shot query (not a job that then works for long, which says at once what it tries): stderr is the
    error line and nothing else, exit 2."""
    url = f"nats://127.0.0.1:{free_port()}"
    res = cli(*command, "--nats", url, env={"GYM_CONNECT_TIMEOUT_S": "2"}, cwd=tmp_path, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [dead_bus_error(url, 2)]
    assert res.stdout == ""


def test_on_a_terminal_a_query_shows_what_it_tries_then_erases_it_for_the_error(tmp_path: Path) -> None:
    import fcntl
    import pty
    import struct
    import termios

    url = f"nats://127.0.0.1:{free_port()}"
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 300, 0, 0))  # wide: the notice whole
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "status", "--nats", url],
        cwd=tmp_path,
        env={**os.environ, "GYM_CONNECT_TIMEOUT_S": "2"},
        stdout=subprocess.DEVNULL,
        stderr=side,
    )
    os.close(side)
    raw = b""
    try:
        while chunk := os.read(main, 4096):
            raw += chunk
    except OSError:  # the child closed the terminal (EIO)
        pass
    finally:
        os.close(main)
    assert proc.wait(60) == 2
    shown, erase, after = raw.decode().partition("\r\x1b[K")
    assert erase, raw
    assert shown == (
        f"gym-runtime: no NATS server answers at {url} yet (connection refused, no server listens on "
        f"127.0.0.1:{url.rsplit(':', 1)[1]}); trying again for up to 2s (GYM_CONNECT_TIMEOUT_S)"
    )
    assert after.splitlines() == [dead_bus_error(url, 2)]  # what stays on the screen: the one error line


def test_a_name_that_does_not_resolve_is_said_so() -> None:
    # the reason only: a real lookup would leave loopback (this machine's resolver is on the network)
    import socket

    from gym_runtime.transport.connect import _tcp_reason

    e = OSError("All connection attempts failed")
    e.__cause__ = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert _tcp_reason(e, "nast1", 4222) == "the name 'nast1' does not resolve"


@pytest.mark.parametrize("command", [["status"], ["collect", "--batch", "b", "-o", "o.jsonl"], ["start", WEATHER]])
def test_an_http_url_is_refused_as_a_bad_flag(command: list[str]) -> None:
    """Refused from the flag alone: nothing connects to the URL (a listener there counts who does)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        res = cli(*command, "--nats", url, timeout=120)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert_one_line(res, f"--nats {url}: not a NATS URL", "monitoring port")


def test_a_pool_logs_nats_unreachable_once_with_a_reason(tmp_path: Path) -> None:
    import json

    proc = popen_cli("start", WEATHER, "--nats", f"nats://127.0.0.1:{free_port()}", "--replicas", "2")
    tail = Tail(proc.stderr)  # a waiting service warns after 8 s; then 8 s more, to hear any repeat
    wait_for(lambda: '"nats.unreachable"' in tail.text(), 120, "the warning")
    time.sleep(8)  # a span with nothing in it (no second warning): load only stretches it
    code, took = signal_and_wait(proc, signal.SIGTERM, timeout=60)
    err = tail.all()
    assert code == 0 and took < 30, err  # waiting for the server it would never end: halfway to the 60 s wait
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    unreachable = [x for x in lines if x.get("event") == "nats.unreachable"]
    assert len(unreachable) == 1, err
    assert "connection refused" in unreachable[0]["reason"]


# ---------------------------------------------------------------------------- 4. a second server on one machine


def test_a_second_server_on_the_machine_starts_and_says_where_its_monitoring_is(tmp_path: Path) -> None:
    import urllib.request

    first = popen_cli("server", "--port", str(free_port()), "--store-dir", str(tmp_path / "a"))
    second = None
    try:
        assert first.stdout is not None and first.stdout.readline().startswith("nats://")
        # the second one's default monitoring port is free or not: it starts either way, and says where
        port = free_port()
        t0 = time.monotonic()
        second = popen_cli("server", "--port", str(port), "--store-dir", str(tmp_path / "b"))
        assert second.stdout is not None
        assert second.stdout.readline().strip() == f"nats://127.0.0.1:{port}", second.stderr.read()  # type: ignore[union-attr]
        assert time.monotonic() - t0 < 10
        assert second.stderr is not None
        line = second.stderr.readline()
        assert line.startswith("monitoring: http://127.0.0.1:"), line
        monitor = line.split()[1]
        with urllib.request.urlopen(f"{monitor}/jsz", timeout=5) as r:  # KEDA's endpoint answers there
            assert r.status == 200
    finally:
        for p in (first, second):
            if p is not None:
                p.send_signal(signal.SIGTERM)
                p.wait(15)


def test_a_taken_default_monitoring_port_falls_back_but_an_explicit_one_is_an_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # something else holds what would be the default (client port + 4000)
        port = free_port()
        while port + 4000 > 65535:
            port = free_port()
        s.bind(("127.0.0.1", port + 4000))
        s.listen()
        proc = popen_cli("server", "--port", str(port), "--store-dir", str(tmp_path / "a"))
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == f"nats://127.0.0.1:{port}"
            assert proc.stderr is not None and f":{port + 4000} " not in proc.stderr.readline()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        res = cli(
            "server",
            "--port",
            str(free_port()),
            "--http-port",
            str(port + 4000),
            "--store-dir",
            str(tmp_path / "b"),
            timeout=90,
        )
    assert_one_line(res, f"monitoring port 127.0.0.1:{port + 4000} is already in use")


def test_the_default_monitoring_port_is_8222_for_4222_where_the_deploy_files_read_jsz() -> None:
    from gym_runtime.cli import build_parser
    from gym_runtime.cli.server import monitoring_port

    args = build_parser().parse_args(["server"])
    expected = 8222 if not port_taken("127.0.0.1", 8222) else 0
    assert monitoring_port(args) == expected
    # the deploy files name 8222 for /jsz: Slurm passes it explicitly, compose and the Helm values set it
    dry = subprocess.run(
        ["bash", str(REPO / "deploy/slurm/gym-runtime.sbatch"), "c.yaml", "in.jsonl", "out.jsonl"],
        env={**os.environ, "GYM_DRY_RUN": "1", "GYM_NODES": "n1 n2 n3 n4", "GYM_VENV": "/v"},
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert dry.count("--http-port 8222") == 3 and "--monitor http://n1:8222" in dry
    assert "nats.nats.svc.cluster.local:8222" in (REPO / "deploy/k8s/keda.yaml").read_text()


# ------------------------------------------------------------- 5. rows run/publish/submit take but validate refuses


def wether_rows(tmp_path: Path) -> Path:
    rows = read_jsonl(EXAMPLE)
    rows[0]["responses_create_params"]["tools"][0]["name"] = "get_wether"  # not a tool of weather
    return write_jsonl(tmp_path / "rows.jsonl", rows)


def test_validate_run_and_publish_refuse_the_same_row(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    rows = wether_rows(tmp_path)
    said = f"{rows}:1: weather: tool 'get_wether' is not a tool of this environment"
    v = cli("validate", WEATHER, "-i", str(rows), timeout=60)
    assert v.returncode == 2 and said in v.stderr, v.stderr
    for argv in (
        ["run", WEATHER, "-i", str(rows), "-o", str(tmp_path / "o.jsonl")],
        ["publish", WEATHER, "-i", str(rows), "--nats", nats_server.url],
    ):
        res = cli(*argv, timeout=60)
        assert res.returncode == 2, (argv, res.stderr)
        assert said in res.stderr and "nothing was published" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    assert not (tmp_path / "o.jsonl").exists()
    status = cli("status", "--nats", nats_server.url, "--json", timeout=60)
    assert '"results_stored": 0' in status.stdout, status.stdout


def test_any_tools_runs_rows_whose_tools_are_answer_channels(tmp_path: Path) -> None:
    rows = wether_rows(tmp_path)
    assert cli("validate", WEATHER, "-i", str(rows), "--any-tools", timeout=60).returncode == 0
    res = cli("run", WEATHER, "-i", str(rows), "-o", str(tmp_path / "o.jsonl"), "--any-tools", "--quiet", timeout=120)
    assert res.returncode == 0, res.stderr
    assert len(read_jsonl(tmp_path / "o.jsonl")) == 5


def test_an_environment_the_publisher_cannot_import_is_checked_by_its_workers(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """Its module is installed on the worker nodes only: publish takes the rows, and the resource worker
    applies validate's checks when it opens the session, so the bad row is an invalid_task failure row
    (never a reward) and the others run; with --any-tools the same row runs."""
    workers_only = tmp_path / "workers_only"
    workers_only.mkdir()
    module = "from gym_runtime.resources.weather import Weather\n\nresource = Weather\n"
    (workers_only / "wx_nodes.py").write_text(module)
    (tmp_path / "cfg").mkdir()
    config = tmp_path / "cfg" / "config.yaml"
    config.write_text((REPO / WEATHER).read_text().replace("server: resources.weather", "server: wx_nodes"))
    rows = wether_rows(tmp_path)
    here = cli("validate", str(config), "-i", str(rows), timeout=60)  # this node cannot import it: validate says so
    assert here.returncode == 2 and "wx_nodes" in here.stderr, here.stderr
    env = {**os.environ, "PYTHONPATH": str(workers_only)}
    start = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(config), "--nats", nats_server.url],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert start.stdout is not None and "ready" in start.stdout.readline()
        for batch, extra in (("strict", []), ("lax", ["--any-tools"])):
            pub = cli("publish", str(config), "-i", str(rows), "--nats", nats_server.url, "--batch", batch, *extra)
            assert pub.returncode == 0, pub.stderr
            out = tmp_path / f"{batch}.jsonl"
            col = cli("collect", "--batch", batch, "--nats", nats_server.url, "-o", str(out), "--wait", "60")
            got = read_jsonl(out)
            failed = read_jsonl(tmp_path / f"{batch}_failures.jsonl") if batch == "strict" else []
            if batch == "strict":
                assert col.returncode == 1, col.stderr  # a batch with failure rows
                assert len(got) == 4 and all(r["reward"] == 1.0 for r in got)
                (bad,) = failed
                assert bad["error_class"] == "invalid_task" and bad["_ng_task_index"] == 0
                assert "tool 'get_wether' is not a tool of this environment" in bad["error"]
            else:
                assert col.returncode == 0, col.stderr
                assert len(got) == 5 and all(r["reward"] == 1.0 for r in got)
    finally:
        start.send_signal(signal.SIGTERM)
        start.wait(timeout=60)


async def test_client_submit_refuses_what_validate_refuses(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    from gym_runtime.client import Client
    from gym_runtime.config import load_config, resolve_config
    from gym_runtime.errors import ClientError

    rows = read_jsonl(wether_rows(tmp_path))
    async with Client(resolve_config(load_config(REPO / WEATHER)), nats=nats_server.url) as client:
        with pytest.raises(ClientError, match="row 0: weather: tool 'get_wether' is not a tool of this environment"):
            await client.submit(rows)
        batch = await client.submit(rows, any_tools=True)
        assert len(await batch.gather()) == 5
        # one rollout at a time (the gateway's /run) is checked the same way
        with pytest.raises(ClientError, match="row 0: weather: tool 'get_wether' is not a tool of this environment"):
            await client.run(rows[0])
        assert (await client.run(rows[0], any_tools=True))["reward"] == 1.0


# ------------------------------------------------------------------------------------------ 3. metrics on run


def scrape_families(port: int) -> dict[str, list]:  # type: ignore[type-arg]
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    families: dict[str, list] = {}  # type: ignore[type-arg]
    for fam in text_string_to_metric_families(text):
        assert fam.name not in families, f"family {fam.name} twice: not a valid exposition"
        families[fam.name] = fam.samples
    return families


@pytest.mark.parametrize("processes", ["per-role", "2"])
def test_run_serves_the_runs_rollout_metrics_on_its_port_whatever_the_process_mode(
    processes: str, tmp_path: Path
) -> None:
    config = tmp_path / "w.yaml"
    config.write_text(WEATHER_YAML.replace("adapter: scripted}", "adapter: scripted, delay_s: 0.05, concurrency: 4}"))
    port = free_port()
    proc = popen_cli(
        "run",
        str(config),
        "-i",
        str(EXAMPLE),
        "-o",
        str(tmp_path / "o.jsonl"),
        "--repeats",
        "40",
        "--processes",
        processes,
        "--metrics-port",
        str(port),
        "--metrics-host",
        "127.0.0.1",
        "--quiet",
    )
    seen: dict[str, list] = {}  # type: ignore[type-arg]
    deadline = time.monotonic() + 90
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                families = scrape_families(port)
            except OSError:
                time.sleep(0.2)
                continue
            completed = sum(s.value for s in families.get("gym_rollouts_completed", []) if s.name.endswith("_total"))
            if completed > 0:
                seen = families
                break
            time.sleep(0.2)
        assert seen, "no rollout counter on the run's --metrics-port during the batch"
        inflight_roles = {s.labels.get("gym_role") for s in seen.get("gym_inflight", [])}
        assert {"agent", "model"} <= inflight_roles, inflight_roles  # the children's series, on the one port
        assert "gym_queue_pending" in seen
    finally:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
