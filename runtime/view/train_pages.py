"""``view``'s training pages: a group's rollouts side by side, a rollout's tokens, the plots per step, and the
keyboard links every row page carries (``static/keys.js`` follows them; it inserts nothing).

Addresses are integers, as the other pages' are: ``/group/RUN/N`` (the run's N-th group), ``/tokens/RUN/PART/LINE``,
``/steps/RUN``; a training run's tasks (by the sampler's key its rows carry, ``train_task``): ``/tasks/RUN``, which
the sampler favoured, and ``/task/RUN/KEY``, one task's pass rate over steps.
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol

from aiohttp import web

from gym_runtime.view import plots
from gym_runtime.view.numbers import mean, spread
from gym_runtime.view.runs import Ref, Runs
from gym_runtime.view.tokens import Decode, token_view
from gym_runtime.view.training import Training, TrainingViews, neighbours

MOVED = 5  # the per-task plot's tasks: those whose mean reward moved most from their first step to their last
LISTED = 50  # zero-spread groups listed on the runs page (all counted)

MOVES = (("rollout", "j", "k"), ("failure", "f", "F"), ("group", "g", "G"), ("step", "s", "S"))  # (what, next, back)
KEYS = [  # (key, what, link name): the trajectory page's keyboard links, in this order (j, k, f, F, ...)
    (key, f"{way} {what}", f"{name}_{what}")
    for what, forward, back in MOVES
    for key, way, name in ((forward, "next", "next"), (back, "previous", "prev"))
]


def rollout_href(ref: Ref) -> str:
    return f"/rollout/{ref.run}/{ref.part}/{ref.line}"


def group_href(run: int, n: int) -> str:
    return f"/group/{run}/{n}"


def tokens_href(ref: Ref) -> str:
    return f"/tokens/{ref.run}/{ref.part}/{ref.line}"


def tasks_href(run: int) -> str:
    return f"/tasks/{run}"


def task_href(run: int, key: str) -> str:
    return f"/task/{run}/{key}"


def steps_href(run: int) -> str:
    return f"/steps/{run}"


class Pages(Protocol):
    """What these pages take of the view they are part of (``server.View``): its runs, a row's index fields as
    the tables show them, and its page renderer (templates, headers)."""

    runs: Runs

    def row_meta(self, ref: Ref) -> dict[str, Any]: ...

    def render(self, name: str, **context: Any) -> web.Response: ...


class TrainPages:
    """The pages over ``view``'s runs; ``decode``: ``--tokenizer``'s (None: token ids shown)."""

    def __init__(self, view: Pages, decode: Decode | None = None) -> None:
        self.view = view
        self.decode = decode
        self.trainings = TrainingViews()

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/group/{run:\\d+}/{n:\\d+}", self.group_page)
        app.router.add_get("/tokens/{run:\\d+}/{part:\\d+}/{line:\\d+}", self.tokens_page)
        app.router.add_get("/steps/{run:\\d+}", self.steps_page)
        app.router.add_get("/tasks/{run:\\d+}", self.tasks_page)
        app.router.add_get("/task/{run:\\d+}/{key:[0-9a-f]{1,64}}", self.task_page)

    def training(self, run: int) -> Training:
        runs = self.view.runs.runs
        if not 0 <= run < len(runs):
            raise web.HTTPNotFound()
        return self.trainings.of(runs[run])

    # ------------------------------------------------------------------ what the other pages carry

    def keys(self, ref: Ref, *, to: str = "rollout") -> list[tuple[str, str, str | None]]:
        """The keyboard links of a row's page: (key, what, href or None where there is none); ``to``: the kind of
        page the rollout links open (``rollout``: trajectories, ``tokens``: token views)."""
        t = self.training(ref.run)
        near = neighbours(t, ref)
        href = rollout_href if to == "rollout" else tokens_href
        out = [(key, what, href(near[name]) if near.get(name) is not None else None) for key, what, name in KEYS]  # type: ignore[arg-type]
        out.append(("u", "its group", group_href(ref.run, t.of[ref])))
        if to == "rollout":
            out.append(("v", "its tokens", tokens_href(ref)))
        else:
            out.append(("r", "its trajectory", rollout_href(ref)))
        return out

    def summary(self, run: int) -> dict[str, Any]:
        """The runs page's lines for a run: its groups, those with zero spread (no learning signal), its steps."""
        t = self.training(run)
        zero = t.zero_spread
        return {
            "training": t.training,
            "groups": len(t.groups),
            "zero": len(zero),
            "listed": [(group_href(run, g.n), g.label, g.step, len(g.members), g.mean) for g in zero[:LISTED]],
            "steps": steps_href(run) if len(t.steps) > 1 or t.training else None,
            "tasks": tasks_href(run) if t.tasks else None,
        }

    # ------------------------------------------------------------------ the pages

    async def group_page(self, request: web.Request) -> web.Response:
        run, n = int(request.match_info["run"]), int(request.match_info["n"])
        t = self.training(run)
        if not 0 <= n < len(t.groups):
            raise web.HTTPNotFound()
        g = t.groups[n]
        members = [
            {
                "href": rollout_href(m.ref),
                "tokens": tokens_href(m.ref),
                "m": m,
                # a failure row's reward is none, not a number; an excluded member is handed none and has no
                # advantage (TRL's 0 is its placeholder): both shown as none
                "reward": None if math.isnan(m.reward) else m.reward,
                "advantage": m.advantage if m.scored else None,
                "handed": m.handed,
            }
            for m in g.members
        ]
        keys = [
            ("g", "next group", group_href(run, n + 1) if n + 1 < len(t.groups) else None),
            ("G", "previous group", group_href(run, n - 1) if n > 0 else None),
            ("j", "first rollout", rollout_href(g.members[0].ref) if g.members else None),
        ]
        return self.view.render(
            "group.html", run=t.run, g=g, members=members, training=t.training, keys=keys, steps=steps_href(run)
        )

    async def tokens_page(self, request: web.Request) -> web.Response:
        m = request.match_info
        ref = self.view.runs.get(int(m["run"]), int(m["part"]), int(m["line"]))
        if ref is None:
            raise web.HTTPNotFound()
        try:
            row = json.loads(self.view.runs.raw(ref))
        except ValueError:
            row = None
        tv = token_view(row if isinstance(row, dict) else {}, self.decode)
        return self.view.render(
            "tokens.html",
            meta=self.view.row_meta(ref),
            tv=tv,
            keys=self.keys(ref, to="tokens"),
            decoded=self.decode is not None,
        )

    async def steps_page(self, request: web.Request) -> web.Response:
        run = int(request.match_info["run"])
        t = self.training(run)
        return self.view.render("steps.html", run=t.run, charts=charts(t), t=t)

    async def tasks_page(self, request: web.Request) -> web.Response:
        """Which tasks the sampler favoured: each task's groups against a uniform share, the most picked first,
        with its estimated signal (the sampler's rule over its outcomes) and its pass rate step by step."""
        run = int(request.match_info["run"])
        t = self.training(run)
        picks = sum(len(line.groups) for line in t.tasks.values())
        uniform = picks / len(t.tasks) if t.tasks else 0.0
        lines = sorted(t.tasks.values(), key=lambda line: (-len(line.groups), line.key))
        shown = [
            {
                "href": task_href(run, line.key),
                "first": rollout_href(line.first),
                "line": line,
                "picked": len(line.groups),
                "favoured": len(line.groups) / uniform if uniform else None,
                "history": line.history(),
            }
            for line in lines
        ]
        return self.view.render("tasks.html", run=t.run, tasks=shown, picks=picks, steps=steps_href(run))

    async def task_page(self, request: web.Request) -> web.Response:
        run, key = int(request.match_info["run"]), request.match_info["key"]
        t = self.training(run)
        line = t.tasks.get(key)
        if line is None:
            raise web.HTTPNotFound()
        history = line.history()
        chart = plots.lines(
            "plot-task",
            f"Pass rate of task {key} per step (reward ≥ 1)",
            "step",
            "pass rate",
            [("pass rate", [(s, rate, 0.0) for s, rate in history])],
            floor=0.0,
        )
        return self.view.render(
            "task.html",
            run=t.run,
            line=line,
            history=history,
            chart=chart,
            first=rollout_href(line.first),
            tasks=tasks_href(run),
        )


