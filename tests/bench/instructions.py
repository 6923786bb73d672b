"""Instructions per rollout: a steady measure of runtime overhead on a noisy machine.

CPU time on a shared VM moves by ±20% from run to run, which hides the 1–5%
changes hot-path work is made of. This runs weather rollouts with every role in
one process (the scripted model; ``--isolation process``: weather's code in its guest process, counted too)
under valgrind's instruction counter, twice,
with ``--small`` and ``--large`` rollouts (``--model http``: both model calls
of each rollout over HTTP to ``mock_openai.py``, whose process is not counted), and prints the difference divided by
the difference in rollouts: the instructions one rollout costs in our Python
processes, with start-up and one-time costs cancelled out. nats-server (Go, its
own process) is not counted. Repeat runs agree within about 1%.

    python tests/bench/instructions.py [--small 200] [--large 600] [--concurrency 32] [--checkpoint MODE]

Needs ``valgrind`` on PATH (``apt-get install valgrind``). A run of 600
rollouts takes about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio

REPO = Path(__file__).resolve().parents[2]
STEP_ROWS, GENERATIONS = 10, 4  # ``--with-trl-adapter``: a step's prompts as TRL hands them over (each 4 times)


async def follow_live(url: str, batch: str) -> None:
    """``view --batch B --nats URL``'s live mode in this process: wait for the batch's manifest, then read each
    stored result into a spool file and the run's index (``view.live.Live``) until it has every row."""
    from gym_runtime.data.batches import get_manifest
    from gym_runtime.observability.tracing import Telemetry
    from gym_runtime.transport.bus import Bus
    from gym_runtime.view.live import Live

    bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="gym-view", role="publisher")
    try:
        while (manifest := await get_manifest(bus, batch)) is None:
            await asyncio.sleep(0.05)
        with tempfile.TemporaryDirectory() as d:
            live = Live(manifest, Path(d) / "live.jsonl", 0)
            async with anyio.create_task_group() as tg:
                tg.start_soon(live.follow, bus)
                while not live.done:
                    await asyncio.sleep(0.05)
                tg.cancel_scope.cancel()
    finally:
        await bus.close()


