"""CPU per hosted rollout in the resource class itself: NeMo Gym's app and our code around it, no bus.

Builds a hosted server's Resource class as a hosted resource worker does (``hosted_class``, its
``setup``) in the server's built environment (this script re-runs itself on that interpreter), then
runs ``--rollouts`` sessions, ``--concurrency`` at a time, each a seed and a verify of a row of the
server's ``example.jsonl`` with a fixed answer (the model double's of ``ng_side_by_side.py``), and
prints the process's CPU (every thread: the worker's and the app's loops) per rollout. With
``--profile FILE`` it writes cProfile's stats (``python -m pstats FILE``; every thread on Python >= 3.12).

    python tests/bench/hosted_rollout.py [--server mcqa] [--rollouts 3000] [--concurrency 32] [--profile out.prof]

The bus, the agent and the model are not in this figure: what it measures is the part of a hosted
worker's CPU per rollout that hosting adds around the server's own code, plus that code.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ANSWER = "The answer is \\boxed{B}."


def response(text: str) -> dict[str, Any]:
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {"id": "resp", "created_at": 0, "model": "mock", "object": "response", "output": [item]}


async def drive(server: str, rollouts: int, concurrency: int, profile: str | None) -> None:
    import msgspec

    from gym_runtime.messages import Response
    from gym_runtime.nemo_gym.hosting.host import ServerHost, hosted_class

    cls = hosted_class(ServerHost(server, "env", {}, []))
    print(f"hosting code: {Path(sys.modules[hosted_class.__module__].__file__ or '').resolve()}", file=sys.stderr)
    await cls.setup({})
    rows = [json.loads(line) for line in Path("data/example.jsonl").read_text().splitlines() if line.strip()]
    answer = msgspec.convert(response(ANSWER), Response)
    rewards: list[float] = []

    async def one(i: int) -> None:
        row = rows[i % len(rows)]
        inst = cls()
        inst.models = None  # no model calls: mcqa's verify makes none
        await inst.seed(row)
        verdict = await inst.verify(row, answer)
        await inst.close()
        rewards.append(verdict.reward)

    async def batch(n: int) -> None:
        sem = asyncio.Semaphore(concurrency)

        async def slot(i: int) -> None:
            async with sem:
                await one(i)

        await asyncio.gather(*(slot(i) for i in range(n)))

    await batch(50)  # first requests (imports, caches) out of the measure
    rewards.clear()
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:  # Python >= 3.12: one profiler sees every thread (sys.monitoring)
        profiler.enable()
    cpu0, t0 = time.process_time(), time.perf_counter()
    await batch(rollouts)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    await cls.teardown()
    load = os.getloadavg()[0]
    print(
        f"{server}: {rollouts} rollouts at concurrency {concurrency}: {cpu / rollouts * 1000:.2f} ms CPU each, "
        f"{rollouts / wall:.0f} rollouts/s, mean reward {sum(rewards) / len(rewards):.2f}, load {load:.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="mcqa")
    ap.add_argument("--rollouts", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--profile")
    args = ap.parse_args()
    try:
        import nemo_gym  # noqa: F401
    except ImportError:  # not yet in the server's environment: run there
        from gym_runtime.nemo_gym.hosting import env as hosting_env

        built = hosting_env.ensure(args.server)
        os.execv(built.python, [built.python, __file__, *sys.argv[1:]])
    import uvloop

    from gym_runtime.observability import logs

    logs.configure("warning")
    profile = os.path.abspath(args.profile) if args.profile else None  # the server runs in its own directory
    uvloop.run(drive(args.server, args.rollouts, args.concurrency, profile))


if __name__ == "__main__":
    main()
