"""``gym-runtime view OUT.jsonl [MORE.jsonl ...]``: a local, read-only web page over rollouts files.

Each file is indexed once (the index kept beside it) before the server starts, so a bad file is one line and
exit 2. Loopback by default, and on every host every request needs the access token the printed URL carries
(``--no-token`` turns it off and says what that exposes). The lifecycle and the access policy live in
``gym_runtime.view``; this module parses and prints.
"""

from __future__ import annotations

import argparse
from typing import Any

from gym_runtime.cli import _common as cli
from gym_runtime.errors import UserError

DEFAULT_PORT = 8765


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("view", help="a local read-only web page over rollouts files: runs, rollouts, trajectories")
    p.add_argument(
        "files", metavar="FILE", nargs="*", help="rollouts JSONL (its _failures.jsonl beside it is read too)"
    )
    p.add_argument("--batch", help="also follow this batch on the bus as its results are stored (with --nats)")
    cli.bus_options(p, "the bus of --batch")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: loopback only)")
    p.add_argument(
        "--no-token",
        action="store_true",
        help="serve with no access token: every user of this machine (beyond loopback: anyone who can reach "
        "--host) reads every row (default: a token in the printed URL, then a cookie)",
    )
    p.add_argument(
        "--port", type=cli.port_number, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)"
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="decode the token view with this local tokenizer.json (or a model folder holding one; needs the "
        "'tokenizers' extra)",
    )
    p.add_argument(
        "--export",
        metavar="DIR",
        help="write the pages as files that open with no server (a bundle to share) into DIR, then exit",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --export: write into a folder that holds other files (by default only a new or empty folder, or "
        "one a previous export wrote)",
    )
    p.add_argument(
        "--filter",
        metavar="QUERY",
        default="",
        help="with --export: the rollouts table's filters, as its URL's query string (e.g. 'failure=any&run=0')",
    )
    cli.log_level_option(p)


def main(args: argparse.Namespace) -> int:
    import sys

    from gym_runtime.cli._common import client_auth, need_url, reach
    from gym_runtime.service.loop import run_async
    from gym_runtime.view.access import Access
    from gym_runtime.view.runs import open_runs
    from gym_runtime.view.serving import Follow, serve

    if not args.files and not args.batch:
        raise UserError("view needs a rollouts FILE, or --batch B --nats URL")
    if args.export is not None:
        return export(args)
    if args.filter:
        raise UserError("--filter goes with --export (the served table takes its filters from its form)")
    if args.force:
        raise UserError("--force goes with --export (a served view writes nothing)")
    follow = None
    if args.batch:  # a dead bus: one line, before all else
        url = reach(need_url(args, None), query=True)
        follow = Follow(args.batch, url, args.namespace, client_auth(args))
    access = Access.resolve(args.host, token=not args.no_token)
    decode = tokenizer(args)
    runs = open_runs(args.files)
    fits(args, decode, runs)

    def ready(port: int) -> None:
        print(f"gym-runtime view: {access.url(port)}", flush=True)
        if access.token is None:
            print(f"gym-runtime view: {access.exposure(port)}", file=sys.stderr, flush=True)

    run_async(lambda: serve(runs, access, args.port, ready=ready, follow=follow, decode=decode))
    return 0


def tokenizer(args: argparse.Namespace) -> Any:
    """``--tokenizer``'s decoder (None: token ids shown); a missing file or extra is one line, before anything else."""
    from gym_runtime.view.tokens import load_tokenizer

    return load_tokenizer(args.tokenizer) if args.tokenizer else None


def fits(args: argparse.Namespace, decode: Any, runs: Any) -> None:
    """``--tokenizer`` checked against the rows (``view.runs.tokenizer_misfit``): one of another model is one line."""
    from gym_runtime.view.runs import tokenizer_misfit

    if decode is not None:
        wrong = tokenizer_misfit(decode, runs)
        if wrong:
            raise UserError(f"--tokenizer {args.tokenizer}: {wrong}")


def export(args: argparse.Namespace) -> int:
    """``--export DIR``: the pages written as files (``view.export``), then a line saying what and where."""
    import asyncio
    from pathlib import Path

    from gym_runtime.view.export import Bundle, check_filter, prepare, query
    from gym_runtime.view.runs import open_runs
    from gym_runtime.view.server import View

    if args.batch:
        raise UserError("--export writes files given, not a live --batch (collect it first, then export the file)")
    out = Path(args.export)
    replaces = prepare(out, args.force)
    q = query(args.filter)
    decode = tokenizer(args)
    runs = open_runs(args.files, shared=True)  # a bundle names files by their base names
    fits(args, decode, runs)
    check_filter(args.filter, q, runs)
    out.mkdir(parents=True, exist_ok=True)
    written = asyncio.run(Bundle(View(runs, decode=decode), out, q, replaces).write())
    size = sum(written.values())
    print(f"gym-runtime view: wrote {len(written)} files, {size / 1e6:.1f} MB: open {out / 'index.html'}", flush=True)
    return 0
