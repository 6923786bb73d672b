"""Trainer-shaped benchmark: what each pause mode costs an asynchronous RL trainer at every weight update.

A trainer double (this script) drives real workers on a real nats-server through ``Client``: it keeps
``S x groups`` groups ahead of what it consumed (``max_staleness=S``, ``repeats`` rollouts per group), consumes
``groups`` groups per step, "trains" for ``--train-s`` seconds (inference keeps generating meanwhile),
then updates the weights: ``pause(mode=...)``, ``--sync-s`` of weight transfer, ``set_policy_version(v + 1)``,
``resume()``. The model is ``tests/bench/slot_model.py`` with ``interruptible: true`` (a TEST DOUBLE for
vLLM replicas: fixed slots, lognormal output lengths, tokens generated one by one so a pause can stop them);
the environment is ``weather`` (two model calls per rollout). Everything but nats-server runs in this
process.

Per mode (``drain``, ``interrupt``, ``abort``), over the steps after the first (warm-up):

* trainer idle per step: waiting for the step's groups, plus the update (pause to resume);
* inference idle per update: slot-seconds without a generation from the pause to the resume, per slot;
* slot occupancy: busy slot-seconds / available ones, over the measured steps;
* rollouts discarded: consumed ones staler than S (counted from submission, queue time included), and
  ``stale`` rows (dropped by the runtime before they started, nothing generated);
* staleness of the consumed rollouts (trainer version at consumption - version at submission);
* tokens regenerated (made again after an ``abort``).

``--admission``: staleness by admission (``submit(batch_size=groups x repeats, group_staleness="group")``,
each consumed group reported with ``batch.consumed``): a rollout starts only when it will be consumed within
S versions, so staleness is then counted from the version a rollout started under (``policy_versions[0]``),
and the target for "discarded" is 0.

Default: a scaled-down run that takes a few minutes on a laptop. The issue's scenario (4 replicas x 64
slots, 512 rollouts per step, median call 1 s, sigma 0.8, capped at 16x, trainer step 2 s, S = 1):

    python tests/bench/async_rl.py                         # 2 x 32 slots, 32 groups x 4, 5 steps
    python tests/bench/async_rl.py --replicas 4 --slots 64 --groups 128 --steps 8   # the issue's default
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime import Client  # noqa: E402
from gym_runtime.config import config_from_dict, resolve_config  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from tests.bench import slot_model  # noqa: E402
from tests.bench.saturation import config_dict  # noqa: E402

ROWS = [json.loads(line) for line in (REPO / "resources/weather/data/example.jsonl").read_text().splitlines()]
MEDIAN_TOKENS = 64  # output tokens of a median call; the cap is 16x that


def busy_in(tries: list[slot_model.Try], a: float, b: float) -> float:
    """Slot-seconds of generation inside [a, b]."""
    return sum(max(0.0, min(t.ended, b) - max(t.started, a)) for t in tries)


async def trainer(args: argparse.Namespace, mode: str, url: str) -> dict[str, Any]:
    run = f"async_rl_{mode}_{time.monotonic_ns()}"
    S, groups, repeats = args.staleness, args.groups, args.repeats
    in_flight = (S + 1) * groups * repeats
    raw = config_dict(
        "weather",
        run,
        args.replicas,
        args.slots,
        args.median_s,
        in_flight,
        sigma=args.sigma,
        median_tokens=MEDIAN_TOKENS,
        max_tokens=MEDIAN_TOKENS * 16,
        interruptible=True,
        seed=args.seed,
    )
    raw["namespace"] = f"arl{mode}"
    cfg = config_from_dict(raw)
    send, recv = anyio.create_memory_object_stream[tuple[int, Any, list[dict[str, Any]]]](math.inf)
    staleness: Counter[int] = Counter()
    stale_rows = discarded = 0
    waits: list[float] = []
    updates: list[tuple[float, float]] = []
    async with Client(resolve_config(cfg), nats=url) as client, anyio.create_task_group() as tg:
        models = [w for w in client.workers if hasattr(w, "gate")]
        version = 0
        await client.set_policy_version(version)

        async def feed(batch: Any, submitted: int) -> None:
            async for group in batch.groups():
                await send.send((submitted, batch, group))

        admit = {"batch_size": groups * repeats, "group_staleness": "group"} if args.admission else {}

        async def submit(n: int) -> None:
            rows = [ROWS[i % len(ROWS)] for i in range(n)]
            tg.start_soon(feed, await client.submit(rows, repeats=repeats, max_staleness=S, **admit), version)

        await submit(max(1, S) * groups)  # consumed a step after their submission, at the earliest
        t_measure = 0.0
        for step in range(args.steps):
            t0 = time.monotonic()
            if step == 1:
                t_measure = t0
            for _ in range(groups):
                submitted, batch, group = await recv.receive()
                if args.admission:
                    await batch.consumed(len(group))
                for row in group:
                    since = submitted  # with admission: the version it started under (a redone row's is later)
                    if args.admission and "policy_versions" in row:
                        since = row["policy_versions"][0]
                    if row.get("error_class") == "stale":
                        stale_rows += step > 0
                    elif version - since > S:
                        discarded += step > 0
                    elif step > 0:
                        staleness[version - since] += 1
            if step > 0:
                waits.append(time.monotonic() - t0)
            await submit(groups)  # the next step's work, at this version
            await anyio.sleep(args.train_s)
            p0 = time.monotonic()
            await client.pause(mode=mode)
            await anyio.sleep(args.sync_s)
            version += 1
            await client.set_policy_version(version)
            await client.resume()
            if step > 0:
                updates.append((p0, time.monotonic()))
        t_end = time.monotonic()
        regenerated = sum(m.regenerated for m in models)
        tg.cancel_scope.cancel()
    rec = slot_model.RECORDERS.pop(run)
    slots = args.replicas * args.slots
    idle_per_update = [((b - a) * slots - busy_in(rec.tries, a, b)) / slots for a, b in updates]
    return {
        "mode": mode,
        "trainer_wait_s": statistics.mean(waits),
        "update_s": statistics.mean(b - a for a, b in updates),
        "trainer_idle_s": statistics.mean(waits) + statistics.mean(b - a for a, b in updates),
        "inference_idle_per_update_s": statistics.mean(idle_per_update),
        "occupancy": busy_in(rec.tries, t_measure, t_end) / (slots * (t_end - t_measure)),
        "discarded": discarded,
        "stale_rows": stale_rows,
        "staleness": dict(sorted(staleness.items())),
        "regenerated_tokens": regenerated,
        "generated_tokens": sum(t.tokens for t in rec.tries),
        "step_s": (t_end - t_measure) / (args.steps - 1),
    }


def table(results: list[dict[str, Any]]) -> str:
    head = (
        "| mode | trainer idle / step (wait + update) | inference idle / update | slot occupancy | discarded "
        "(consumed too stale / stale rows) | staleness of consumed (0/1/..) | tokens regenerated | step |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in results:
        st = "/".join(str(r["staleness"].get(k, 0)) for k in range(max(r["staleness"] or [0]) + 1))
        lines.append(
            f"| {r['mode']} | {r['trainer_idle_s']:.2f} s ({r['trainer_wait_s']:.2f} + {r['update_s']:.2f}) "
            f"| {r['inference_idle_per_update_s']:.2f} s | {r['occupancy']:.0%} | {r['discarded']} / {r['stale_rows']} "
            f"| {st} | {r['regenerated_tokens']} of {r['generated_tokens']} | {r['step_s']:.2f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--slots", type=int, default=32, help="per replica (vLLM's max_num_seqs)")
    ap.add_argument("--groups", type=int, default=32, help="groups consumed per trainer step")
    ap.add_argument("--repeats", type=int, default=4, help="rollouts per group")
    ap.add_argument("--steps", type=int, default=5, help="trainer steps (the first is warm-up, not measured)")
    ap.add_argument("--train-s", type=float, default=2.0, help="one trainer step's compute")
    ap.add_argument("--sync-s", type=float, default=0.2, help="weight transfer while paused")
    ap.add_argument("--staleness", type=int, default=1, help="S: max_staleness of every submit")
    ap.add_argument("--median-s", type=float, default=1.0, help="median model call")
    ap.add_argument("--sigma", type=float, default=0.8, help="lognormal shape of output lengths (cap: 16x median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=["drain", "interrupt", "abort"])
    ap.add_argument("--admission", action="store_true", help="staleness by admission (batch_size, consumed)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        srv = EmbeddedServer(store_dir=str(Path(tmp) / "js"))
        srv.start()
        try:
            for mode in args.modes:
                r = anyio.run(trainer, args, mode, srv.url)
                print(json.dumps(r), flush=True)
                results.append(r)
        finally:
            srv.stop()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
