"""``gym-runtime parity SERVER``: replay a hosted NeMo Gym server's recorded rollouts and compare rewards.

Prints recorded vs replayed reward per rollout and the tool outputs that differ; exit 1
on any mismatch (a grader changed since the recording, an unseeded RNG ...), 2 when the
server cannot be hosted here.

``gym-runtime parity TASKS --harbor``: Harbor tasks (a task directory or a directory of them) with their
``solution/solve.sh`` as the policy, verified as Harbor verifies; exit 1 unless every task scores its full
reward, 2 when a task's image cannot be built here (an unmapped base image, no engine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import yaml

from gym_runtime.cli._common import EXIT_FAILURES, log_level_option
from gym_runtime.errors import UserError
from gym_runtime.harbor import find_tasks, task_row
from gym_runtime.harbor.hosting import ensure_images, harbor_config, image_options, parity_lines
from gym_runtime.nemo_gym.catalogue import EXPLAINED, NO_JUDGE_CALL, recordings
from gym_runtime.nemo_gym.hosting.env import ensure
from gym_runtime.nemo_gym.parity import compare, parity_config, read_rows
from gym_runtime.sandboxes.engine_http import Engine, EngineError, engine_fix, socket_of


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="replay a NeMo Gym server's example_rollouts.jsonl through its hosted code")
    p.add_argument("server", metavar="SERVER", help="a NeMo Gym resources server (catalogue name or directory)")
    p.add_argument("--python", help="the Python >= 3.13 to build on (default: $GYM_NEMO_PYTHON, else searched)")
    p.add_argument("--keep", metavar="DIR", help="keep the config, inputs and replayed rows in DIR")
    p.add_argument("--harbor", action="store_true", help="SERVER is a Harbor task directory (or a directory of them)")
    p.add_argument(
        "--base-image",
        action="append",
        default=[],
        metavar="NAME=LOCAL",
        help="--harbor: build FROM NAME on a local image (base: the fleet's Debian base)",
    )
    p.add_argument(
        "--bake", action="append", default=[], metavar="CMD", help="--harbor: a command baked into the images"
    )
    p.add_argument(
        "--build-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="--harbor: a build argument of the task images (resolves FROM ${NAME} too)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="--harbor: the longest one command may run (s)")
    log_level_option(p)


def main(args: argparse.Namespace) -> int:
    keep_dir(args.keep)  # the user's own path before an environment is built or an engine asked
    if args.harbor:
        return harbor_main(args)
    if _harbor_tasks(Path(args.server)):  # before a NeMo Gym server of that name is looked for (or built)
        raise UserError(f"parity {args.server}: a Harbor task directory (task.toml): add --harbor")
    env = ensure(args.server, python=args.python)
    name = Path(env.server_dir).name
    incomplete = recordings(Path(env.server_dir))[1]
    # no judge call recorded: replayed all the same (a grader may decide a row without its judge), the rows
    # whose replay called the judge refused (compare)
    judge_unrecorded = incomplete == NO_JUDGE_CALL
    if incomplete and not judge_unrecorded:  # nothing a replay could show: what the recordings lack
        raise UserError(f"parity {args.server}: its recordings cannot be replayed: {incomplete}")
    with tempfile.TemporaryDirectory(prefix="gym-parity-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        cfg, data, rollouts = parity_config(env, work)
        out = work / "replayed.jsonl"
        run = _run(cfg, data, out)
        replayed = read_rows(out) if out.is_file() else []
        if run.returncode not in (0, 1) or not replayed:
            tail = (run.stderr.strip().splitlines() or ["no rows"])[-1]
            known = f"; known: {EXPLAINED[name]}" if name in EXPLAINED else ""
            raise UserError(f"parity {args.server}: the replay did not run ({tail}){known}")
        report = compare(args.server, rollouts, replayed, judge_unrecorded=judge_unrecorded)
    if judge_unrecorded and not report.rows:
        raise UserError(
            f"parity {args.server}: its recordings cannot be replayed: every row's reward needed a judge call"
            f" ({len(report.refused)} rows), and {NO_JUDGE_CALL.removeprefix('it has a judge, but ')}"
        )
    for line in report.lines():
        print(line)
    if not report.ok and name in EXPLAINED:  # a documented mismatch: its cause, as docs/nemo-gym.md gives it
        print(f"{args.server}: a known difference (docs/nemo-gym.md, the catalogue table): {EXPLAINED[name]}")
    return 0 if report.ok else EXIT_FAILURES


def keep_dir(keep: str | None) -> None:
    """``--keep DIR``: a directory, made now if it is not there (one line naming the path if it cannot be)."""
    if keep is None:
        return
    path = Path(keep)
    if path.exists() and not path.is_dir():
        raise UserError(f"--keep {keep}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--keep {keep}: cannot create it ({e.strerror})") from None


def _run(cfg: Path, data: Path, out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "gym_runtime.cli", "run", str(cfg), "-i", str(data), "-o", str(out), "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _harbor_tasks(path: Path) -> bool:
    """Whether ``path`` is a Harbor task directory or a directory of them (what ``--harbor`` takes)."""
    if (path / "task.toml").is_file():
        return True
    return path.is_dir() and any((d / "task.toml").is_file() for d in path.iterdir())


def harbor_main(args: argparse.Namespace) -> int:
    """Harbor tasks' solve.sh as the policy: each must score the full reward (the module's doc)."""
    # the user's own arguments first (a typo in a path is named as such, engine or not), then the engine
    tasks = find_tasks(args.server)
    opts = image_options(args)
    if not args.timeout > 0:
        raise UserError(f"--timeout {args.timeout:g}: give the seconds one command may run (> 0)")
    host = os.environ.get("DOCKER_HOST")
    if not host:
        raise UserError(f"parity --harbor: DOCKER_HOST is not set: {engine_fix('docker')}")
    try:
        socket = socket_of(host)
    except EngineError as e:
        raise UserError(f"parity --harbor: DOCKER_HOST: {e}") from None

    async def build() -> None:
        async with Engine(socket) as engine:
            try:
                await engine.ping()
            except EngineError as e:
                raise UserError(
                    f"parity --harbor: the container engine does not answer: {e}; {engine_fix('docker')}"
                ) from None
            await ensure_images(engine, tasks, opts, note=lambda line: print(line, file=sys.stderr))

    anyio.run(build)
    with tempfile.TemporaryDirectory(prefix="gym-parity-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        cfg, data, out = work / "config.yaml", work / "tasks.jsonl", work / "oracle.jsonl"
        tasks_dir = str(Path(args.server).resolve())
        cfg.write_text(yaml.safe_dump(harbor_config(tasks_dir, opts, host, args.timeout)))
        data.write_text("".join(json.dumps(task_row(t)) + "\n" for t in tasks))
        run = _run(cfg, data, out)
        rows = read_rows(out) if out.is_file() else []
        failures_path = out.with_name("oracle_failures.jsonl")
        failures = read_rows(failures_path) if failures_path.is_file() else []
        if run.returncode not in (0, 1) or not (rows or failures):
            tail = (run.stderr.strip().splitlines() or ["no rows"])[-1]
            raise UserError(f"parity {args.server}: the oracle run did not run ({tail})")
    ok, lines = parity_lines(tasks, rows, failures)
    for line in lines:
        print(line)
    return 0 if ok else EXIT_FAILURES
