"""What one honest huge row costs in memory: peak RSS (VmHWM) above idle of each process it passes through.

One weather task whose tool answers ``--size`` bytes (``tests/envs/big``: the scripted policy quotes it, so the
result row, as JSON, about twice that: 45 MB gives a ~90 MB row) runs through real processes on a real
nats-server: the agent, environment and model pools (``gym-runtime start --only ...``, one process each), a
trainer's ``Client`` (submit, then ``gather``) and ``gym-runtime collect`` reading the stored row. Each
process's idle is its VmHWM once it is up (the client's and the collector's: imported and connected); its
peak is VmHWM after the row went through. ``--load N`` keeps N busy-looping processes running meanwhile (a
loaded machine). The bound the runtime holds (issue 33): agent worker, collector and client each at most
3× the row above idle.

    python tests/bench/big_row.py [--size 45000000] [--load 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402

CONFIG = """namespace: gym
models:
  policy: {{adapter: scripted}}
resources:
  weather: {{server: tests.envs.big, options: {{size: {size}}}}}
agents:
  weather_agent: {{agent: agents.simple, model: policy, resource: weather, max_steps: 8, timeout_s: 600}}
"""
ROW = json.loads((REPO / "resources/weather/data/example.jsonl").read_text().splitlines()[0])
POOLS = ("agents.weather_agent", "resources.weather", "models.policy")


def hwm_kb(pid: int) -> int:
    """A process's peak resident set (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for {pid}")


CHILD = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})

def hwm():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

role, url, config, batch, out = sys.argv[1:6]
if role == "client":
    from gym_runtime.client import Client
    from gym_runtime.config import load_config, resolve_models
    from gym_runtime.service.loop import run_async

    async def run():
        async with Client(resolve_models(load_config(config)), nats=url, workers=False) as client:
            idle = hwm()
            b = await client.submit([json.loads({row_json!r})], repeats=1, batch=batch)
            rows = await b.gather()
            peak = hwm()  # before this script measures the row (its own JSON text would count)
            ok = len(rows) == 1 and rows[0].get("reward") == 1.0
            return idle, peak, len(json.dumps(rows[0])), None if ok else str(rows[0].get("error"))[:200]

    idle, peak, size, error = run_async(run)
    print(json.dumps({{"idle": idle, "peak": peak, "row_bytes": size, "error": error}}))
else:
    from gym_runtime.cli import main
    import gym_runtime.service.runner, gym_runtime.data.collector, gym_runtime.cli.collect  # what collect imports
    idle = hwm()
    rc = main(["collect", "--batch", batch, "--nats", url, "-o", out, "--no-progress", "--wait", "0"])
    print(json.dumps({{"idle": idle, "peak": hwm(), "rc": rc, "row_bytes": Path(out).stat().st_size}}))
"""


def child(role: str, url: str, config: Path, batch: str, out: Path) -> dict[str, Any]:
    code = CHILD.format(repo=str(REPO), row_json=json.dumps(ROW))
    res = subprocess.run(
        [sys.executable, "-c", code, role, url, str(config), batch, str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "GYM_LOG_LEVEL": "warning"},
    )
    if res.returncode != 0:
        raise RuntimeError(f"{role} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(size: int, load: int = 0) -> dict[str, Any]:
    """Run one row of ``size`` through the pools, a client and ``collect``: each process's (idle, peak) bytes,
    the row's size, and the client's error if the rollout failed."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "config.yaml"
            config.write_text(CONFIG.format(size=size))
            srv = EmbeddedServer(store_dir=str(Path(tmp) / "js"))
            srv.start()
            try:
                for pool in POOLS:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "gym_runtime.cli", "start", str(config), "--nats", srv.url]
                            + ["--only", pool],
                            cwd=REPO,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            env={**os.environ, "GYM_LOG_LEVEL": "warning", "PYTHONPATH": str(REPO)},
                        )
                    )
                _wait_up(srv.url)
                idle = {pool: hwm_kb(p.pid) * 1024 for pool, p in zip(POOLS, procs, strict=True)}
                t0 = time.perf_counter()
                client = child("client", srv.url, config, "big", Path(tmp) / "client.jsonl")
                took = time.perf_counter() - t0
                collect = child("collect", srv.url, config, "big", Path(tmp) / "out.jsonl")
                peak = {pool: hwm_kb(p.pid) * 1024 for pool, p in zip(POOLS, procs, strict=True)}
            finally:
                srv.stop()
    finally:
        for p in [*procs, *hogs]:
            p.terminate()
        for p in [*procs, *hogs]:
            p.wait()
    return {
        "row_bytes": client["row_bytes"] if client["error"] is None else 2 * size,  # a failure row: what it would be
        "error": client["error"],
        "seconds": took,
        "load": os.getloadavg()[0],
        "processes": {
            "agent worker": (idle[POOLS[0]], peak[POOLS[0]]),
            "environment worker": (idle[POOLS[1]], peak[POOLS[1]]),
            "model worker": (idle[POOLS[2]], peak[POOLS[2]]),
            "client (gather)": (client["idle"], client["peak"]),
            "collector": (collect["idle"], collect["peak"]),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=45_000_000, help="bytes of the tool's answer (the row: ~2×)")
    ap.add_argument("--load", type=int, default=0, help="busy-looping processes running meanwhile")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    got = measure(args.size, args.load)
    row = got["row_bytes"]
    mb = 1 / 1e6
    print(f"row {row * mb:.1f} MB (JSON); load {got['load']:.1f} ({args.load} busy loops); {got['seconds']:.1f} s")
    if got["error"]:
        print(f"the rollout FAILED: {got['error']}")
    print(f"{'process':<20} {'idle MB':>9} {'peak MB':>9} {'above idle':>11} {'× row':>7}")
    for name, (i, p) in got["processes"].items():
        print(f"{name:<20} {i * mb:>9.1f} {p * mb:>9.1f} {(p - i) * mb:>11.1f} {(p - i) / row:>7.2f}")
    if args.json:
        args.json.write_text(json.dumps(got, indent=1))


def _wait_up(url: str) -> None:
    """Until the three pools answer ``status``."""
    code = (
        f"import sys, json\nfrom gym_runtime.cli import main\nsys.exit(main(['status', '--nats', {url!r}, '--json']))"
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
        try:
            workers = json.loads(res.stdout)["workers"]
        except (ValueError, KeyError, TypeError):
            workers = []
        if len(workers) >= len(POOLS):
            return
        time.sleep(0.5)
    raise RuntimeError("the pools did not come up")


if __name__ == "__main__":
    main()
