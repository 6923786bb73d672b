"""The installed NeMo Gym catalogue, hosted: `gym-runtime parity` over every resources server, one table.

    python tests/bench/catalogue.py [--servers a,b,c] [--timeout 600]

Columns: server, installed? (its environment could be built here, or the one-line reason
why not), parity n/m (recorded rewards reproduced / rollouts replayed), why not (the
parity command's last line when it did not run). Minutes per server that needs a layer
of its own (pip); seconds for the rest. Not a CI test.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from gym_runtime.hosting import env as hosting_env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", help="comma-separated server names (default: the whole installed catalogue)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per server (default 600)")
    args = ap.parse_args()
    first = hosting_env.ensure("example_session_state_mgmt")
    root = hosting_env.servers_root(hosting_env.Path(first.base))
    names = (
        args.servers.split(",")
        if args.servers
        else sorted(
            p.name
            for p in root.iterdir()
            if (p / "app.py").is_file() and (p / "data" / "example_rollouts.jsonl").is_file()
        )
    )
    print(f"{'server':40} {'installed?':12} {'parity':>8}  {'s':>5}  why not")
    totals = {"servers": 0, "installed": 0, "all": 0}
    for name in names:
        totals["servers"] += 1
        started = time.monotonic()
        try:
            hosting_env.ensure(name, log=lambda _line: None)
        except hosting_env.EnvError as e:
            print(f"{name:40} {'no':12} {'-':>8}  {time.monotonic() - started:5.0f}  {e}")
            continue
        totals["installed"] += 1
        try:
            r = subprocess.run(
                [sys.executable, "-m", "gym_runtime.cli", "parity", name],
                capture_output=True,
                text=True,
                timeout=args.timeout,
                check=False,
            )
            out = r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            out = f"timed out after {args.timeout:g}s"
        m = re.search(r"parity (\d+)/(\d+) rewards", out)
        took = time.monotonic() - started
        if m:
            n, of = int(m.group(1)), int(m.group(2))
            totals["all"] += n == of
            why = "" if n == of else "reward mismatch (see `gym-runtime parity " + name + "`)"
            print(f"{name:40} {'yes':12} {f'{n}/{of}':>8}  {took:5.0f}  {why}")
        else:
            last = (out.strip().splitlines() or ["no output"])[-1][:160]
            print(f"{name:40} {'yes':12} {'-':>8}  {took:5.0f}  {last}")
    print(
        f"{totals['servers']} servers: {totals['installed']} installable here, "
        f"{totals['all']} reproduce every recorded reward"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
