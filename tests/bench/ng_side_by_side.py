"""The same NeMo Gym resources server code under gym-runtime and under NeMo Gym's own ``ng_run``: one table.

For each server (default: ``mcqa``, stateless; ``example_session_state_mgmt``, one session cookie
and a tool call per rollout) both systems are deployed on this machine, side by side, against the
same zero-latency model double (``tests/bench/mock_openai.py``: a fixed answer per server, a fixed
tool call where tools are offered):

* **NeMo Gym**: ``ng_run`` with the server's own config file plus ``openai_model``'s (so the
  deployment NeMo Gym documents: Ray, the head server, the resources server, ``simple_agent``, the
  ``legacy_agent`` environment server and the model server, one process each), its venvs pointed at
  gym-runtime's cached hosted environments (``+uv_venv_dir`` + ``+skip_venv_if_present=true``: the
  same interpreter and packages both sides), driven by NeMo Gym's ``ng_collect_rollouts``.
* **gym-runtime**: ``gym-runtime server`` (nats-server) and ``gym-runtime start`` (a pool: the
  hosted server in a resource worker, ``agents.simple``, the ``openai`` model adapter), driven by
  ``gym-runtime publish`` + ``collect``. Measured twice by default (``--replicas 1 2``): as
  configured with nothing added, and with ``replicas: 2`` on the hosted server's resource (two
  worker processes on the one bus: how gym-runtime scales a role, which ``ng_run`` cannot do for
  one server). The hosted server's own stack (FastAPI, its middlewares, pydantic) is most of
  gym-runtime's CPU per rollout, and one process runs it on one core at most.

Both deployments are started and made ready first (not timed; their ready times are printed), then
the measured batches alternate between the two systems (``--reps`` each). A batch's **wall** runs
from the driving command's start to its exit; its **CPU** is every process of that system: the
deployment's whole process trees (nats-server, Ray's gcs/raylet/dashboard/workers, every server
and worker; user + system, reaped children included) as deltas over the window, plus the driving
commands' own CPU. The mock's CPU is counted for neither. Same rows (the server's example.jsonl
cycled to ``--rollouts``) and the same concurrency (``num_samples_in_parallel`` = the agent's
``concurrency``) for both. The table shows medians and the load average seen.

    python tests/bench/ng_side_by_side.py [--servers mcqa example_session_state_mgmt]
                                          [--rollouts 500] [--concurrency 32] [--reps 2]
                                          [--replicas 1 2]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from gym_runtime.nemo_gym.hosting import env as hosting_env

REPO = Path(__file__).resolve().parents[2]
MOCK = REPO / "tests/bench/mock_openai.py"

# The model double's answer per server: the message text, the arguments of a call to the first tool.
ANSWERS = {
    "mcqa": {"text": "The answer is \\boxed{B}.", "args": "{}"},
    "example_session_state_mgmt": {"text": "The count is 4.", "args": '{"count": 1}'},
}
# NeMo Gym's servers besides the resources server in its deployment (their requirements: nemo-gym only)
NG_SERVERS = (
    "responses_api_agents/simple_agent",
    "responses_api_models/openai_model",
    "environment_servers/legacy_agent",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_of(proc: psutil.Process) -> float:
    """A process's CPU seconds, its reaped children's included (a child that came and went is counted)."""
    t = proc.cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


@dataclass
class Deployment:
    """One system's long-lived processes: their trees (and session) are what its CPU is summed over."""

    name: str
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    ready_s: float = 0.0

    def members(self) -> dict[tuple[int, float], psutil.Process]:
        """Every live process of the deployment, keyed by (pid, create time): the roots' descendants and
        anything left in their sessions (a daemon re-parented to init, e.g. one of Ray's)."""
        found: dict[tuple[int, float], psutil.Process] = {}
        sids = set()
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(p.pid)
                sids.add(os.getsid(p.pid))
                for q in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        found[(q.pid, q.create_time())] = q
        for q in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getsid(q.pid) in sids:
                    found[(q.pid, q.create_time())] = q
        return found

    def cpu(self) -> dict[tuple[int, float], tuple[str, float]]:
        """CPU seconds per member, with a short label (its name and script) for the breakdown."""
        out = {}
        for key, q in self.members().items():
            with contextlib.suppress(psutil.Error):
                cmd = q.cmdline()
                script = next((Path(a).name for a in cmd[1:3] if a.endswith(".py") or "/" in a), "")
                if not script and "-m" in cmd[1:2] and len(cmd) > 2:  # `python -m MODULE`: a hosted server's guest
                    script = f"-m {cmd[2]}"
                only = cmd[cmd.index("--only") + 1] if "--only" in cmd[:-1] else ""  # a pool's worker child
                out[key] = (f"{q.name()} {script} {only}".strip(), cpu_of(q))
        return out

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGINT)  # each root leads its own process group (start_new_session)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def spawn(argv: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def wait_for_line(log: Path, pattern: str, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text(errors="replace")):
            return
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args!r:.80} exited ({proc.returncode}) before ready; see {log}")
        time.sleep(0.5)
    raise SystemExit(f"not ready within {timeout:g}s; see {log}")


