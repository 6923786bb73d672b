"""The CLI commands' own start-up: CPU seconds (user + sys, ``/usr/bin/time``) and modules imported.

The hosted path's ``publish`` and ``collect`` are one process each per batch, and for a small batch their
start-up is most of their CPU (issue 41). Measured per case, median of ``--reps``: ``gym-runtime --help``,
``publish --help``, ``collect --help``, ``run --help``, a 1-row ``publish`` of weather's example row to a
running ``gym-runtime server`` and the ``collect`` of that batch (a ``gym-runtime start`` worker pool
answers it). Several ``--python`` interpreters (e.g. the venvs of two checkouts, before and after a
change) are measured alternately, rep by rep, against the same server and workers (those of the first).

    python tests/bench/cli_startup.py [--python LABEL=PATH ...] [--reps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "resources/weather/config.yaml"
EXAMPLE = REPO / "resources/weather/data/example.jsonl"
HELP_CASES = {
    "gym-runtime --help": ["--help"],
    "publish --help": ["publish", "--help"],
    "collect --help": ["collect", "--help"],
    "run --help": ["run", "--help"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(python: str, args: list[str], tmp: Path) -> float:
    """User + sys CPU seconds of one ``python -m gym_runtime.cli ARGS`` (``/usr/bin/time``), checked to succeed."""
    times = tmp / "time.txt"
    out = subprocess.run(
        ["/usr/bin/time", "-f", "%U %S", "-o", str(times), python, "-m", "gym_runtime.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    if out.returncode != 0:
        raise SystemExit(f"{python} {' '.join(args)} exited {out.returncode}:\n{out.stderr[-2000:]}")
    user, system = times.read_text().split()[-2:]
    return float(user) + float(system)


def modules_imported(python: str, args: list[str]) -> int:
    """How many modules the command imports (``python -X importtime``'s lines)."""
    out = subprocess.run(
        [python, "-X", "importtime", "-m", "gym_runtime.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    return sum(line.startswith("import time:") for line in out.stderr.splitlines()) - 1  # less the header


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on {port} in 120 s")


@contextlib.contextmanager
def background(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--python",
        action="append",
        metavar="LABEL=PATH",
        help="an interpreter to measure (repeatable; default: this one, labelled 'this')",
    )
    ap.add_argument("--reps", type=int, default=5, help="runs per case and interpreter (the median is shown)")
    args = ap.parse_args()
    pythons = dict(p.split("=", 1) for p in args.python or [f"this={sys.executable}"])
    first = next(iter(pythons.values()))

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        one_row = tmp / "one.jsonl"
        one_row.write_text(EXAMPLE.read_text().splitlines()[0] + "\n")
        port = free_port()
        url = f"nats://127.0.0.1:{port}"
        server_cmd = [first, "-m", "gym_runtime.cli", "server", "--port", str(port), "--store-dir", str(tmp / "js")]
        with background(server_cmd, tmp / "server.log") as server:
            wait_port(port, server, "gym-runtime server")
            start_cmd = [first, "-m", "gym_runtime.cli", "start", str(CONFIG), "--nats", url]
            with background(start_cmd, tmp / "start.log"):
                cases: dict[str, list[str]] = dict(HELP_CASES)
                cpu: dict[tuple[str, str], list[float]] = {}
                mods: dict[tuple[str, str], int] = {}
                for rep in range(args.reps):
                    for label, python in pythons.items():
                        for case, argv in cases.items():
                            cpu.setdefault((label, case), []).append(cpu_s(python, argv, tmp))
                        batch = f"bench-{uuid.uuid4().hex[:8]}"
                        publish = ["publish", str(CONFIG), "-i", str(one_row), "--nats", url, "--batch", batch, "-q"]
                        collect = ["collect", "--batch", batch, "--nats", url, "-o", str(tmp / f"{batch}.jsonl")]
                        cpu.setdefault((label, "publish 1 row"), []).append(cpu_s(python, publish, tmp))
                        cpu.setdefault((label, "collect 1 row"), []).append(cpu_s(python, [*collect, "-q"], tmp))
                        if rep == 0:
                            for case, argv in cases.items():
                                mods[(label, case)] = modules_imported(python, argv)
                            batch2 = f"{batch}-m"
                            mods[(label, "publish 1 row")] = modules_imported(
                                python, [*publish[:-3], "--batch", batch2, "-q"]
                            )
                            mods[(label, "collect 1 row")] = modules_imported(
                                python, ["collect", "--batch", batch2, "--nats", url, "-o", str(tmp / "m.jsonl"), "-q"]
                            )
    load = os.getloadavg()
    print(f"CLI start-up, median of {args.reps} (CPU s = user + sys); load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    labels = list(pythons)
    names = [*HELP_CASES, "publish 1 row", "collect 1 row"]
    head = "| command | " + " | ".join(f"{lab} CPU s | {lab} modules" for lab in labels) + " |"
    print(head)
    print("|" + " --- |" * (1 + 2 * len(labels)))
    for name in names:
        cells = [f"{statistics.median(cpu[(lab, name)]):.3f} | {mods[(lab, name)]}" for lab in labels]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
