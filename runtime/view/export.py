"""``view --export DIR``: the pages as files that open from disk with no server, to share a run.

What is written: the runs page, the rollouts table as ``--filter`` leaves it (every page of it), each of its
rollouts' trajectory and token view, their groups, and each run's plots, plus the stylesheets and the keyboard
script. Each page is rendered by the server's own handlers, then its links are made relative (a flat folder:
``rollout-0-0-12.html``); a link to a page not written (another filter, the diff) loses its ``href``, and the
table's filter form goes (it needs a server). A ``file://`` page gets no header, so each carries its
Content-Security-Policy as a ``<meta http-equiv>`` (less ``frame-ancestors``, which a meta cannot set).
"""

from __future__ import annotations

import difflib
import importlib.resources
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import msgspec
from aiohttp.test_utils import make_mocked_request

from gym_runtime.errors import UserError
from gym_runtime.view import runs as runs_mod
from gym_runtime.view.runs import PAGE, Query
from gym_runtime.view.train_pages import group_href, rollout_href, steps_href, tokens_href

META_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; font-src 'none'; "
    "connect-src 'none'; form-action 'none'; base-uri 'none'"
)
_HREF = re.compile(rb'(href|src)="([^"]*)"')
_FORM = re.compile(rb"<form\b.*?</form>", re.S)


MARK = ".gym-runtime-bundle"  # a bundle's own list of the files it wrote: a later export may replace them
_KEYS = [f.encode_name for f in msgspec.structs.fields(Query) if f.name != "page"]


def query(text: str) -> Query:
    """``--filter``: the rollouts table's query string, as its URL shows it (``failure=any&run=0``)."""
    pairs = dict(parse_qsl(text.lstrip("?"), keep_blank_values=True))
    for key in pairs:
        if key not in _KEYS:
            near = difflib.get_close_matches(key, _KEYS, n=1, cutoff=0.5)
            fix = f"did you mean {near[0]!r}?" if near else f"the table's filters are {', '.join(_KEYS)}"
            raise UserError(f"--filter {text!r}: no filter {key!r}; {fix}")
    try:
        return msgspec.convert(pairs, Query, strict=False)
    except msgspec.ValidationError as e:
        raise UserError(f"--filter {text!r}: {e} (the table's query string, e.g. 'failure=any&run=0')") from None


def check_filter(text: str, q: Query, runs: runs_mod.Runs) -> None:
    """Each value of ``--filter`` against the values the rows have: a typo is one line naming those, never an
    empty bundle."""
    n = len(runs.runs)
    if q.run is not None and not 0 <= q.run < n:
        raise UserError(f"--filter {text!r}: no run {q.run}; the runs given are {', '.join(map(str, range(n)))}")
    if q.sort not in runs_mod.SORTS:
        raise UserError(f"--filter {text!r}: no sort {q.sort!r}; give one of {', '.join(runs_mod.SORTS)}")
    have = runs_mod.choices(runs)
    for key, value, extra in (("agent", q.agent, []), ("env", q.env, []), ("failure", q.failure, ["any", "none"])):
        allowed = extra + have[key]
        if value and value not in allowed:
            near = difflib.get_close_matches(value, allowed, n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}? " if near else ""
            listed = ", ".join(allowed) or "(none)"
            raise UserError(f"--filter {text!r}: no {key} {value!r} in these rows; {hint}give one of {listed}")