@contextlib.contextmanager
def mock(server: str, tmp: Path) -> Iterator[int]:
    answer = ANSWERS.get(server, {"text": "Done.", "args": "{}"})
    proc = subprocess.Popen(
        [sys.executable, str(MOCK), "--text", answer["text"], "--args", answer["args"]],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline().split()[1])
    finally:
        proc.terminate()
        proc.wait(10)


def inputs(sdir: Path, n: int, tmp: Path) -> Path:
    rows = (sdir / "data" / "example.jsonl").read_text().splitlines()
    path = tmp / f"in_{n}.jsonl"
    path.write_text("".join(rows[i % len(rows)] + "\n" for i in range(n)))
    return path


# ---- NeMo Gym's own deployment -------------------------------------------------------------------


class NemoGym:
    def __init__(self, server: str, port: int, tmp: Path) -> None:
        built = hosting_env.ensure(server)  # the server's environment, as gym-runtime hosts it (cached)
        self.bin = Path(built.base) / "bin"
        self.sp = Path(built.server_dir).parents[1]  # the base's site-packages
        self.sdir = Path(built.server_dir)
        self.tmp = tmp / "ng"
        venvs = self.tmp / "venvs"
        for rel, prefix in [(f"resources_servers/{server}", built.prefix), *((d, built.base) for d in NG_SERVERS)]:
            (venvs / rel).mkdir(parents=True, exist_ok=True)
            (venvs / rel / ".venv").symlink_to(prefix)
        cfg_path = self.sdir / "configs" / f"{server}.yaml"
        self.agent = next(k for k, v in _yaml(cfg_path).items() if isinstance(v, dict) and "responses_api_agents" in v)
        self.head = free_port()
        model_cfg = self.sp / "responses_api_models/openai_model/configs/openai_model.yaml"
        self.argv = [
            str(self.bin / "ng_run"),
            f"+config_paths=[{cfg_path},{model_cfg}]",
            f"+policy_base_url=http://127.0.0.1:{port}/v1",
            "+policy_api_key=mock",
            "+policy_model_name=mock",
            "+skip_venv_if_present=true",
            f"+uv_venv_dir={venvs}",
            "+head_server.host=127.0.0.1",
            f"+head_server.port={self.head}",
        ]
        self.dep = Deployment("NeMo Gym (ng_run)")

    def start(self) -> None:
        log = self.tmp / "ng_run.log"
        t0 = time.perf_counter()
        proc = spawn(self.argv, self.tmp, log)
        self.dep.procs.append(proc)
        wait_for_line(log, r"All \d+ / \d+ servers ready", proc, 600)
        self.dep.ready_s = time.perf_counter() - t0

    def drive(self, inp: Path, out: Path, concurrency: int) -> list[str]:
        return [
            str(self.bin / "ng_collect_rollouts"),
            f"+agent_name={self.agent}",
            f"+input_jsonl_fpath={inp}",
            f"+output_jsonl_fpath={out}",
            f"+num_samples_in_parallel={concurrency}",
            "+head_server.host=127.0.0.1",
            f"+head_server.port={self.head}",
        ]

    def batch(self, inp: Path, n: int, concurrency: int, rep: int) -> Batch:
        out = self.tmp / f"out_{rep}.jsonl"
        return timed(self.dep, [self.drive(inp, out, concurrency)], self.tmp, lambda: rows(out, n))


