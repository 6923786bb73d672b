"""``gym-runtime view``'s web server: read-only pages over the runs given (aiohttp, Jinja2 templates).

What a model, tool or environment wrote reaches the page only through the templates' autoescaping, and the
Content-Security-Policy allows one script, the first-party ``static/keys.js`` (keyboard navigation: it follows
the links the server rendered and inserts nothing; filters are a GET form, long texts ``<details>``), no inline
script, no request off the server, no frame and no form posting elsewhere. Only GET routes exist;
a row is named by integers into the files given, a static file by a name in a fixed list. Who is answered
is ``view.access``'s frozen policy (the token, the Host names), checked before any handler.
"""

from __future__ import annotations

import importlib.resources
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
import msgspec
from aiohttp import web

from gym_runtime.data.jsonlines import TOO_DEEP
from gym_runtime.errors import UserError
from gym_runtime.view import runs as runs_mod
from gym_runtime.view.access import Access
from gym_runtime.view.branches import Branches
from gym_runtime.view.diff import compare, task_name
from gym_runtime.view.runs import PAGE, Query, Ref, Runs
from gym_runtime.view.tokens import Decode
from gym_runtime.view.train_pages import TrainPages, rollout_href
from gym_runtime.view.trajectory import as_text, attempt_rows, kept_attempt, trajectory

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; font-src 'none'; "
    "connect-src 'none'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
