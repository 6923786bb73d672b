"""``gym-runtime init``: scaffold a new environment package that runs and passes its own tests."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="scaffold a new environment package (tool, verifier, config, data, tests)")
    p.add_argument("name", help="package name, a lowercase Python identifier (e.g. my_env)")
    p.add_argument("--dir", default=".", help="where to create NAME/ (default: the current directory)")
    p.add_argument("--stateful", action="store_true", help="session state set by seed, graded on the final state")
    p.add_argument("--judge", action="store_true", help="grade the final answer with an LLM judge model")


def main(args: argparse.Namespace) -> int:
    from gym_runtime.cli.scaffold import write_package

    package = write_package(args.name, args.dir, stateful=args.stateful, judge=args.judge)
    print(f"created {package}/ — try:")
    print(f"  cd {package} && gym-runtime run config.yaml -i data/example.jsonl -o out.jsonl")
    print("  python -m pytest tests")
    return 0
