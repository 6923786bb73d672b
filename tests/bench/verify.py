"""Verification throughput: verifies/s per environment with 1 and 2 resource replicas.

Each environment's recorded NeMo Gym rollouts (joined with their task rows) are
repeated to N rows and re-verified through the stateless verify queue group;
every replica is its own process (``gym-runtime start --only resources.X``), so
CPU-heavy verifiers (process pools, sandboxes) scale across cores.

    python tests/bench/verify.py [--n 200] [--envs mcqa code_gen ...] [--swe-rollouts 8]

``google_search`` re-verifies with its offline backend (BM25 over the bundled
corpus; verify itself needs no search), and a second table times the offline
backend's searches. The SWE row runs whole rollouts, not re-verifications: the
replay adapter drives ``agents.swe`` on the local backend (the project's sandbox)
over a tiny repository task (half the rollouts fix it and run its tests, half
loop until the command timeout), each graded in a fresh sandbox.

The N rows repeat the few recorded rollouts, so verifiers that cache per process
(math-verify parses) look faster on the timed pass than on fresh answers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.config import resolve_config
from gym_runtime.data.reverify import load_tasks, reverify_file  # noqa: E402
from gym_runtime.observability.tracing import Telemetry  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from gym_runtime.service.loop import run_async  # noqa: E402
from gym_runtime.transport.bus import Bus  # noqa: E402

COMPAT = REPO / "tests" / "compat" / "nemo_gym"
# environment -> compat folder holding example_rollouts.jsonl joined with example.jsonl
ENVS = {
    "multi_step": "example_multi_step",
    "counter": "example_session_state_mgmt",
    "mcqa": "mcqa",
    "instruction_following": "instruction_following",
    "reasoning_gym": "reasoning_gym",
    "math": "math_with_judge",
    "code_gen": "code_gen",
    "google_search": "google_search",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--envs", nargs="+", default=list(ENVS))
    ap.add_argument("--swe-rollouts", type=int, default=8, help="SWE local-backend rollouts (0: skip)")
    args = ap.parse_args()
    print(f"re-verifying N={args.n} recorded rollouts per environment\n")
    print(f"{'environment':>22} | {'1 replica /s':>12} | {'2 replicas /s':>13}")
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(store_dir=str(Path(d) / "js")) as srv:
        tmp = Path(d)
        for env in args.envs:
            folder = COMPAT / ENVS[env]
            cfg = REPO / "resources" / env / "config.yaml"
            if not (folder / "example_rollouts.jsonl").is_file() or not cfg.is_file():
                print(f"{env:>22} | (no data or environment)")
                continue
            lines = [x for x in (folder / "example_rollouts.jsonl").read_text().splitlines() if x.strip()]
            src = tmp / f"{env}.jsonl"
            src.write_text("".join(lines[i % len(lines)] + "\n" for i in range(args.n)))
            tasks = load_tasks(folder / "example.jsonl")
            rates = []
            for replicas in (1, 2):
                ns = f"v{env.replace('_', '')}{replicas}"
                pool = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "gym_runtime.cli",
                        "start",
                        str(cfg),
                        "--nats",
                        srv.url,
                        "--only",
                        f"resources.{env}",
                        "--replicas",
                        str(replicas),
                        "--set",
                        f"namespace={ns}",
                    ],
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
                assert pool.stdout is not None and "ready" in pool.stdout.readline()

                async def go(ns: str = ns, env: str = env, src: Path = src, tasks: Path | None = tasks) -> float:
                    bus = await Bus.connect(srv.url, namespace=ns, telemetry=Telemetry(), name="bench")
                    # warm-up: process pools start and import their libraries on first use
                    await reverify_file(bus, env, src, tmp / "warm.jsonl", tasks=tasks, in_flight=8)
                    t0 = time.perf_counter()
                    report = await reverify_file(bus, env, src, tmp / "out.jsonl", tasks=tasks, in_flight=64)
                    elapsed = time.perf_counter() - t0
                    await bus.close()
                    assert report.failed == 0, report.lines()
                    return report.rows / elapsed

                rates.append(run_async(go))
                pool.terminate()
                pool.wait(60)
            print(f"{env:>22} | {rates[0]:>12.1f} | {rates[1]:>13.1f}")
        if "google_search" in args.envs:
            bench_offline_search()
        if args.swe_rollouts:
            bench_swe(srv.url, tmp, args.swe_rollouts)


def bench_offline_search(n: int = 2000) -> None:
    """Searches/s of the offline BM25 backend on the bundled corpus (distinct queries: no cache hits)."""
    import anyio

    from gym_runtime.resources.google_search.backends import OfflineBackend, SearchOptions

    words = [
        "carnot",
        "efficiency",
        "coulomb",
        "force",
        "charges",
        "rna",
        "ubiquitination",
        "alkyne",
        "mercury",
        "hydration",
        "time",
        "reversal",
        "acoustics",
        "scattering",
        "heat",
        "capacity",
    ]
    queries = [f"{words[i % 16]} {words[(i * 7) % 16]} {words[(i * 11) % 16]} {i}" for i in range(n)]
    backend = OfflineBackend(SearchOptions(top_k=10, cache_size=1))

    async def go() -> float:
        t0 = time.perf_counter()
        for q in queries:
            await backend.search(q)
        return n / (time.perf_counter() - t0)

    print(f"\n{'offline search (BM25)':>22} | {anyio.run(go):>10.0f} searches/s over {len(backend.pages)} pages")


def bench_swe(url: str, tmp: Path, rollouts: int) -> None:
    """Rollouts/min of agents.swe on the local backend (sandboxed shell + grading), replayed policy."""
    from gym_runtime.config import load_config
    from gym_runtime.service.runner import run_batch
    from resources.swe.tests.tiny_repo import rows_and_recordings  # a test helper: the checkout, not the package

    rows, rec = rows_and_recordings(tmp, copies=max(1, rollouts // 2))
    print(f"\n{'swe (local backend)':>22} | {'concurrency':>11} | {'rollouts/min':>12} | mean reward")
    for concurrency in (1, 4):
        cfg = load_config(
            REPO / "resources" / "swe" / "config.yaml",
            [
                "models.policy.adapter=replay",
                f"models.policy.rollouts={rec}",
                f"namespace=swe{concurrency}",
                "resources.swe.options.command_timeout_s=5",
                f"resources.swe.options.max_parallel={2 * concurrency}",
                f"agents.swe_agent.concurrency={concurrency}",
            ],
        )
        out = tmp / f"swe{concurrency}.jsonl"

        async def go(cfg=cfg, out=out):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            result = await run_batch(resolve_config(cfg), url, input_path=rows, out=out, telemetry=Telemetry())
            return result, time.perf_counter() - t0

        result, elapsed = run_async(go)
        import json

        rewards = [json.loads(line)["reward"] for line in out.read_text().splitlines() if line.strip()]
        assert result.stats.failures == 0 and rewards
        print(
            f"{'':>22} | {concurrency:>11} | {60 * len(rewards) / elapsed:>12.1f} | {sum(rewards) / len(rewards):.2f}"
        )


if __name__ == "__main__":
    main()
