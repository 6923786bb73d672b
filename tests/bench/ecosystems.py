"""Rollouts/s per ecosystem next to native ``weather``, in one harness: the table of docs/bring-your-environment.md.

One process: an embedded nats-server, one ``Client(cfg, nats=url, workers=...)`` whose config holds every
setup's agent (and resource) at once, its workers in this process (a hosted NeMo Gym agent's in a ``start``
child, where they must run), so every worker is warm before the first timed run; the ``scripted``
model (the LLM test double, zero latency) for all. Per setup a warm-up batch first (imports, guests, caches
out of the measure), then ``--reps`` runs of ``--rows`` rollouts each, ALTERNATING between setups (the order
reversed every other rep) so that a loaded machine's drift hits each alike. Every run's rows are checked (no
failure row, a numeric reward each, the setup's own check: what its environment pays the scripted answers),
so a broken setup cannot print a fast number. Prints rollouts/s (median, min-max) and the load average.

    python tests/bench/ecosystems.py [--rows 1000] [--reps 3] [--warmup 100] [--only weather,openenv] [--with nemo_gym]

Adding a setup is one ``Setup`` entry in ``SETUPS`` (its config entries, its rows, its check).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
ENVS = REPO / "tests" / "envs"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(ENVS))

from gym_runtime import Client
from gym_runtime.config import config_from_dict, resolve_config
from gym_runtime.harbor.hosting import ensure_config_images
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.service.loop import run_async

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class Setup:
    """One column of the table: an agent (and its resource) of the shared config, its rows, its check."""

    name: str  # the table's label
    agent: str  # its agent entry (the rows are submitted to it)
    agents: dict[str, Any]
    rows: Callable[[], Rows]  # its distinct rows (cycled to --rows); called before the loop starts
    check: Callable[[Rows], str | None]  # what is wrong with a run's rows (None: nothing)
    resources: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # where its code runs
    opt_in: str = ""  # why it runs only when named in --with (what it needs first)
    child: bool = False  # its agent's workers run in a `gym-runtime start --only` child (a hosted agent's must)
    sandboxes: dict[str, Any] = field(default_factory=dict)  # the sandbox pools its resource uses
    rows_per_run: int = 0  # its own rollouts a run (0: --rows): a container per rollout makes 1,000 too long


SCRIPTED_ANSWERS = {"say blue": "blue", "say red": "red"}  # "say green" gets "OK": rewards differ by row


def _rewards(rows: Rows) -> list[float]:
    return [float(r["reward"]) for r in rows]


# ---------------------------------------------------------------------------- native weather


def weather_rows() -> Rows:
    lines = (REPO / "resources/weather/data/example.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def weather_check(rows: Rows) -> str | None:
    # its verify pays 1.0 for a get_weather call, which the scripted model makes on every row
    return None if set(_rewards(rows)) == {1.0} else f"weather rewards {sorted(set(_rewards(rows)))}, not all 1.0"


# ---------------------------------------------------------------------------- verifiers 0.3.x


def vf_rows() -> Rows:
    return [
        {"responses_create_params": {"input": [{"role": "user", "content": f"say {c}"}]}, "verifiers": {"answer": c}}
        for c in ("blue", "red", "green")
    ]


def vf_check(rows: Rows) -> str | None:
    # vf_suite's single-turn rubric: exact (1.0 for the colour) less 0.005 a character (its 0.5-weighted length
    # penalty); the scripted model answers the colour for blue and red, "OK" for green
    by = {r["verifiers"]["answer"]: float(r["reward"]) for r in rows if "verifiers" in r}
    want = {"blue": 0.98, "red": 0.985, "green": -0.01}
    if not by or any(abs(by[c] - want[c]) > 1e-6 for c in by):
        return f"verifiers rewards {by}, expected {want}"
    return None


# ---------------------------------------------------------------------------- OpenEnv 0.10


def openenv_rows() -> Rows:
    from openenv_counter import CountAction

    from gym_runtime.resources.openenv import action_tool

    tool = action_tool(CountAction)
    return [
        {
            "responses_create_params": {"input": [{"role": "user", "content": f"count from {s}"}], "tools": [tool]},
            "openenv_reset": {"start": s},
        }
        for s in (3, 4, 5)
    ]


def openenv_check(rows: Rows) -> str | None:
    # the scripted model steps once (delta 1); CountEnv pays at its second step, so each episode is one
    # step with reward 0.0, not done
    bad = [r for r in rows if r.get("step_rewards") != [0.0] or r.get("done") is not False]
    return f"{len(bad)} OpenEnv rows not one unpaid step: {bad[0]}" if bad else None


# ---------------------------------------------------------------------------- OpenReward ORS


def ors_rows() -> Rows:
    from ors_quiz import Quiz

    from gym_runtime.resources.openreward.rows import rows_in_process

    return rows_in_process(Quiz, "train")


def ors_check(rows: Rows) -> str | None:
    # Quiz pays 1.0 for its solution: the scripted "example" solves q0 and q2, not q1 ("4")
    want = {"q0": 1.0, "q1": 0.0, "q2": 1.0}
    by = {r["task_spec"]["id"]: float(r["reward"]) for r in rows}
    return None if by == {k: want[k] for k in by} else f"ORS rewards {by}, expected {want}"


# ---------------------------------------------------------------------------- verifiers 0.4


VF04_ENV = {"taskset": {"id": "vf04_suite", "task": {"kind": "single"}}, "agent": {"harness": {"id": "null"}}}


def vf04_rows() -> Rows:
    return [{"responses_create_params": {"input": []}, "verifiers": {"index": i}} for i in range(3)]


def vf04_check(rows: Rows) -> str | None:
    # vf04_suite's single task: exact_match (weight 1) and mentions_answer (weight 0.5) of the colour; the
    # scripted model answers the colour for blue and red (both rewards), "OK" for green (neither)
    by = {r["verifiers"]["index"]: float(r["reward"]) for r in rows}
    paid, unpaid = by.get(0), by.get(2)
    if paid is None or unpaid is None or by.get(1) != paid or not paid > unpaid:
        return f"verifiers 0.4 rewards {by}: expected blue = red > green"
    return None


# ---------------------------------------------------------------------------- Harbor tasks

HARBOR_TASKS = REPO / "tests" / "harbor_tasks"  # read-file, compile-c, partial-stats
HARBOR_BASES = {"debian:bookworm-slim": "base", "python:3.12-slim": "base"}


def harbor_rows() -> Rows:
    from gym_runtime.resources.harbor import dataset_rows

    return dataset_rows({"tasks": str(HARBOR_TASKS)}, "train")


def harbor_check(rows: Rows) -> str | None:
    # the scripted model runs `example` in the task's container and answers: nothing solved, but partial-stats
    # pays its no-op share (its data file left intact)
    want = {"read-file": 0.0, "compile-c": 0.0, "partial-stats": 0.25}
    by = {r["harbor_task"]: float(r["reward"]) for r in rows}
    return None if by == {k: want[k] for k in by} else f"Harbor rewards {by}, expected {want}"


AGENT = {"model": "policy", "max_attempts": 1, "timeout_s": 600}

SETUPS = [
    Setup(
        "weather (native)",
        "weather",
        {"weather": {"agent": "agents.simple", "resource": "weather", "max_steps": 8, **AGENT}},
        weather_rows,
        weather_check,
        resources={"weather": {"server": "resources.weather"}},
        note="resources.weather in the worker",
    ),
    Setup(
        "verifiers 0.3",
        "vf",
        {"vf": {"agent": "agents.verifiers_env", **AGENT, "options": {"env_id": "vf_suite"}}},
        vf_rows,
        vf_check,
        note="vf_suite single-turn, guest process",
    ),
    Setup(
        "verifiers 0.4",
        "vf04",
        # each rollout runs verifiers' harness program in a subprocess of its own (its local runtime): 8 in flight,
        # not the default 64 (64 Python processes at once on 2 cores drove the load to 80 and timed publishes out)
        {"vf04": {"agent": "agents.verifiers_v1", **AGENT, "concurrency": 8, "options": {"env": VF04_ENV}}},
        vf04_rows,
        vf04_check,
        note="vf04_suite single-turn, guest on its built env",
        opt_in="verifiers 0.4's built environment (`gym-runtime env build --verifiers`, a Python >= 3.12)",
    ),
    Setup(
        "OpenEnv 0.10",
        "openenv",
        {"openenv": {"agent": "agents.simple", "resource": "counter", "max_steps": 6, **AGENT}},
        openenv_rows,
        openenv_check,
        resources={"counter": {"server": "resources.openenv", "options": {"env": "openenv_counter:CountEnv"}}},
        note="CountEnv class, tool mode, guest process",
    ),
    Setup(
        "OpenReward ORS",
        "ors",
        {"ors": {"agent": "agents.simple", "resource": "quiz", "max_steps": 4, **AGENT}},
        ors_rows,
        ors_check,
        resources={"quiz": {"server": "resources.openreward", "options": {"env": "ors_quiz:Quiz"}}},
        note="ors_quiz Quiz class, guest process",
    ),
    Setup(
        "NeMo Gym agent",
        "nemo_gym",
        {"nemo_gym": {"nemo_gym": "simple_agent", "resource": "weather", "max_steps": 8, **AGENT}},
        weather_rows,
        weather_check,
        resources={"weather": {"server": "resources.weather"}},
        note="simple_agent on native weather, its child on the built env",
        opt_in="nemo-gym's built environment (a Python >= 3.13; `gym-runtime env build`)",
        child=True,
    ),
    Setup(
        "Harbor tasks",
        "harbor",
        {"harbor": {"agent": "agents.simple", "resource": "harbor", "max_steps": 4, **AGENT}},
        harbor_rows,
        harbor_check,
        resources={
            "harbor": {
                "server": "resources.harbor",
                "sandbox": "harbor",
                "options": {"tasks": str(HARBOR_TASKS), "base_images": HARBOR_BASES},
            }
        },
        sandboxes={
            "harbor": {
                "backend": "docker",
                "engine": os.environ.get("DOCKER_HOST", ""),
                "rootfs": "writable",
                "limits": {"memory_mb": 2048, "pids": 512, "timeout_s": 120},
            }
        },
        note="3 tasks, bash in a container created per rollout",
        opt_in="a Docker engine (DOCKER_HOST; the tasks' images are built here when missing)",
        rows_per_run=30,
    ),
]


def config(setups: list[Setup]) -> dict[str, Any]:
    """One config holding every setup's entries (their names are distinct)."""
    raw: dict[str, Any] = {
        "models": {"policy": {"adapter": "scripted", "answers": SCRIPTED_ANSWERS}},
        "sandboxes": {},
        "resources": {},
        "agents": {},
    }
    for s in setups:
        raw["sandboxes"].update(s.sandboxes)
        raw["resources"].update(s.resources)
        raw["agents"].update(s.agents)
    return {k: v for k, v in raw.items() if v}