def _yaml(path: Path) -> dict[str, object]:
    import yaml

    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


# ---- gym-runtime -----------------------------------------------------------------------------------


class GymRuntime:
    def __init__(self, server: str, port: int, tmp: Path, concurrency: int, replicas: int = 1) -> None:
        self.tmp = tmp / f"gr{replicas}"
        self.tmp.mkdir()
        self.nats_port = free_port()
        self.url = f"nats://127.0.0.1:{self.nats_port}"
        self.config = self.tmp / "config.yaml"
        self.config.write_text(
            json.dumps(
                {
                    "models": {
                        "policy": {"adapter": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "model": "mock"}
                    },
                    "resources": {"env": {"nemo_gym": server, "replicas": replicas}},
                    "agents": {
                        "env_agent": {
                            "agent": "agents.simple",
                            "model": "policy",
                            "resource": "env",
                            "max_steps": 10,
                            "concurrency": concurrency,
                        }
                    },
                }
            )
        )
        self.cli = [sys.executable, "-m", "gym_runtime.cli"]
        self.env = {"OPENAI_API_KEY": "mock"}
        name = "gym-runtime" if replicas == 1 else f"gym-runtime, {replicas} server processes"
        self.dep = Deployment(name)

    def start(self) -> None:
        t0 = time.perf_counter()
        slog, wlog = self.tmp / "server.log", self.tmp / "start.log"
        server = spawn([*self.cli, "server", "--port", str(self.nats_port)], self.tmp, slog)
        self.dep.procs.append(server)
        wait_for_line(slog, str(self.nats_port), server, 60)
        workers = spawn([*self.cli, "start", str(self.config), "--nats", self.url], self.tmp, wlog, self.env)
        self.dep.procs.append(workers)
        wait_for_line(wlog, r"workers ready \(", workers, 600)
        self.dep.ready_s = time.perf_counter() - t0

    def batch(self, inp: Path, n: int, concurrency: int, rep: int) -> Batch:
        out = self.tmp / f"out_{rep}.jsonl"
        batch = f"bench-{rep}-{time.time_ns()}"
        publish = [*self.cli, "publish", str(self.config), "-i", str(inp), "--nats", self.url, "--batch", batch]
        publish += ["--agent", "env_agent", "--quiet"]
        collect = [*self.cli, "collect", "--batch", batch, "--nats", self.url, "-o", str(out), "--no-progress"]
        return timed(self.dep, [publish, collect + ["--purge"]], self.tmp, lambda: rows(out, n), self.env)


# ---- measuring ------------------------------------------------------------------------------------


def rows(path: Path, n: int) -> float:
    """The batch's mean reward, once every row is there with a reward."""
    got = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(got) == n, f"{path}: {len(got)} rows, expected {n}"
    assert all("reward" in r for r in got), f"{path}: rows without a reward"
    tools = [sum(o.get("type") == "function_call_output" for o in r["response"]["output"]) for r in got]
    print(f"  {path.parent.name}: {statistics.fmean(tools):.1f} tool outputs per rollout", file=sys.stderr)
    return statistics.fmean(float(r["reward"]) for r in got)


@dataclass
class Batch:
    wall: float
    cpu: float  # the deployment's and the driving commands'
    reward: float  # mean
    by_process: dict[str, float]  # CPU s per process label (the drivers as "driver commands")