def charts(t: Training) -> list[plots.Chart]:
    """The steps page's plots (empty: the run has fewer than one step's rows)."""
    steps = t.steps
    if not steps:
        return []
    x = "step" if t.training else "policy version"
    scored = [s for s in steps if s.rewards]
    out = [
        plots.lines(
            "plot-reward",
            f"Mean reward per {x}, ± its spread",
            x,
            "reward",
            [("mean reward", [(s.step, s.mean or 0.0, s.std) for s in scored])],
            floor=min([0.0, *(r for s in scored for r in s.rewards)]),  # rewards of 0 and up: no band below 0
        ),
        plots.lines(
            "plot-pass",
            f"Pass rate per {x} (reward ≥ 1)",
            x,
            "pass rate",
            [("pass rate", [(s.step, s.pass_rate or 0.0, 0.0) for s in scored])],
        ),
        plots.stacked(
            "plot-failures",
            f"Failures per {x} by attribution",
            x,
            "failures",
            {s.step: dict(s.failures) for s in steps},
        ),
    ]
    moved: list[tuple[float, int]] = []
    tasks = sorted({task for s in scored for task in s.tasks})
    for task in tasks:
        seen = [mean(s.tasks[task]) or 0.0 for s in scored if s.tasks.get(task)]
        if len(seen) >= 2:
            moved.append((abs(seen[-1] / 2 - seen[0] / 2), task))  # (halved: -1e308 to 1e308 stays finite)
    top = [task for _, task in sorted(moved, key=lambda m: (-m[0] if not math.isnan(m[0]) else math.inf, m[1]))]
    top = top[:MOVED]
    out.append(
        plots.lines(
            "plot-tasks",
            f"Reward over {x}s of the {len(top)} tasks that moved most",
            x,
            "mean reward",
            [
                (
                    f"task {task}",
                    [(s.step, mean(s.tasks[task]) or 0.0, 0.0) for s in scored if s.tasks.get(task)],
                )
                for task in top
            ],
        )
    )
    lengths = [(s.step, mean(s.lengths) or 0.0, spread(s.lengths)) for s in steps if s.lengths]
    out.append(
        plots.lines(
            "plot-length",
            f"Rollout length per {x} (generated tokens), ± its spread",
            x,
            "tokens",
            [("length", lengths)],
            floor=0.0,
        )
    )
    return out