STATIC = {"view.css": "text/css", "train.css": "text/css", "keys.js": "text/javascript"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NO_WAITS = "this view follows no batch on a bus: `gym-runtime view --batch B --nats URL` shows where its rollouts wait"


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("gym_runtime.view", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["reward"] = number
    env.filters["logprob"] = lambda v: f"{v:.4f}" if isinstance(v, float) and abs(v) < 1e6 else number(v)
    env.filters["pct"] = lambda v: "–" if v is None else f"{100 * v:.1f}%" if math.isfinite(v) else number(v)
    env.filters["money"] = lambda v: f"{v:.4f}" if isinstance(v, float) and abs(v) < 1e12 else number(v)
    env.filters["signed"] = _signed
    env.filters["advantage"] = _advantage
    env.globals["as_text"] = as_text
    env.globals["task_name"] = task_name
    env.globals["query"] = lambda base, **kw: (
        base + "?" + urlencode({k: v for k, v in kw.items() if v not in (None, "")})
    )
    return env


def number(v: Any) -> str:
    """A number a row holds, as it is: None "–", NaN "not a number", infinities, huge and tiny ones in
    scientific form (an integer beyond a float's range too: 10**400 is ``1e+400``); anything else as text."""
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        if abs(v) < 10**15:
            return str(v)
        digits = str(abs(v))  # (at most 4,300 digits: Python's parser refuses more, so no row holds more)
        tail = digits[1:6].rstrip("0")
        return f"{'-' if v < 0 else ''}{digits[0]}{'.' + tail if tail else ''}e+{len(digits) - 1}"
    if math.isnan(v):
        return "not a number"
    if math.isinf(v) or abs(v) >= 1e6 or 0 < abs(v) < 1e-4:
        return f"{v:.6g}"
    return f"{v:.3f}".rstrip("0").rstrip(".")


def _advantage(v: Any) -> str:
    """An advantage, its sign shown; one beyond the usual range as ``number`` writes it."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and (v == 0 or 1e-4 <= abs(v) < 1e6):
        return f"{v:+.3f}"
    return number(v)


def _signed(v: float, pct: bool = False) -> str:
    """A difference, its sign shown: points for a rate."""
    if not math.isfinite(v):
        return number(v)
    return f"{100 * v:+.1f} points" if pct else f"{v:+.4g}"


def page(html: str, status: int = 200) -> web.Response:
    # a lone surrogate (valid JSON: "\ud800") cannot be UTF-8: shown as its escape, never dropped
    return web.Response(
        body=html.encode("utf-8", "backslashreplace"), status=status, content_type="text/html", charset="utf-8"
    )


class View:
    """The pages over ``runs``, answered only as ``access`` allows."""

    def __init__(
        self,
        runs: Runs,
        access: Access | None = None,
        *,
        decode: Decode | None = None,
        waits: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self.runs = runs
        self.access = access
        self.env = _templates()
        self.waits = waits  # live mode: ``why``'s report of the followed batch, read on each /waits page
        self.env.globals["waits_live"] = waits is not None
        self._summaries: dict[int, tuple[int, runs_mod.Summary]] = {}  # run -> (its generation, its summary)
        self._choices: tuple[tuple[int, ...], dict[str, list[str]]] | None = None
        self.train = TrainPages(self, decode)  # groups, tokens, plots, keyboard links
        self.branches = Branches(runs)  # each rollout's branches, for its page's tree
        for r in runs.runs:
            self._summary(r)

    @property
    def live(self) -> bool:
        return any(r.live is not None for r in self.runs.runs)

    def _summary(self, run: runs_mod.Run) -> runs_mod.Summary:
        """A run's summary: a file's computed once (again when it changed), a live batch's on each page."""
        kept = self._summaries.get(run.id)
        if run.live is not None or kept is None or kept[0] != run.generation:
            t = self.train.trainings.of(run)  # a training run's pass@k is over its groups
            kept = self._summaries[run.id] = (
                run.generation,
                runs_mod.summarize(run, groups_of=t.of if t.training else None),
            )
        return kept[1]

    @property
    def summaries(self) -> list[runs_mod.Summary]:
        return [self._summary(r) for r in self.runs.runs]

    @property
    def choices(self) -> dict[str, list[str]]:
        stamp = tuple(r.generation for r in self.runs.runs)
        if self.live or self._choices is None or self._choices[0] != stamp:
            self._choices = (stamp, runs_mod.choices(self.runs))
        return self._choices[1]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self.runs_page)
        app.router.add_get("/rollouts", self.rollouts_page)
        app.router.add_get("/rollout/{run:\\d+}/{part:\\d+}/{line:\\d+}", self.rollout_page)
        app.router.add_get("/diff", self.diff_page)
        app.router.add_get("/waits", self.waits_page)
        self.train.routes(app)
        app.router.add_get("/static/{name}", self.static)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if self.access is not None:  # (None: pages written to files, never served)
                self.access.admit(request)
            self.runs.refresh()  # a file rewritten, truncated or grown since: re-indexed before it is read
            resp = await handler(request)
        except web.HTTPException as e:
            resp = e
        resp.headers.update(HEADERS)
        return resp

    def render(self, name: str, **context: Any) -> web.Response:
        return page(self.env.get_template(name).render(runs=self.runs.runs, **context))

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        body = (importlib.resources.files("gym_runtime.view") / "static" / name).read_bytes()
        return web.Response(body=body, content_type=STATIC[name])

    async def runs_page(self, request: web.Request) -> web.Response:
        refresh = any(r.live is not None and not r.live.done for r in self.runs.runs)
        return self.render(
            "runs.html", summaries=self.summaries, row=self.row_meta, refresh=refresh, train=self.train.summary
        )

    async def waits_page(self, request: web.Request) -> web.Response:
        """Live mode: where every in-flight rollout of the followed batch waits now, the oldest first, the waits
        past their bound flagged with the component to look at (what ``gym-runtime why --batch`` prints)."""
        if self.waits is None:
            html = self.env.get_template("waits.html").render(runs=self.runs.runs, report=None, problem=NO_WAITS)
            return page(html, status=404)
        return self.render("waits.html", report=await self.waits(), problem=None)

    async def rollouts_page(self, request: web.Request) -> web.Response:
        try:
            q = msgspec.convert({k: v for k, v in request.query.items() if v != ""}, Query, strict=False)
        except msgspec.ValidationError as e:
            raise web.HTTPBadRequest(text=f"bad filter: {e}") from None
        found = runs_mod.select(self.runs, q)
        pages = max(1, -(-len(found) // PAGE))
        q.page = min(max(1, q.page), pages)
        shown = found[(q.page - 1) * PAGE : q.page * PAGE]
        # (``0`` is a value: a run, a reward bound, a policy version; ``False`` is not asked for)
        args = {k: v for k, v in msgspec.structs.asdict(q).items() if v is not None and v != "" and v is not False}
        args.pop("page")
        return self.render(
            "rollouts.html",
            q=q,
            args=args,
            total=len(found),
            pages=pages,
            rows=[self.row_meta(r) for r in shown],
            choices=self.choices,
            sorts=list(runs_mod.SORTS),
        )

    async def rollout_page(self, request: web.Request) -> web.Response:
        m = request.match_info
        ref = self.runs.get(int(m["run"]), int(m["part"]), int(m["line"]))
        if ref is None:
            raise web.HTTPNotFound()
        meta = self.row_meta(ref)
        problem = self.runs.part(ref).ix.unreadable.get(ref.line)
        if problem is None:
            try:
                row = json.loads(self.runs.raw(ref))  # (the stdlib keeps a lone surrogate: the page shows its escape)
                if not isinstance(row, dict):
                    raise TypeError("not a JSON object")
                run = self.runs.runs[ref.run]
                records = None
                if run.attempts is not None and meta["task"] is not None and meta["rollout"] is not None:
                    records = attempt_rows(run.attempts.of(meta["task"], meta["rollout"]), kept_attempt(row))
                keys = self.train.keys(ref)
                tree = self.branches.tree(ref, row, meta["task"], meta["rollout"])
                return self.render(
                    "trajectory.html",
                    meta=meta,
                    t=trajectory(row),
                    attempts=records,
                    keys=keys,
                    tree=tree,
                    href=rollout_href,
                )
            except RecursionError:
                problem = f"line {ref.line + 1} of the rows indexed: {TOO_DEEP}"
            except (OSError, ValueError, TypeError) as e:  # changed between its index and this read
                problem = f"{type(e).__name__}: {e}"
        return self.render("unreadable.html", meta=meta, problem=problem)

    async def diff_page(self, request: web.Request) -> web.Response:
        n = len(self.runs.runs)
        try:
            a = int(request.query.get("a", 0))
            b = int(request.query.get("b", min(1, n - 1)))
        except ValueError:
            raise web.HTTPBadRequest(text="a and b are run numbers") from None
        if not (0 <= a < n and 0 <= b < n):
            raise web.HTTPNotFound()
        every = request.query.get("all") == "true"
        d, problem = None, ""
        if n < 2:
            problem = "give view two runs to compare them"
        else:
            try:
                d = compare(self.runs, a, b)
            except UserError as e:
                problem = str(e)
        shown = (
            [p for p in d.pairs if every or p.flip or p.delta or p.changed or p.failure_a != p.failure_b] if d else []
        )
        return self.render("diff.html", a=a, b=b, d=d, every=every, shown=shown, problem=problem, href=rollout_href)

    def row_meta(self, ref: Ref) -> dict[str, Any]:
        """A row's index fields, as the tables show them."""
        part = self.runs.part(ref)
        ix = part.ix
        i = ref.line
        pv = (ix.pv_min[i], ix.pv_max[i]) if ix.pv_min[i] >= 0 else None
        return {
            "href": rollout_href(ref),
            "run": self.runs.runs[ref.run].label,
            "file": Path(part.shown).name,
            "task": ix.task[i] if ix.task[i] >= 0 else None,
            "rollout": ix.rollout[i] if ix.rollout[i] >= 0 else None,
            "agent": ix.name(ix.agent[i]),
            "env": self.runs.runs[ref.run].env_label(ix, i),
            "reward": None if math.isnan(ix.reward[i]) else ix.reward[i],
            "failure": ix.name(ix.error_class[i]) or ("failure" if part.failures else ""),
            "pv": pv,
            "busy_ms": ix.busy_ms[i],
            "tokens": ix.tokens[i],
            "cost": None if math.isnan(ix.cost[i]) else ix.cost[i],
            "currency": ix.name(ix.currency[i]),
            "bytes": ix.lengths[i],
        }
