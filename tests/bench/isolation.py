"""What ``isolation: process`` costs a rollout: weather's code in a guest process vs in the worker; with
``--hosted mcqa``, a hosted NeMo Gym server's code in a guest on its built environment's Python (the worker
and its bus on ours) vs the worker, its bus and the server's code in one child on that Python.

Times the whole ``gym-runtime run`` command (one process for every role, ``--processes one``, the scripted
policy), alternating the two settings so that a loaded machine's drift hits both alike, and prints the median
wall time, rollouts/s and CPU seconds per rollout (the command and every process it waited for: the embedded
nats-server, the guest) of ``--reps`` runs, with the load average. For the steadier instruction count per
rollout: ``tests/bench/instructions.py --isolation process`` (children traced).

    python tests/bench/isolation.py [--rollouts 2000] [--reps 5] [--concurrency 64] [--hosted mcqa]
"""

from __future__ import annotations

import argparse
import os
import resource
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
    from gym_runtime.hosting import env as hosting_env

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


def one(config: Path, entry: str, mode: str, inp: Path, out: Path, concurrency: int) -> tuple[float, float]:
    """Wall seconds and CPU seconds (the command and its children) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable, "-m", "gym_runtime.cli", "run", str(config), "-i", str(inp), "-o", str(out), "-q",
            "--processes", "one", "--concurrency", str(concurrency),
            "--set", f"resources.{entry}.isolation={mode}",
        ],
        check=False, cwd=REPO, stdout=subprocess.DEVNULL,
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
    args = ap.parse_args()
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    cpus: dict[str, list[float]] = {m: [] for m in MODES}
    loads = []
    with tempfile.TemporaryDirectory() as d:
        config, data, entry = hosted(args.hosted, Path(d)) if args.hosted else (CONFIG, DATA, "weather")
        rows = data.read_text().splitlines()
        inp = Path(d) / "in.jsonl"
        inp.write_text("".join(rows[i % len(rows)] + "\n" for i in range(args.rollouts)))
        for rep in range(args.reps):
            for mode in MODES if rep % 2 == 0 else reversed(MODES):
                wall, cpu = one(config, entry, mode, inp, Path(d) / "out.jsonl", args.concurrency)
                walls[mode].append(wall)
                cpus[mode].append(cpu)
                loads.append(os.getloadavg()[0])
    n = args.rollouts
    print(
        f"{args.hosted or 'weather'}, scripted policy, {n} rollouts, --processes one, {args.concurrency} in flight; "
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


if __name__ == "__main__":
    main()
