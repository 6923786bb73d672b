"""Where a command's CPU goes, process by process: run it, sample every process of its tree every 20 ms, and
print a table of each one's CPU seconds (its last sample before it ended), with the whole tree's total.

    python tests/bench/tree_cpu.py -- gym-runtime run weather --repeats 2000 -o /tmp/out.jsonl

A process that lives less than a sample apart is missed in the table (not in the total, which is the
command's and every reaped descendant's, from ``getrusage``). Used for the native path's split in
docs/benchmarks.md (performance round 4 at its end).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import time

import psutil

SAMPLE_S = 0.02


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min", type=float, default=0.05, help="leave out processes under this many CPU-s")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    root = subprocess.Popen(command)
    seen: dict[int, tuple[str, float]] = {}  # pid -> (command line, CPU-s at its last sample)
    top = psutil.Process(root.pid)
    while root.poll() is None:
        try:
            procs = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in procs:
            try:
                t = p.cpu_times()
                name = seen[p.pid][0] if p.pid in seen else " ".join(p.cmdline())[:120]
            except psutil.Error:
                continue
            seen[p.pid] = (name, t.user + t.system)
        time.sleep(SAMPLE_S)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    print("| process | CPU-s |\n| --- | ---: |")
    for pid, (name, cpu) in sorted(seen.items(), key=lambda kv: -kv[1][1]):
        if cpu >= args.min:
            print(f"| {pid} {name} | {cpu:.2f} |")
    print(f"| the whole tree (getrusage) | {used.ru_utime + used.ru_stime:.2f} |")
    raise SystemExit(root.returncode)


if __name__ == "__main__":
    main()
