"""``gym-runtime view``'s training pages at scale: a training rows file of ``--rows`` rows (``train_step``,
``train_group``, advantages; weather's ~2 KB rows with token ids), served by ``view`` in its own process, and its
runs page, a group page, the plots per step and a token view timed over HTTP on loopback (the first request of a
run builds its training columns: timed apart), plus one rollout of ``--tokens`` generated tokens' token view
(the issue's 32k-token rollout). Say the load (``/proc/loadavg``) beside the figures.

    python tests/bench/view_training.py [--rows 100000] [--tokens 32768] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.view_rows import row  # noqa: E402

GROUP, PER_STEP = 8, 512  # rollouts per group; rollouts per step


def write_rows(path: Path, n: int) -> int:
    rnd = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            step, group = i // PER_STEP, i // GROUP
            reward = float(rnd.random() < 0.3 + 0.4 * step / max(1, n // PER_STEP))
            r = row(group % 500, i % GROUP, reward, version=step, ms=i % 997)
            r |= {"train_step": step, "train_group": group, "train_reward": reward, "train_advantage": reward - 0.5}
            f.write(json.dumps(r) + "\n")
    return path.stat().st_size


def long_row(path: Path, tokens: int) -> None:
    rnd = random.Random(1)
    item = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "x" * 100}],
        "prompt_token_ids": list(range(200)),
        "generation_token_ids": [rnd.randrange(150000) for _ in range(tokens)],
        "generation_log_probs": [-rnd.random() * 6 for _ in range(tokens)],
        "policy_version": 3,
        "policy_version_ranges": [[0, tokens // 2, 3], [tokens // 2, tokens, 4]],
    }
    r = row(0, 0, 1.0)
    r["response"]["output"] = [item]
    path.write_text(json.dumps(r) + "\n")


def cpu_s(pid: int) -> float:
    """The server process's CPU time so far (user + system): its own work, whatever the machine's load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=300) as r:
        body = r.read()
    return time.perf_counter() - t0, len(body)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        train, long = Path(d) / "train.jsonl", Path(d) / "long.jsonl"
        size = write_rows(train, args.rows)
        long_row(long, args.tokens)
        print(f"load before: {Path('/proc/loadavg').read_text().split()[:3]}")
        print(f"{args.rows} training rows, {size / 1e6:.0f} MB; one rollout of {args.tokens} generated tokens")
        proc = subprocess.Popen(
            [sys.executable, "-m", "gym_runtime.cli", "view", "--port", "0", str(train), str(long)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            base = proc.stdout.readline().split(": ", 1)[1].strip().rstrip("/")
            c = cpu_s(proc.pid)
            first, _ = get(base + "/group/0/0")
            print(
                f"first training page (builds the run's training columns): {first * 1000:.0f} ms wall, "
                f"{(cpu_s(proc.pid) - c) * 1000:.0f} ms server CPU"
            )
            pages = {
                "runs page": "/",
                "group page": f"/group/0/{args.rows // GROUP // 2}",
                "plots per step": "/steps/0",
                "a trajectory (keyboard links)": f"/rollout/0/0/{args.rows // 2}",
                "a token view (~10 tokens)": f"/tokens/0/0/{args.rows // 2}",
                f"a {args.tokens}-token rollout's token view": "/tokens/1/0/0",
            }
            for name, path in pages.items():
                times, cpus = [], []
                for _ in range(args.reps):
                    c = cpu_s(proc.pid)
                    t, n = get(base + path)
                    times.append(t)
                    cpus.append(cpu_s(proc.pid) - c)
                wall, cpu = statistics.median(times) * 1000, statistics.median(cpus) * 1000
                print(f"{name:45s} wall median {wall:7.1f} ms, server CPU {cpu:6.0f} ms  ({n / 1e3:.0f} KB)")
            print(f"load after: {Path('/proc/loadavg').read_text().split()[:3]}")
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