def start_child(d: Path, setups: list[Setup], setup: Setup, url: str) -> subprocess.Popen[str]:
    """``gym-runtime start --only agents.AGENT`` on the shared config (written to ``d``), once its workers are up."""
    path = d / "config.yaml"
    path.write_text(yaml.safe_dump(config(setups)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(path), "--nats", url, "--only", f"agents.{setup.agent}"],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("workers ready"):
        proc.kill()
        raise SystemExit(f"{setup.name}: its workers did not start ({line.strip() or proc.wait()})")
    return proc


def check(setup: Setup, rows: Rows, n: int) -> None:
    """Stop the bench when a run's rows are not what the setup's environment pays."""
    failed = [r for r in rows if "error_class" in r]
    problem = (
        f"{len(rows)} rows for {n}"
        if len(rows) != n
        else f"{len(failed)} failure rows, e.g. {failed[0]['error_class']}: {failed[0]['error']}"
        if failed
        else "a row without a numeric reward"
        if not all(isinstance(r.get("reward"), (int, float)) for r in rows)
        else setup.check(rows)
    )
    if problem:
        raise SystemExit(f"{setup.name}: {problem}")


async def bench(args: argparse.Namespace, setups: list[Setup], base: dict[str, Rows], url: str) -> dict[str, Any]:
    rates: dict[str, Any] = {s.name: [] for s in setups}
    loads: list[float] = []
    raw = config(setups)
    here = [f"{role}.{name}" for role in ("models", "sandboxes", "resources", "agents") for name in raw.get(role, {})]
    here = [w for w in here if w not in {f"agents.{s.agent}" for s in setups if s.child}]
    loaded = config_from_dict(raw, source="ecosystems bench")
    await ensure_config_images(loaded, note=print)  # Harbor's task images, built once (by content hash)
    async with Client(resolve_config(loaded), nats=url, workers=here) as client:
        for s in setups:  # warm-up: every setup once, its rows checked
            warm = [base[s.name][i % len(base[s.name])] for i in range(min(args.warmup, s.rows_per_run or args.warmup))]
            check(s, await (await client.submit(warm, agent=s.agent)).gather(), len(warm))
        for rep in range(args.reps):
            for s in setups if rep % 2 == 0 else list(reversed(setups)):
                n = s.rows_per_run or args.rows
                rows = [base[s.name][i % len(base[s.name])] for i in range(n)]
                t0 = time.perf_counter()
                got = await (await client.submit(rows, agent=s.agent)).gather()
                took = time.perf_counter() - t0
                check(s, got, n)
                rates[s.name].append(n / took)
                loads.append(os.getloadavg()[0])
                got_rate = rate(rates[s.name][-1])
                print(f"rep {rep + 1} {s.name:<18} {got_rate:>8} rollouts/s  load {loads[-1]:.1f}", flush=True)
    rates["_load"] = loads
    return rates


def rate(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1000, help="rollouts a timed run")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per setup, alternated")
    ap.add_argument("--warmup", type=int, default=100, help="rollouts of each setup's warm-up batch")
    ap.add_argument("--only", default="", help="comma-separated setups by agent name (e.g. weather,openenv)")
    extra = ", ".join(f"{s.agent} ({s.opt_in})" for s in SETUPS if s.opt_in)
    ap.add_argument("--with", dest="extra", default="", help=f"comma-separated opt-in setups: {extra}")
    args = ap.parse_args()
    wanted = {k.strip() for k in args.extra.split(",") if k.strip()}
    unknown = wanted - {s.agent for s in SETUPS if s.opt_in}
    if unknown:
        print(f"--with {', '.join(sorted(unknown))}: not an opt-in setup (they are: {extra})", file=sys.stderr)
        raise SystemExit(2)
    setups = [s for s in SETUPS if not s.opt_in or s.agent in wanted]
    if args.only:
        keys = {k.strip().lower() for k in args.only.split(",")}
        setups = [s for s in setups if s.agent in keys]
        if not setups:
            print(f"--only {args.only!r} names no setup ({', '.join(s.agent for s in SETUPS)})", file=sys.stderr)
            raise SystemExit(2)
    # guests (verifiers', OpenEnv's, ORS's environment code in their own process) import tests/envs modules
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENVS), os.environ.get("PYTHONPATH", "")) if p)
    os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
    os.environ.setdefault("OPENREWARD_LOG_LEVEL", "WARNING")  # the SDK's own knob: no log line per tool call
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(store_dir=str(Path(d) / "js")) as srv:
        base = {s.name: s.rows() for s in setups}  # outside the event loop (ORS's reads run one of their own)
        children = [start_child(Path(d), setups, s, srv.url) for s in setups if s.child]
        try:
            rates = run_async(lambda: bench(args, setups, base, srv.url))
        finally:
            for proc in children:
                proc.terminate()
                proc.wait(60)
    loads = rates.pop("_load")
    print(
        f"\n{args.rows} rollouts a run, {args.reps} alternated runs after a {args.warmup}-rollout warm-up, scripted "
        f"model, one process (guests and hosted agents' children aside); load average "
        f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs"
    )
    print(f"{'setup':<18} {'median/s':>9} {'min-max/s':>12}  where")
    for s in setups:
        xs = rates[s.name]
        span = f"{rate(min(xs))}-{rate(max(xs))}"
        runs = f" ({s.rows_per_run} rollouts a run)" if s.rows_per_run else ""
        print(f"{s.name:<18} {rate(statistics.median(xs)):>9} {span:>12}  {s.note}{runs}")


if __name__ == "__main__":
    main()
