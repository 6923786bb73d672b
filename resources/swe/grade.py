"""Grade SWE rows' patches without a model: ``python -m gym_runtime.resources.swe.grade ROWS.jsonl``.

By default each row's gold ``patch`` is graded (a check that the task and its
image are sound: every row should come out resolved); ``--patch-field
model_patch`` grades a rollouts file's answers instead. With Docker, on NeMo
Gym's SWE-Gym example rows::

    python -m gym_runtime.resources.swe.grade tests/compat/nemo_gym/mini_swe_agent/example.jsonl --backend docker

Prints one line per row and ``N/M resolved``; exits 0 when every row is
resolved, 1 when some are not, 2 on a usage error (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio

from . import SWE, grade_with, parse_options


def _rows(path: str, limit: int | None) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"{path}: not JSON lines: {e}") from None
    return rows[:limit] if limit else rows


async def _grade_all(rows: list[dict[str, Any]], field: str, options: dict[str, Any]) -> int:
    await SWE.setup(options)
    opts = parse_options(options)
    resolved = 0
    for row in rows:
        patch = row.get(field)
        if not isinstance(patch, str):
            print(f"{row.get('instance_id', '?')}: no {field!r} field, skipped")
            continue
        report = await grade_with(opts, SWE.backend(), row, patch)
        st = report.tests_status
        counts = " ".join(f"{k} {len(v['success'])}/{len(v['success']) + len(v['failure'])}" for k, v in st.items())
        verdict = "resolved" if report.resolved else "UNRESOLVED"
        print(f"{row.get('instance_id', '?')}: {verdict} {counts}{' ' + report.error if report.error else ''}")
        resolved += report.resolved
    print(f"{resolved}/{len(rows)} resolved")
    return 0 if resolved == len(rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gym_runtime.resources.swe.grade", description=__doc__.split("\n")[0])
    ap.add_argument("rows", help="JSONL of SWE-Gym / SWE-bench rows")
    ap.add_argument("--backend", default="docker", choices=["docker", "podman", "apptainer", "singularity", "local"])
    ap.add_argument("--patch-field", default="patch", help="the row field holding the patch to grade (default: patch)")
    ap.add_argument("--flavour", default="swe-gym", choices=["swe-gym", "swe-bench"], help="image naming")
    ap.add_argument("--network", default="none")
    ap.add_argument("--eval-timeout", type=float, default=1800.0)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args(argv)
    options: dict[str, Any] = {"backend": args.backend, "eval_timeout_s": args.eval_timeout}
    if args.backend != "local":
        options |= {"flavour": args.flavour, "network": args.network}
    try:
        rows = _rows(args.rows, args.limit)
        return anyio.run(_grade_all, rows, args.patch_field, options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
