"""``gym-runtime diff A.jsonl B.jsonl``: two runs over the rollouts they share (paired by task: the rule in
``view.diff``): the difference in mean reward and pass@k with 95% intervals, the tasks that flipped, reward
deltas, provenance changes, and each row classed REUSE, REGRADE (``reverify`` redoes it) or RERUN. What rows
hold is escaped before it reaches the terminal."""

from __future__ import annotations

import argparse
import json
from typing import Any

from gym_runtime.cli._common import log_level_option


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="compare two runs: reward deltas, flips, provenance changes (REUSE/REGRADE/RERUN)")
    p.add_argument("a", metavar="A", help="the first run's rollouts JSONL")
    p.add_argument("b", metavar="B", help="the second run's rollouts JSONL")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--all", action="store_true", help="list every common row, not only those that changed")
    log_level_option(p)


def main(args: argparse.Namespace) -> int:
    import sys

    from gym_runtime.cli._common import printable, printable_json
    from gym_runtime.view.diff import compare
    from gym_runtime.view.runs import open_runs

    runs = open_runs([args.a, args.b])
    d = compare(runs, 0, 1)
    for w in d.warnings:
        print(f"gym-runtime: warning: {printable(w)}", file=sys.stderr)
    if args.json:
        print(printable_json(json.dumps(d.as_json(), indent=2, ensure_ascii=False, allow_nan=False)))
        return 0
    for line in text(d, every=args.all):
        print(line)
    return 0


def fmt(v: float | None) -> str:
    return "–" if v is None else "not a number" if v != v else f"{v:.4g}"


def estimate_line(e: Any) -> str:
    pct = e.name.startswith("pass@")
    num = (lambda v: f"{100 * v:.1f}%" if v == v else "not a number") if pct else fmt  # noqa: E731
    sign = (lambda v: f"{100 * v:+.1f} points" if v == v else "not a number") if pct else (lambda v: f"{v:+.4g}")  # noqa: E731
    ci = "no interval (one task)" if e.lo is None else f"95% CI {sign(e.lo)} to {sign(e.hi)}"
    return f"{e.name} {num(e.a)} -> {num(e.b)}: {sign(e.delta)} ({ci}, {e.tasks} tasks)"


def text(d: object, *, every: bool) -> list[str]:
    from gym_runtime.cli._common import printable
    from gym_runtime.view.diff import Diff, task_name

    assert isinstance(d, Diff)
    flips = d.flips
    lines = [
        f"A {d.a.path}  B {d.b.path}",
        f"{len(d.pairs)} rollouts in common ({d.only_a} only in A, {d.only_b} only in B); mean reward "
        f"{fmt(d.mean('a'))} -> {fmt(d.mean('b'))}",
        f"pass->fail {flips['pass→fail']}, fail->pass {flips['fail→pass']}; "
        + ", ".join(f"{k} {v}" for k, v in d.counts.items()),
    ]
    lines += [estimate_line(e) for e in d.estimates()]
    lines.append("  (B - A; 95% interval: paired t over tasks, each task's mean over its paired rollouts)")
    for way, tasks in d.flipped_tasks().items():
        names = ", ".join(task_name(t) for t in tasks[:20]) + (f" … ({len(tasks)})" if len(tasks) > 20 else "")
        lines.append(f"tasks {way.replace('→', '->')}: {len(tasks)}" + (f" ({names})" if tasks else ""))
    shown = [p for p in d.pairs if every or p.flip or p.delta or p.changed or p.failure_a != p.failure_b]
    if shown:
        lines.append(f"{'task':>6} {'rollout':>7}  {'A':>8} {'B':>8} {'delta':>8}  {'flip':<10} {'class':<8} changed")
    for p in shown:
        delta = "" if p.delta is None else f"{p.delta:+.4g}"
        ra = p.failure_a or fmt(None if p.reward_a != p.reward_a else p.reward_a)
        rb = p.failure_b or fmt(None if p.reward_b != p.reward_b else p.reward_b)
        flip = p.flip.replace("→", "->")
        lines.append(
            f"{p.key[-2]:>6} {p.key[-1]:>7}  {ra:>8} {rb:>8} {delta:>8}  {flip:<10} {p.klass:<8} {', '.join(p.changed)}"
        )
    return [printable(line) for line in lines]
