"""``gym-runtime validate``: check task rows against the environments they route to."""

from __future__ import annotations

import argparse
import sys

from gym_runtime.cli import _common as cli
from gym_runtime.config import resolve_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check input rows against the config's environments (nothing runs)")
    cli.config_argument(p, bundled=True)
    what = "task rows: JSONL, or a .parquet/.json file or hf:OWNER/NAME as prepare reads them (repeatable)"
    cli.input_argument(p, what, repeatable=True, required=True)
    p.add_argument("--agent", help="agent for rows without agent_ref (or to override it)")
    cli.any_tools_option(p)
    cli.common_options(p)


def main(args: argparse.Namespace) -> int:
    from gym_runtime.config.nemo_gym import data_only_overrides
    from gym_runtime.data.validation import validate_files

    args.overrides = data_only_overrides(args.config) + args.overrides  # no model is called here
    cfg = cli.load(args)
    resolve_config(cfg)  # the plugins' option checks (its rows are checked against the loaded config)
    report = validate_files(cfg, args.input, agent=args.agent, any_tools=args.any_tools)
    if report.problems:
        for line in report.problems:
            print(line, file=sys.stderr)
        cli.err(f"{cli.plural(len(report.problems), 'problem')} in {cli.plural(report.rows, 'row')}")
        return cli.EXIT_USAGE
    per_agent = ", ".join(f"{a}: {n}" for a, n in report.agents.items())
    print(f"{cli.plural(report.rows, 'row')} OK ({per_agent})")
    return 0