def timed(
    dep: Deployment, commands: list[list[str]], cwd: Path, check: Callable[[], float], env: dict[str, str] | None = None
) -> Batch:
    """Run the driving commands one after another and measure the window.

    The deployment's CPU is the delta of every member's own + reaped children's times (a process that
    came and went inside the window, reaped by a member, is in its parent's children times); the
    commands' is this process's reaped-children rusage (they are the only children reaped meanwhile)."""
    before = dep.cpu()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    for argv in commands:
        proc = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=1800
        )
        if proc.returncode != 0:
            raise SystemExit(f"{Path(argv[0]).name} {argv[1:4]} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    after = dep.cpu()
    gone = set(before) - set(after)
    if gone:
        print(f"  note: {len(gone)} {dep.name} processes exited during the batch", file=sys.stderr)
    reward = check()
    by_process: dict[str, float] = {}
    for k, (label, v) in after.items():
        by_process[label] = by_process.get(label, 0.0) + v - (before[k][1] if k in before else 0.0)
    by_process["driver commands"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return Batch(wall, sum(by_process.values()), reward, by_process)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", default=["mcqa", "example_session_state_mgmt"])
    ap.add_argument("--rollouts", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=[1, 2],
        help="gym-runtime deployments to measure, by the hosted server's worker processes (config `replicas`)",
    )
    ap.add_argument(
        "--only-gym-runtime",
        action="store_true",
        help="gym-runtime's side alone (its CPU per process; before/after a change of ours, no NeMo Gym deployment)",
    )
    args = ap.parse_args()
    table = []
    loads = []
    with tempfile.TemporaryDirectory(prefix="ng-side-") as tmp_s:
        for server in args.servers:
            tmp = Path(tmp_s) / server
            tmp.mkdir()
            with mock(server, tmp) as port:
                sdir = Path(hosting_env.ensure(server).server_dir)
                systems: list[NemoGym | GymRuntime] = [
                    GymRuntime(server, port, tmp, args.concurrency, r) for r in args.replicas
                ]
                if not args.only_gym_runtime:
                    systems.insert(0, NemoGym(server, port, tmp))
                try:
                    for s in systems:
                        s.start()
                        print(f"{server}: {s.dep.name} ready in {s.dep.ready_s:.1f} s", file=sys.stderr, flush=True)
                    warm, inp = inputs(sdir, 10, tmp), inputs(sdir, args.rollouts, tmp)
                    for s in systems:  # first requests (imports, connections) out of the measured batches
                        s.batch(warm, 10, args.concurrency, -1)
                    got: dict[str, list[Batch]] = {s.dep.name: [] for s in systems}
                    for rep in range(args.reps):
                        for s in systems if rep % 2 == 0 else systems[::-1]:
                            loads.append(os.getloadavg()[0])
                            b = s.batch(inp, args.rollouts, args.concurrency, rep)
                            got[s.dep.name].append(b)
                            top = sorted(b.by_process.items(), key=lambda kv: -kv[1])[:6]
                            print(
                                f"{server} {s.dep.name} rep {rep}: {b.wall:.1f} s wall, {b.cpu:.1f} CPU s, "
                                f"mean reward {b.reward:.2f}, load {loads[-1]:.1f}; CPU s: "
                                + ", ".join(f"{k} {v:.1f}" for k, v in top),
                                file=sys.stderr,
                                flush=True,
                            )
                finally:
                    for s in systems:
                        s.dep.stop()
                medians = {
                    name: (statistics.median(b.wall for b in v), statistics.median(b.cpu for b in v), v[0].reward)
                    for name, v in got.items()
                }
                table.append((server, medians, {s.dep.name: s.dep.ready_s for s in systems}))
    n = args.rollouts
    print(
        f"\n{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load "
        f"{min(loads):.1f}-{max(loads):.1f}; {n} rollouts per batch, concurrency {args.concurrency}, "
        f"medians of {args.reps} alternated batches\n"
    )
    print("| server | system | rollouts | wall s | rollouts/s | CPU s/rollout | ratio | mean reward | ready s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for server, med, ready in table:
        ng_wall, ng_cpu, _ = med.get("NeMo Gym (ng_run)", (0.0, 0.0, 0.0))
        for name, (wall, cpu, reward) in med.items():
            ratio = (
                "1"
                if name.startswith("NeMo") or not ng_wall
                else f"{ng_wall / wall:.1f}x throughput, {cpu / ng_cpu:.2f}x CPU"
            )
            print(
                f"| {server} | {name} | {n} | {wall:.1f} | {n / wall:.0f} | {cpu / n * 1000:.1f} ms | {ratio} "
                f"| {reward:.2f} | {ready[name]:.0f} |"
            )


if __name__ == "__main__":
    main()
