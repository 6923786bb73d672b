"""What ``isolation: process`` costs a rollout: weather's code in a guest process vs in the worker; with
``--hosted mcqa``, a hosted NeMo Gym server's code in a guest on its built environment's Python (the worker
and its bus on ours) vs the worker, its bus and the server's code in one child on that Python; with
``--verifiers``, a verifiers environment (tests/envs/vf_suite.py's single-turn one: its rollout loop and rubric) in
the agent worker's guest vs in the agent worker (``agents.vf.isolation``), where ``--small`` rollouts a run are also
timed so that the worker's start (verifiers' imports) can be taken out: the marginal cost of a rollout.

Times the whole ``gym-runtime run`` command (one process for every role, ``--processes one``, the scripted
policy), alternating the two settings so that a loaded machine's drift hits both alike, and prints the median
wall time, rollouts/s and CPU seconds per rollout (the command and every process it waited for: the embedded
nats-server, the guest) of ``--reps`` runs, with the load average. For the steadier instruction count per
rollout: ``tests/bench/instructions.py --isolation process`` (children traced).

    python tests/bench/isolation.py [--rollouts 2000] [--reps 5] [--concurrency 64] [--hosted mcqa | --verifiers]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "resources/weather/config.yaml"
DATA = REPO / "resources/weather/data/example.jsonl"
MODES = ("none", "process")


def hosted(server: str, d: Path) -> tuple[Path, Path, str]:
    """A config hosting NeMo Gym's ``server`` (its environment built if missing) and its example rows."""
    from gym_runtime.nemo_gym.hosting import env as hosting_env

    built = hosting_env.ensure(server)
    config = d / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": {"policy": {"adapter": "scripted"}},
                "resources": {"env": {"nemo_gym": server}},
                "agents": {"agent": {"agent": "agents.simple", "model": "policy", "resource": "env"}},
            }
        )
    )
    return config, Path(built.server_dir) / "data" / "example.jsonl", "env"


def verifiers(d: Path) -> tuple[Path, Path, str]:
    """A config running vf_suite's single-turn environment (copied beside it: run outside the checkout, whose
    ``agents`` folder shadows openai-agents') and its three rows."""
    shutil.copy(REPO / "tests/envs/vf_suite.py", d / "vf_suite.py")
    config = d / "config.yaml"
    agent = {"agent": "agents.verifiers_env", "model": "policy", "options": {"env_id": "vf_suite"}}
    config.write_text(yaml.safe_dump({"models": {"policy": {"adapter": "scripted"}}, "agents": {"vf": agent}}))
    rows = d / "vf_rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"responses_create_params": {"input": f"say {c}"}, "verifiers": {"answer": c}}) + "\n"
            for c in ("blue", "red", "green")
        )
    )
    return config, rows, "vf"


def one(config: Path, entry: str, mode: str, inp: Path, out: Path, concurrency: int) -> tuple[float, float]:
    """Wall seconds and CPU seconds (the command and its children) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    key = f"agents.{entry}" if entry == "vf" else f"resources.{entry}"
    done = subprocess.run(
        [
            sys.executable, "-m", "gym_runtime.cli", "run", str(config), "-i", str(inp), "-o", str(out), "-q",
            "--processes", "one", "--concurrency", str(concurrency),
            "--set", f"{key}.isolation={mode}",
        ],
        check=False, cwd=config.parent if entry == "vf" else REPO, stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(config.parent)} if entry == "vf" else None,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.returncode  # 1: some rows failed (a scripted policy's wrong answers)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--hosted", default="", help="a NeMo Gym resources server to host instead of weather")
    ap.add_argument("--verifiers", action="store_true", help="a verifiers environment instead of weather")
    ap.add_argument("--small", type=int, default=12, help="--verifiers: rollouts of the run timed for the start")
    args = ap.parse_args()
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    cpus: dict[str, list[float]] = {m: [] for m in MODES}
    starts: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    loads = []
    with tempfile.TemporaryDirectory() as d:
        if args.verifiers:
            config, data, entry = verifiers(Path(d))
        else:
            config, data, entry = hosted(args.hosted, Path(d)) if args.hosted else (CONFIG, DATA, "weather")
        rows = data.read_text().splitlines()
        inp = Path(d) / "in.jsonl"
        inp.write_text("".join(rows[i % len(rows)] + "\n" for i in range(args.rollouts)))
        small = Path(d) / "small.jsonl"
        small.write_text("".join(rows[i % len(rows)] + "\n" for i in range(args.small)))
        for rep in range(args.reps):
            for mode in MODES if rep % 2 == 0 else reversed(MODES):
                wall, cpu = one(config, entry, mode, inp, Path(d) / "out.jsonl", args.concurrency)
                walls[mode].append(wall)
                cpus[mode].append(cpu)
                if args.verifiers:
                    starts[mode].append(one(config, entry, mode, small, Path(d) / "out.jsonl", args.concurrency))
                loads.append(os.getloadavg()[0])
    n = args.rollouts
    what = "verifiers (vf_suite single)" if args.verifiers else args.hosted or "weather"
    print(
        f"{what}, scripted policy, {n} rollouts, --processes one, {args.concurrency} in flight; "
        f"medians of {args.reps} alternated runs; load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print(f"{'isolation':<10} {'wall s':>8} {'rollouts/s':>11} {'CPU ms/rollout':>15}")
    base_wall, base_cpu = statistics.median(walls["none"]), statistics.median(cpus["none"])
    for mode in MODES:
        w, c = statistics.median(walls[mode]), statistics.median(cpus[mode])
        print(
            f"{mode:<10} {w:>8.2f} {n / w:>11.0f} {1000 * c / n:>15.3f}"
            f"   ({100 * (w / base_wall - 1):+.1f}% wall, {100 * (c / base_cpu - 1):+.1f}% CPU)"
        )
    if args.verifiers:  # the start taken out: each rep's big run less its small run, per rollout more
        m = n - args.small
        print(f"marginal, the start taken out ({n} less {args.small} rollouts a rep):")
        for mode in MODES:
            w = statistics.median(b - s[0] for b, s in zip(walls[mode], starts[mode], strict=True))
            c = statistics.median(b - s[1] for b, s in zip(cpus[mode], starts[mode], strict=True))
            s0 = statistics.median(s[0] for s in starts[mode])
            print(f"{mode:<10} {m / w:>8.0f} rollouts/s {1000 * c / m:>8.3f} CPU ms/rollout   (start: {s0:.2f} s wall)")


if __name__ == "__main__":
    main()
