"""The task sampler's figure for docs/benchmarks.md, from ``sampler_learns.py --out`` lines (matplotlib needed).

    python tests/bench/sampler_plot.py runs.jsonl docs/images/sampler_zero_spread.png [SKIP_BELOW]

Two panels over training steps, one line per run (uniform grey, the sampler coloured by seed): the share of groups
with zero reward spread per window, and the learnable tasks' mean reward per window. A stopped run's line ends
where it stopped. With ``SKIP_BELOW``, only the sampler's runs with that ``skip_below``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    if len(sys.argv) > 3:
        runs = [r for r in runs if r["score"] == "uniform" or r["skip_below"] == float(sys.argv[3])]
    fig, (zero, learn) = plt.subplots(1, 2, figsize=(11, 4))
    colours = ["tab:blue", "tab:orange", "tab:green"]
    for run in runs:
        width = run.get("window", 50)
        uniform = run["score"] == "uniform"
        style = {"color": "grey", "linestyle": "--"} if uniform else {"color": colours[run["seed"] % 3]}
        name = f"{'uniform' if uniform else 'sampler'}, seed {run['seed']}"
        xs = [width * (k + 0.5) for k in range(len(run["zero_by_window"]))]
        zero.plot(xs, run["zero_by_window"], marker="o", label=name, **style)
        points = [(width * (k + 0.5), m) for k, m in enumerate(run["learnable_by_window"]) if m is not None]
        learn.plot([x for x, _ in points], [m for _, m in points], marker="o", label=name, **style)
    zero.set(title="groups with zero reward spread", xlabel="step", ylabel="share per window", ylim=(0, 1.05))
    learn.set(title="learnable tasks' mean reward", xlabel="step", ylabel="mean per window", ylim=(0, 1.05))
    learn.axhline(0.5, color="black", linewidth=0.5)
    zero.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=90)


if __name__ == "__main__":
    main()
