"""Write NeMo Gym-format task rows for any reasoning-gym task.

    python -m gym_runtime.resources.reasoning_gym.generate --task knights_knaves --size 500 --seed 42 \
        -o data/train.jsonl
    python -m gym_runtime.resources.reasoning_gym.generate --task chain_sum --size 10 --config '{"min_terms": 3}'
    python -m gym_runtime.resources.reasoning_gym.generate --list

Each row is the dataset entry (``question``, ``answer``, ``metadata`` with
``source_dataset``) preceded by ``responses_create_params`` holding the question
as the one user message: the format of NeMo Gym's ``scripts/create_dataset.py``,
so the same ``--task/--size/--seed`` give the same rows. Without ``-o`` the rows
go to standard output.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO


def task_names() -> list[str]:
    import reasoning_gym.factory

    return sorted(reasoning_gym.factory.DATASETS)


def to_row(entry: dict[str, Any]) -> dict[str, Any]:
    """A reasoning-gym entry as a NeMo Gym input row."""
    return {"responses_create_params": {"input": [{"role": "user", "content": entry["question"]}]}, **entry}


def generate(task: str, size: int, seed: int, config: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """``size`` rows of ``task`` (``reasoning_gym.create_dataset(task, size=, seed=, **config)``).

    The task and config are checked before this returns; the rows are made as they are read.
    """
    import reasoning_gym

    if task not in task_names():
        raise ValueError(f"unknown reasoning-gym task {task!r} (see --list)")
    dataset = reasoning_gym.create_dataset(task, **{**(config or {}), "size": size, "seed": seed})
    return (to_row(dataset[i]) for i in range(size))


def write(rows: Iterator[dict[str, Any]], out: TextIO) -> int:
    n = 0
    for row in rows:
        out.write(json.dumps(row) + "\n")
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gym_runtime.resources.reasoning_gym.generate",
        description="Write NeMo Gym-format task rows for a reasoning-gym task.",
    )
    parser.add_argument("--task", help="reasoning-gym task name, e.g. knights_knaves")
    parser.add_argument("--size", type=int, default=500, help="number of rows (default 500)")
    parser.add_argument("--seed", type=int, default=42, help="dataset seed (default 42)")
    parser.add_argument("--config", default="{}", help="task config as a JSON object, e.g. '{\"n_people\": 3}'")
    parser.add_argument("-o", "--output", type=Path, help="output JSONL file (default: standard output)")
    parser.add_argument("--list", action="store_true", help="print the task names and exit")
    args = parser.parse_args(argv)

    if args.list:
        print("\n".join(task_names()))
        return 0
    if not args.task:
        parser.error("--task is required (or --list)")
    if args.size < 1:
        parser.error("--size must be at least 1")
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as e:
        parser.error(f"--config is not valid JSON: {e}")
    if not isinstance(config, dict):
        parser.error("--config must be a JSON object")
    try:
        rows = generate(args.task, args.size, args.seed, config)
        if args.output is None:
            n = write(rows, sys.stdout)
        else:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            partial = args.output.with_name(args.output.name + ".partial")
            with partial.open("w") as out:
                n = write(rows, out)
            partial.replace(args.output)  # no half-written file under the real name
    except (ValueError, TypeError) as e:  # unknown task, or a config the task's dataclass refuses
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output is not None:
        print(f"wrote {n} {args.task} rows to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