def trl_steps(n: int, concurrency: int, sets: list[str], tmp: Path, train_rows: bool = False) -> None:
    """``n`` rollouts asked for by the synchronous TRL adapter (``TRLRollouts``, TRL's ``rollout_func``; no trainer:
    nothing registered or logged), in steps of ``STEP_ROWS`` prompts × ``GENERATIONS`` as TRL hands them over,
    through a ``SyncClient`` whose workers run in this process, on an embedded server."""
    import overhead

    from gym_runtime import SyncClient
    from gym_runtime.config import load_config, resolve_config
    from gym_runtime.ops.nats_server import EmbeddedServer
    from gym_runtime.trainers.trl import TRLRollouts

    step = STEP_ROWS * GENERATIONS
    assert n % step == 0, f"--small and --large are multiples of {step} with --with-trl-adapter"
    srv = EmbeddedServer(store_dir=str(tmp / "js"))
    srv.start()
    try:
        cfg = resolve_config(load_config(overhead.CONFIG, overhead.conc_sets(concurrency, sets)))
        rows = [json.loads(line) for line in overhead.DATA.read_text().splitlines() if line.strip()]
        rows = [rows[i % len(rows)] for i in range(n // GENERATIONS)]
        with SyncClient(cfg, nats=srv.url) as client:
            rows_path = str(tmp / "train_rows.jsonl") if train_rows else None  # ``--train-rows``: every row written
            rollouts = TRLRollouts(client, rows, live=None, rows_path=rows_path)
            prompts = [d["prompt"] for d in rollouts.dataset()]
            for first in range(0, len(prompts), STEP_ROWS):
                out = rollouts([p for p in prompts[first : first + STEP_ROWS] for _ in range(GENERATIONS)], None)
                assert len(out["completion_ids"]) == step and rollouts.counts.failed == 0, rollouts.counts
            rollouts.close()
    finally:
        srv.stop()


def one_run(n: int, args: argparse.Namespace) -> None:
    """The measured workload (run under valgrind): ``n`` rollouts, every role in this process."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests" / "bench"))
    import overhead

    from gym_runtime.cli._gc import tune_gc
    from gym_runtime.observability import logs

    logs.configure("warning")  # as the CLI does
    tune_gc()
    with tempfile.TemporaryDirectory() as d, overhead.model_mode(args.model) as (sets, mock):
        sets = [*sets, f"resources.weather.isolation={args.isolation}"]
        if args.token_ids or args.with_trl_adapter:
            sets.append("models.policy.token_ids=true")
        if args.checkpoint:
            sets.append(f"agents.weather_agent.checkpoint={args.checkpoint}")
        if args.with_trl_adapter:
            trl_steps(n, args.concurrency, sets, Path(d), args.train_rows)
            return
        alongside = follow_live if args.with_viewer else None
        # no RSS sampler: a thread of this process that wakes every 50 ms would add instructions per rollout that grow
        # with the run's wall time (valgrind's slowdown times the machine's load), none of them the runtime's
        overhead.one_process(
            n, args.concurrency, Path(d), sets, mock, secure=args.secure, alongside=alongside, sample_rss=False
        )


def workload_flags(args: argparse.Namespace) -> list[str]:
    """The flags that say the workload, as the measured run is given them."""
    flags = ["--concurrency", str(args.concurrency), "--model", args.model, "--isolation", args.isolation]
    flags += ["--checkpoint", args.checkpoint] if args.checkpoint else []
    named = {"--secure": args.secure, "--with-viewer": args.with_viewer, "--token-ids": args.token_ids}
    named["--with-trl-adapter"] = args.with_trl_adapter
    named["--train-rows"] = args.train_rows
    return flags + [flag for flag, on in named.items() if on]


def instructions(n: int, args: argparse.Namespace) -> int:
    proc = subprocess.run(
        [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            # our Python children too (an isolation: process guest), never nats-server
            "--trace-children=yes",
            "--trace-children-skip=*nats-server*",
            sys.executable,
            __file__,
            "--one",
            str(n),
            *workload_flags(args),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        sys.exit(f"the measured run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = proc.stderr
    found = re.findall(r"I\s+refs:\s+([\d,]+)", out)  # one per traced process
    assert found, out[-2000:]
    return sum(int(m.replace(",", "")) for m in found)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", type=int, default=200)
    ap.add_argument("--large", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument(
        "--model",
        choices=["scripted", "http"],
        default="scripted",
        help="http: the openai adapter to tests/bench/mock_openai.py (its process is not counted)",
    )
    ap.add_argument("--secure", action="store_true", help="a --secure server: TLS, nkeys, one connection per role")
    ap.add_argument(
        "--isolation", choices=["none", "process"], default="none", help="process: weather's code in a guest process"
    )
    ap.add_argument(
        "--with-viewer",
        action="store_true",
        help="view's live mode follows the batch in the same process (each result read, spooled and indexed)",
    )
    ap.add_argument(
        "--token-ids",
        action="store_true",
        help="the scripted model says token ids and logprobs, as a token-in adapter (what a trainer reads)",
    )
    ap.add_argument(
        "--with-trl-adapter",
        action="store_true",
        help=f"the rollouts asked for by the TRL adapter (TRLRollouts, a SyncClient), {STEP_ROWS} prompts x "
        f"{GENERATIONS} a step, token ids on (--small/--large: multiples of {STEP_ROWS * GENERATIONS})",
    )
    ap.add_argument(
        "--checkpoint",
        choices=["auto", "every_turn", "off"],
        help="the agent's checkpoint mode (resume at the last turn); unset: the config's default (auto)",
    )
    ap.add_argument(
        "--train-rows",
        action="store_true",
        help="with --with-trl-adapter: the adapter writes its training rows file (rows_path=) as it goes",
    )
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: the run valgrind measures
    args = ap.parse_args()
    if args.one is not None:
        one_run(args.one, args)
        return
    step = STEP_ROWS * GENERATIONS
    if args.with_trl_adapter and (args.small % step or args.large % step):
        ap.error(f"--with-trl-adapter: --small and --large must be multiples of {step}, got {args.small}, {args.large}")
    if shutil.which("valgrind") is None:
        sys.exit("instructions.py needs valgrind on PATH (apt-get install valgrind)")
    small = instructions(args.small, args)
    large = instructions(args.large, args)
    per = (large - small) / (args.large - args.small)
    secured = (", --secure server" if args.secure else "") + f", isolation: {args.isolation}"
    secured += ", view's live mode following the batch" if args.with_viewer else ""
    secured += ", token ids" if args.token_ids or args.with_trl_adapter else ""
    secured += f", checkpoint: {args.checkpoint}" if args.checkpoint else ""
    secured += (
        f", asked for by the TRL adapter ({STEP_ROWS} prompts x {GENERATIONS} a step)" if args.with_trl_adapter else ""
    )
    secured += ", its training rows written (rows_path=)" if args.train_rows else ""
    print(f"weather rollouts, {args.model} model, every role in one process, {args.concurrency} in flight{secured}")
    print(f"{args.small} rollouts: {small / 1e9:.2f} G instructions; {args.large}: {large / 1e9:.2f} G")
    print(f"instructions per rollout (our Python processes; nats-server not counted): {per / 1e6:.3f} M")


if __name__ == "__main__":
    main()
