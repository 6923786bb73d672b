"""``gym-runtime parity SERVER``: replay a hosted NeMo Gym server's recorded rollouts and compare rewards.

Prints recorded vs replayed reward per rollout and the tool outputs that differ; exit 1
on any mismatch (a grader changed since the recording, an unseeded RNG ...), 2 when the
server cannot be hosted here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from gym_runtime.cli._common import EXIT_FAILURES, log_level_option
from gym_runtime.errors import UserError
from gym_runtime.hosting.catalogue import EXPLAINED, recordings
from gym_runtime.hosting.env import ensure
from gym_runtime.hosting.parity import compare, parity_config, read_rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="replay a NeMo Gym server's example_rollouts.jsonl through its hosted code")
    p.add_argument("server", metavar="SERVER", help="a NeMo Gym resources server (catalogue name or directory)")
    p.add_argument("--python", help="the Python >= 3.13 to build on (default: $GYM_NEMO_PYTHON, else searched)")
    p.add_argument("--keep", metavar="DIR", help="keep the config, inputs and replayed rows in DIR")
    log_level_option(p)


def main(args: argparse.Namespace) -> int:
    env = ensure(args.server, python=args.python)
    name = Path(env.server_dir).name
    incomplete = recordings(Path(env.server_dir))[1]
    if incomplete:  # nothing a replay could show: say what the recordings lack (the catalogue table's reason)
        raise UserError(f"parity {args.server}: its recordings cannot be replayed: {incomplete}")
    with tempfile.TemporaryDirectory(prefix="gym-parity-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        cfg, data, rollouts = parity_config(env, work)
        out = work / "replayed.jsonl"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "gym_runtime.cli",
                "run",
                str(cfg),
                "-i",
                str(data),
                "-o",
                str(out),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        replayed = read_rows(out) if out.is_file() else []
        if run.returncode not in (0, 1) or not replayed:
            tail = (run.stderr.strip().splitlines() or ["no rows"])[-1]
            known = f"; known: {EXPLAINED[name]}" if name in EXPLAINED else ""
            raise UserError(f"parity {args.server}: the replay did not run ({tail}){known}")
        report = compare(args.server, rollouts, replayed)
    for line in report.lines():
        print(line)
    if not report.ok and name in EXPLAINED:  # a documented mismatch: its cause, as docs/nemo-gym.md gives it
        print(f"{args.server}: a known difference (docs/nemo-gym.md, the catalogue table): {EXPLAINED[name]}")
    return 0 if report.ok else EXIT_FAILURES
