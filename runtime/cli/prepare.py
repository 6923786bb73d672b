"""``gym-runtime prepare``: validated, ``agent_ref``-tagged train/validation JSONL from raw or hub data."""

from __future__ import annotations

import argparse
import sys

from gym_runtime.cli import _common as cli


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="validate, tag, dedupe, blend, shuffle and split task rows into DIR")
    cli.config_argument(p, bundled=True)
    cli.input_argument(
        p,
        "a .jsonl/.json/.parquet file or a Hugging Face dataset id (hf:OWNER/NAME[@REV][:SPLIT], or "
        "hf:OWNER/NAME[@REV]/FILE.jsonl); AGENT= routes its rows without agent_ref (repeatable); none with a "
        "NeMo Gym config: its datasets: entries",
        repeatable=True,
        metavar="[AGENT=]SRC",
    )
    p.add_argument(
        "--dataset-types",
        default="train,validation",
        help="NeMo Gym configs without -i: which datasets: entries to use (default: train,validation)",
    )
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="output directory")
    p.add_argument("--val-fraction", type=float, default=0.0, help="share of each agent's rows for validation")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0): same inputs + seed = same files")
    p.add_argument("--weights", help="train mix by agent name, e.g. a=0.7,b=0.3 (downsamples, never repeats)")
    p.add_argument("--agent", help="agent for every row (overrides agent_ref)")
    p.add_argument("--drop-invalid", action="store_true", help="report bad rows but write the valid ones")
    cli.common_options(p)


def main(args: argparse.Namespace) -> int:
    from gym_runtime.config.nemo_gym import data_only_overrides, is_nemo_gym
    from gym_runtime.data.prepare import (
        InvalidRows,
        Options,
        nemo_sources,
        parse_weights,
        prepare,
        write,
    )
    from gym_runtime.data.sources import PrepareError, parse_source
    from gym_runtime.plugins import config_path

    paths = [config_path(c) for c in args.config]
    args.overrides = data_only_overrides(paths) + args.overrides  # no model is called here
    cfg = cli.load(args)
    if args.input:
        sources = [parse_source(s) for s in args.input]
    else:
        import yaml

        if len(paths) != 1 or not is_nemo_gym(yaml.safe_load(paths[0].read_text()) or {}):
            raise PrepareError("prepare needs -i SRC (only one NeMo Gym config brings its own datasets: entries)")
        sources = nemo_sources(paths[0], tuple(t.strip() for t in args.dataset_types.split(",") if t.strip()))
    opts = Options(
        val_fraction=args.val_fraction,
        seed=args.seed,
        drop_invalid=args.drop_invalid,
        weights=parse_weights(args.weights) if args.weights else None,
    )
    try:
        result = prepare(cfg, sources, opts, agent=args.agent)
    except InvalidRows as e:
        for line in e.problems:
            print(line, file=sys.stderr)
        cli.err(str(e))
        return cli.EXIT_USAGE
    for line in result.problems:
        print(line, file=sys.stderr)
    write(result, args.output)
    meta = result.metadata
    for agent, c in meta["agents"].items():
        print(
            f"{agent}: {c['train']} train, {c['validation']} validation, {c['duplicates_dropped']} duplicates dropped"
        )
    dropped = f", {meta['invalid_rows_dropped']} invalid rows dropped" if meta["invalid_rows_dropped"] else ""
    print(f"wrote {meta['train']} train and {meta['validation']} validation rows to {args.output}{dropped}")
    return 0