def prepare(out: Path, force: bool) -> list[str]:
    """``--export DIR`` made ready: a new or empty folder, or one a previous export wrote (its files, listed in its
    ``MARK``, are what this export replaces: returned); a folder holding anything else is refused, unless
    ``force`` (then only the files of the same names are written over)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--export {out}: not a folder; give a new or empty folder")
    if not out.is_dir() or force:
        return []
    held = sorted(p.name for p in out.iterdir())
    if not held:
        return []
    try:
        listed = msgspec.json.decode((out / MARK).read_bytes(), type=list[str])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UserError(
            f"--export {out}: a folder holding other files ({shown}), not a bundle `view --export` wrote; give a new "
            "or empty folder, or --force to write the bundle over them"
        ) from None
    return [name for name in listed if _ours(out, name)]


def _ours(out: Path, name: str) -> bool:
    """A name a bundle writes (``page.html``, ``static/x``), inside ``out``: never a path elsewhere."""
    parts = name.split("/")
    return len(parts) <= 2 and all(p and p not in (".", "..") for p in parts) and (out / name).is_file()


def _file(url: str, table: Query) -> str | None:
    """The bundle's file for a page's URL, or None (not one the bundle has a name for: a table under other filters
    than ``table``'s, the diff)."""
    parts = urlsplit(url)
    path = parts.path
    if path == "/":
        return "index.html"
    if path.startswith("/static/"):
        return "static/" + path.rsplit("/", 1)[1]
    if path == "/rollouts":
        try:
            q = msgspec.convert(dict(parse_qsl(parts.query)), Query, strict=False)
        except msgspec.ValidationError:
            return None
        page, q.page = q.page, table.page
        if q != table and parts.query:  # (the nav's bare link: the bundle's one table, whatever its filter)
            return None
        return "rollouts.html" if page == 1 else f"rollouts-{page}.html"
    for prefix in ("/rollout/", "/tokens/", "/group/", "/steps/"):
        if path.startswith(prefix):
            rest = path[len(prefix) :].replace("/", "-")
            return f"{prefix.strip('/')}-{rest}.html"
    return None


class Bundle:
    """One export: the pages asked for, rendered through ``view`` (a ``server.View``)."""

    def __init__(self, view: Any, out: Path, q: Query, replaces: list[str] | None = None) -> None:
        self.view = view
        self.out = out
        self.q = q
        self.replaces = replaces or []  # a previous bundle's files (``prepare``): removed before this one is written
        q.page = 1
        self.app = view.app()
        self.written: dict[str, int] = {}  # file -> bytes

    async def _get(self, url: str) -> bytes:
        """A page as the server renders it: its handler, found by the server's own router, called in process."""
        found = await self.app.router.resolve(make_mocked_request("GET", url, app=self.app))
        if found.http_exception is not None:
            raise UserError(f"view --export: no page at {url} ({found.http_exception.reason})")
        resp = await found.handler(make_mocked_request("GET", url, match_info=dict(found), app=self.app))
        return bytes(resp.body)

    def _relative(self, body: bytes, shown: set[str]) -> bytes:
        def link(m: re.Match[bytes]) -> bytes:
            target = m.group(2).decode()
            if target.startswith("#"):
                return m.group(0)
            name = _file(target.replace("&amp;", "&"), self.q)
            if name is not None and name in shown:
                return m.group(1) + b'="' + name.encode() + b'"'
            return b'data-not-exported="' + m.group(2) + b'"'

        body = _FORM.sub(b'<p class="note">(a shared bundle: the filters need the server)</p>', body)
        body = _HREF.sub(link, body)
        meta = f'<meta http-equiv="Content-Security-Policy" content="{META_CSP}">\n'.encode()
        return body.replace(b'<meta charset="utf-8">\n', b'<meta charset="utf-8">\n' + meta, 1)

    async def write(self) -> dict[str, int]:
        runs = self.view.runs
        found = runs_mod.select(runs, self.q)
        pages = max(1, -(-len(found) // PAGE))
        args = {k: v for k, v in msgspec.structs.asdict(self.q).items() if v is not None and v != "" and v is not False}
        urls = ["/"] + [f"/rollouts?{urlencode(args | {'page': n})}" for n in range(1, pages + 1)]
        groups: set[tuple[int, int]] = set()
        for ref in found:
            urls += [rollout_href(ref), tokens_href(ref)]
            t = self.view.train.training(ref.run)
            groups.add((ref.run, t.of[ref]))
        urls += [group_href(run, n) for run, n in sorted(groups)]
        urls += [steps_href(r.id) for r in runs.runs]
        shown = {name for u in urls if (name := _file(u, self.q)) is not None}
        shown |= {f"static/{name}" for name in self.view_static()}
        for name in self.replaces:
            (self.out / name).unlink(missing_ok=True)
        (self.out / "static").mkdir(parents=True, exist_ok=True)
        for name in self.view_static():
            data = (importlib.resources.files("gym_runtime.view") / "static" / name).read_bytes()
            self._put(f"static/{name}", data)
        for url in urls:
            name = _file(url, self.q)
            assert name is not None, url
            self._put(name, self._relative(await self._get(url), shown))
        (self.out / MARK).write_bytes(msgspec.json.encode(sorted(self.written)))
        return self.written

    @staticmethod
    def view_static() -> list[str]:
        return ["view.css", "train.css", "keys.js"]

    def _put(self, name: str, data: bytes) -> None:
        (self.out / name).write_bytes(data)
        self.written[name] = len(data)
