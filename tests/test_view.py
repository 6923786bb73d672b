"""``gym-runtime view`` without a browser: its index, its command's mistakes (one line, exit 2), and what its
server refuses (writes, paths, other hosts, requests without the token). The pages in a browser:
``tests/test_view_browser.py``."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest

from gym_runtime.view import index
from gym_runtime.view.runs import Query, open_runs, select, summarize
from tests.helpers import REPO, cli
from tests.stub_openai import StubOpenAI
from tests.view_rows import failure, row, sample_run, write

WEATHER = REPO / "resources/weather/data/example.jsonl"
SECRET = "sk-view-test-secret-0123456789"


def test_the_index_holds_each_lines_offset_and_filter_fields_and_is_kept_beside_the_file(tmp_path: Path) -> None:
    path = sample_run(tmp_path / "out.jsonl")
    ix = index.load(path)
    lines = path.read_bytes().splitlines()
    assert len(ix) == len(lines) == 13
    for i, line in enumerate(lines):
        assert index.read_line(path, ix, i) == line
        r = json.loads(line)
        assert (ix.task[i], ix.rollout[i], ix.reward[i]) == (r["_ng_task_index"], r["_ng_rollout_index"], r["reward"])
        assert ix.name(ix.agent[i]) == r["agent_ref"]["name"] and ix.name(ix.env[i]) == r["provenance"]["env"]
    assert ix.busy_ms[8 + 1] == 1100 + 5 and ix.tokens[0] == 150 and ix.cost[0] == 0.001
    assert (ix.pv_min[2], ix.pv_max[2], ix.pv_min[12]) == (1, 1, -1)  # task 1's rows: version 1; the last: none
    kept = index.index_path(path)
    assert kept.is_file()
    stamp = kept.stat().st_mtime_ns
    assert index.load(path) == ix and kept.stat().st_mtime_ns == stamp  # read back, not rebuilt

    with path.open("a") as f:  # the file grew: rebuilt
        f.write(json.dumps(row(9, 0, 1.0)) + "\n")
    assert len(index.load(path)) == 14


def test_rows_with_fields_of_other_types_are_indexed_with_what_fits(tmp_path: Path) -> None:
    odd = {"reward": "high", "agent_ref": "not a dict", "_ng_task_index": 3, "cost": {"models": []}}
    path = write(tmp_path / "odd.jsonl", [odd, {"unrelated": True}])
    ix = index.load(path)
    assert len(ix) == 2 and ix.task[0] == 3 and math.isnan(ix.reward[0]) and ix.agent[0] == -1


def test_the_runs_summary_and_the_table_filters(tmp_path: Path) -> None:
    runs = open_runs([str(sample_run(tmp_path / "out.jsonl"))])
    (run,) = runs.runs
    assert [p.failures for p in run.parts] == [False, True]  # the _failures.jsonl beside it is read too
    s = summarize(run)
    assert (s.rows, s.failures) == (13, 2)
    rewards = [1.0 if (t + r) % 3 else 0.0 for t in range(6) for r in range(2)] + [0.5]
    assert s.mean_reward == pytest.approx(sum(rewards) / len(rewards))
    assert dict(s.failure_classes) == {"timeout": 1, "sandbox": 1}
    assert s.costs == {"USD": pytest.approx(0.013)} and s.tokens == 13 * 150
    assert s.slowest[0][1] == 1105 and (s.slowest[0][0].line, s.slowest[0][0].part) == (9, 0)
    # pass@1 over (agent, task): weather's 6 tasks with 2 rollouts, other_agent's 1, the failures' task 7 (0 of 2)
    per_task = [sum(rewards[2 * t : 2 * t + 2]) / 2 for t in range(6)] + [0.0, 0.0]
    assert s.pass_at[1] == pytest.approx(sum(per_task) / 8)
    assert s.pass_at[2] == pytest.approx(sum(1.0 for t in range(6) if max(rewards[2 * t : 2 * t + 2]) == 1) / 7)
    assert sorted(h.label for h in s.histograms) == ["other_agent / ffeeddccbbaa", "weather_agent / a1b2c3d4e5f6"]

    def picked(**kw: object) -> list[tuple[int, int]]:
        ix = run.parts
        return [(ix[r.part].ix.task[r.line], ix[r.part].ix.rollout[r.line]) for r in select(runs, Query(**kw))]

    assert picked(agent="other_agent") == [(6, 0)]
    assert picked(failure="sandbox") == [(7, 1)]
    assert picked(failure="any") == [(7, 0), (7, 1)]
    assert len(picked(failure="none")) == 13
    assert picked(rmin=0.2, rmax=0.7) == [(6, 0)]
    assert all(t % 2 == 1 for t, _ in picked(pv=1)) and len(picked(pv=1)) == 6
    assert picked(q="PARTLY cloudy") == [(6, 0)]  # full text, case-insensitive
    assert picked(q="the sandbox exited") == [(7, 1)]
    assert picked(sort="busy", desc=True)[0] == (4, 1)


def test_full_text_search_finds_text_as_either_writer_escapes_it(tmp_path: Path) -> None:
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(row(0, 0, 1.0, answer="il fait très beau"), ensure_ascii=False) + "\n")
    escaped = write(tmp_path / "esc.jsonl", [row(0, 0, 1.0, answer="il fait très beau")])
    runs = open_runs([str(raw), str(escaped)])
    assert [r.run for r in select(runs, Query(q="IL FAIT très"))] == [0, 1]
    assert {r.run for r in select(runs, Query(q="très"))} == {0, 1}


# ------------------------------------------------------------------ the command


def view(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", "view", *argv], capture_output=True, text=True, timeout=timeout
    )


def one_error_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def test_a_file_that_is_not_jsonl_is_named_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row(0, 0, 1.0)) + "\n\nthis is not json\n")
    line = one_error_line(view(str(bad), "--port", "0"))
    assert f"{bad}:3: not JSON" in line

    notobj = tmp_path / "list.jsonl"
    notobj.write_text("[1, 2]\n")
    assert f"{notobj}:1: not a JSON object" in one_error_line(view(str(notobj), "--port", "0"))
    assert "no such file" in one_error_line(view(str(tmp_path / "absent.jsonl")))


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    path = sample_run(tmp_path / "out.jsonl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = one_error_line(view(str(path), "--port", str(port)))
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in line and "give a free port, e.g. --port " in line


class Served:
    """A running ``view``: its printed URL, and the cookie that URL's token is traded for (the way in)."""

    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc, self.url = proc, url
        self.base = url.split("?")[0].rstrip("/")
        self.token = parse_qs(urlsplit(url).query).get("token", [""])[0]
        self.cookie = ""
        if self.token:
            status, headers, _ = fetch(url)
            assert status == 303, status
            self.cookie = headers["Set-Cookie"].split(";")[0]

    def get(self, path: str, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        """``path`` fetched as the browser that opened the printed URL would (with its cookie)."""
        headers = {"Cookie": self.cookie} if self.cookie else {}
        return fetch(self.base + path, headers=headers | kw.pop("headers", {}), **kw)

    def entry(self, path: str) -> str:
        """``path`` with the token: a browser opening it is let in (the token traded for the cookie)."""
        if not self.token:
            return self.base + path
        return self.base + path + ("&" if "?" in path else "?") + urlencode({"token": self.token})


def serve(*argv: str) -> Iterator[Served]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "view", "--port", "0", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("gym-runtime view: http://"), first + (proc.stderr.read() if proc.stderr else "")
        yield Served(proc, first.split(": ", 1)[1].strip())
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from serve(str(sample_run(tmp_path / "out.jsonl")))


def fetch(url: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a: object, **kw: object) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with opener.open(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_pages_carry_a_policy_that_allows_only_their_own_script_and_the_server_has_no_write(
    served: Served,
) -> None:
    assert served.url.startswith("http://127.0.0.1:")
    pages = ("/", "/rollouts", "/rollouts?agent=other_agent", "/rollout/0/0/0", "/rollout/0/1/1", "/group/0/0")
    for path in (*pages, "/tokens/0/0/2", "/steps/0"):
        status, headers, body = served.get(path)
        assert status == 200, (path, body[:500])
        csp = headers["Content-Security-Policy"]
        assert "script-src 'self';" in csp and "default-src 'none'" in csp and "connect-src 'none'" in csp
        assert "unsafe" not in csp and headers["X-Content-Type-Options"] == "nosniff"
        # the one script: keyboard navigation, a static file of the server's own
        assert body.count(b"<script") == 1 and b'<script src="/static/keys.js" defer></script>' in body
    status, headers, js = served.get("/static/keys.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript") and b"innerHTML" not in js
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert served.get("/rollouts", method=method)[0] == 405
    status, headers, _ = served.get("/nowhere")
    assert status == 404 and "Content-Security-Policy" in headers


@pytest.mark.parametrize(
    "path",
    [
        "/rollout/0/0/13",
        "/rollout/1/0/0",
        "/rollout/0/2/0",
        "/rollout/-1/0/0",
        "/rollout/0/0/..%2f..%2fetc%2fpasswd",
        "/static/..%2f..%2f..%2fetc%2fpasswd",
        "/static/../index.py",
        "/static/index.py",
        "/static/%2e%2e/server.py",
        "/templates/base.html",
    ],
)
def test_no_path_names_a_file_beyond_those_given(served: Served, path: str) -> None:
    status, _, body = served.get(path)
    assert status == 404, (path, status, body[:300])


def test_on_loopback_another_host_name_is_refused(served: Served) -> None:
    """A page on another site that rebinds its name to 127.0.0.1 sends its own name as Host."""
    assert served.get("/", headers={"Host": "evil.example:80"})[0] == 421
    port = served.base.rsplit(":", 1)[1]
    assert served.get("/", headers={"Host": f"localhost:{port}"})[0] == 200


def test_on_loopback_a_host_naming_another_port_is_refused_cookie_and_all(served: Served) -> None:
    """Host names a server by name and port (issue 73): with the valid cookie, ``127.0.0.1:<another port>`` is
    refused, 421 as the gateway does (one rule: ``ops.hosts``)."""
    port = int(served.base.rsplit(":", 1)[1])
    other = port + 1 if port < 65535 else port - 1
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
        assert served.get("/rollouts", headers={"Host": host})[0] == 200, host
    for host in (f"127.0.0.1:{other}", f"localhost:{other}", f"[::1]:{other}", f"evil.example:{port}"):
        status, _, body = served.get("/rollouts", headers={"Host": host})
        assert status == 421 and b"weather" not in body, (host, status)
    for host in ("127.0.0.1:99999", f"127.0.0.1:{port}@evil.example", f"::1:{port}", f"[::1]evil:{port}"):
        assert served.get("/rollouts", headers={"Host": host})[0] == 421, host


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_every_request_needs_the_printed_token_loopback_included(tmp_path: Path, host: str) -> None:
    """On a shared login or GPU node, loopback is every local user: a ``curl`` with no token reads nothing."""
    for s in serve(str(sample_run(tmp_path / "out.jsonl")), "--host", host):
        assert "?token=" in s.url and len(s.token) >= 32
        base = "http://127.0.0.1:" + s.base.rsplit(":", 1)[1]
        for path in ("/", "/rollouts", "/rollout/0/0/0", "/diff", "/static/view.css"):
            assert fetch(base + path)[0] == 403, path
        assert fetch(base + "/rollout/0/0/0?token=wrong")[0] == 403
        name = s.cookie.split("=")[0]
        assert fetch(base + "/", headers={"Cookie": f"{name}=wrong"})[0] == 403
        status, headers, _ = fetch(base + f"/rollouts?agent=other_agent&token={s.token}")
        assert status == 303 and headers["Location"] == "/rollouts?agent=other_agent"  # the token leaves the URL
        assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
        cookie = headers["Set-Cookie"].split(";")[0]
        status, _, body = fetch(base + "/rollouts?agent=other_agent", headers={"Cookie": cookie})
        assert status == 200 and b"1 rollout" in body


def test_two_views_keep_their_own_cookie_and_no_token_says_what_it_exposes(tmp_path: Path) -> None:
    path = str(sample_run(tmp_path / "out.jsonl"))
    for one in serve(path):
        for two in serve(path):
            assert one.cookie.split("=")[0] != two.cookie.split("=")[0]  # one browser, both open
            assert two.get("/", headers={"Cookie": f"{one.cookie}; {two.cookie}"})[0] == 200
            assert fetch(two.base + "/", headers={"Cookie": one.cookie})[0] == 403
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "view", "--port", "0", "--no-token", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = proc.stdout.readline().split(": ", 1)[1].strip()
        said = proc.stderr.readline()
        assert "token" not in url and fetch(url)[0] == 200
        assert "--no-token: every row" in said and "every user and process of this machine" in said
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_failure_rows_trajectory_shows_its_class_message_and_task(tmp_path: Path) -> None:
    path = write(tmp_path / "out.jsonl", [row(0, 0, 1.0)], [failure(1, 0, "timeout", "gave up after <b>3</b> tries")])
    for s in serve(str(path)):
        status, _, body = s.get("/rollout/0/1/0")
        assert status == 200
        assert (
            b"timeout: gave up after &lt;b&gt;3&lt;/b&gt; tries" in body and b"What is the weather in city 1?" in body
        )


def test_a_failure_rows_trajectory_says_who_caused_it_and_shows_the_policys_turns(tmp_path: Path) -> None:
    """Issue 66: view shows a failure row's attribution, and its partial trajectory (what the policy produced
    before the failure) as the trajectory, saying it is partial."""
    failed = failure(1, 0, "timeout", "rollout exceeded timeout_s=3")
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "stalling on purpose"}]}
    failed.update(
        failure_attribution="policy",
        partial=True,
        response={"id": "r", "output": [said], "status": "incomplete"},
        time_split={"total_ms": 3000, "tools_ms": 2900},
    )
    path = write(tmp_path / "out.jsonl", [row(0, 0, 1.0)], [failed])
    for s in serve(str(path)):
        status, _, body = s.get("/rollout/0/1/0")
        assert status == 200
        assert b'id="attribution"' in body and b"the policy" in body, body[:3000]
        assert b"stalling on purpose" in body and b"before it failed" in body


def test_run_keeps_the_attempts_manifest_and_config_beside_its_output_without_secrets(tmp_path: Path) -> None:
    """``run``'s bus goes with it: the attempt records, the manifest and the config are kept in sidecars (the
    model entry's key, from the environment, replaced) and the trajectory page lists the attempts."""
    with StubOpenAI() as stub:  # a second model entry, with a key, that the agent does not use
        raw = (
            (REPO / "resources/weather/config.yaml")
            .read_text()
            .replace(
                "models:\n",
                f"models:\n  judge: {{adapter: openai, base_url: '{stub.base_url}', model: tiny, "
                "api_key: '${VIEW_TEST_KEY}'}\n",
            )
        )
        config = tmp_path / "config.yaml"
        config.write_text(raw.replace("resources.weather", "gym_runtime.resources.weather"))
        out = tmp_path / "out.jsonl"
        done = cli("run", str(config), "-i", str(WEATHER), "-o", str(out), env={"VIEW_TEST_KEY": SECRET})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    side = [json.loads(line) for line in (tmp_path / "out_attempts.jsonl").read_text().splitlines()]
    for r in rows:
        slot = [
            s for s in side if (s["task_index"], s["rollout_index"]) == (r["_ng_task_index"], r["_ng_rollout_index"])
        ]
        (start,) = [s for s in slot if s["kind"] == "attempt.start.v1"]
        (result,) = [s for s in slot if s["kind"] == "result"]
        assert start["worker"] == r["provenance"]["workers"]["agent"][0] and start["attempt"] == result["attempt"] == 1
    batch_text = (tmp_path / "out_batch.json").read_text()
    assert SECRET not in batch_text
    batch = json.loads(batch_text)
    assert batch["manifest"]["tasks"] == len(rows) and batch["config"]["agents"]["weather_agent"]["model"] == "policy"
    for s in serve(str(out)):
        status, _, body = s.get("/rollout/0/0/0")
        assert status == 200 and b'id="attempts"' in body and b"(the slot&#39;s)" in body
        status, _, body = s.get("/")
        assert status == 200 and batch["batch"].encode() in body and SECRET.encode() not in body


SANDBOXED = """
namespace: gym
nats: embedded
models:
  policy: {adapter: scripted}
sandboxes:
  proc: {backend: process}
resources:
  env: {server: tests.envs.sandboxed, sandbox: proc}
agents:
  agent: {agent: tests.envs.sandboxed, model: policy, resource: env, sandbox: proc, timeout_s: 120}
"""


def test_each_sandbox_command_an_attempt_ran_is_kept_and_shown(tmp_path: Path) -> None:
    """Rows record no sandbox command; the attempts sidecar does (command, exit code, time, output size, head),
    from the agent's own sandbox (the process backend: no engine needed), and the trajectory page lists it."""
    config = tmp_path / "config.yaml"
    config.write_text(SANDBOXED)
    tasks = tmp_path / "in.jsonl"
    tasks.write_text("".join(WEATHER.read_text().splitlines(keepends=True)[:2]))
    out = tmp_path / "out.jsonl"
    done = cli("run", str(config), "-i", str(tasks), "-o", str(out))  # (run in the repository: tests.envs)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sleep 0.2" not in out.read_text()
    side = [json.loads(line) for line in (tmp_path / "out_attempts.jsonl").read_text().splitlines()]
    results = [s for s in side if s["kind"] == "result"]
    assert len(results) == 2
    for r in results:
        (cmd,) = r["commands"]
        assert cmd["command"] == "sleep 0.2; echo ready" and cmd["exit_code"] == 0
        assert cmd["output_bytes"] == 6 and cmd["head"] == "ready\n" and cmd["ms"] >= 200
    for s in serve(str(out)):
        status, _, body = s.get("/rollout/0/0/0")
        page = body.decode()
        assert status == 200 and "sandbox command" in page and "sleep 0.2; echo ready" in page
        assert "exit 0 · 6 bytes of output" in page


def test_the_table_pages_by_fifty_and_a_diff_of_runs_with_no_task_in_common_says_so(tmp_path: Path) -> None:
    many = write(tmp_path / "many.jsonl", [row(t, 0, float(t % 2)) for t in range(120)])
    other = write(tmp_path / "other.jsonl", [row(500, 0, 1.0)])
    for s in serve(str(many), str(other)):
        _, _, first = s.get("/rollouts?run=0&sort=task")
        assert b"120 rollouts, page 1 of 3" in first and first.count(b'href="/rollout/0/0/') == 50
        assert b'id="next" href="/rollouts?page=2&amp;run=0&amp;sort=task"' in first
        _, _, last = s.get("/rollouts?run=0&sort=task&page=3")
        assert b"page 3 of 3" in last and last.count(b'href="/rollout/0/0/') == 20 and b'id="next"' not in last
        _, _, beyond = s.get("/rollouts?run=0&page=99")
        assert b"page 3 of 3" in beyond
        assert s.get("/rollouts?rmin=high")[0] == 400
        status, _, page = s.get("/diff?a=0&b=1")
        assert status == 200 and b'id="problem"' in page and b"have no task in common" in page


def test_a_file_that_is_not_rollouts_is_refused_naming_what_to_open(tmp_path: Path) -> None:
    """The input tasks file, and the sidecars that tab-complete next to the output: one line, exit 2."""
    msg = one_error_line(view(str(WEATHER), "--port", "0"))
    assert f"{WEATHER}:1: a task row (no response, no reward), not rollouts" in msg and f"-i {WEATHER}" in msg
    out = sample_run(tmp_path / "out.jsonl")
    attempts = tmp_path / "out_attempts.jsonl"
    attempts.write_text(json.dumps({"kind": "result", "task_index": 0, "rollout_index": 0, "attempt": 1}) + "\n")
    msg = one_error_line(view(str(attempts), "--port", "0"))
    assert msg.endswith(
        f"{attempts}: the attempts sidecar of out.jsonl, not rollouts: open {out} (view reads its sidecars)"
    )
    batch = tmp_path / "out_batch.json"
    batch.write_text("{}")
    assert f"open {out}" in one_error_line(view(str(batch), "--port", "0"))
    index.load(out)
    assert "view's index of a file" in one_error_line(view(str(index.index_path(out)), "--port", "0"))
    done = cli("diff", str(out), str(WEATHER))
    assert done.returncode == 2 and "a task row" in done.stderr and "Traceback" not in done.stderr


def test_environments_by_name_tools_folded_and_runs_named_as_given(tmp_path: Path) -> None:
    """Our rows name their environment's code by digest only: the batch sidecar's config names it; the tools'
    JSON starts folded (the turns begin on the first screen)."""
    out = sample_run(tmp_path / "out.jsonl")
    config = {"agents": {"weather_agent": {"resource": "weather"}, "other_agent": {"resource": "elsewhere"}}}
    (tmp_path / "out_batch.json").write_text(json.dumps({"batch": "b1", "manifest": {}, "config": config}))
    for s in serve(str(out)):
        page = s.get("/rollout/0/0/0")[2].decode()
        assert "<dt>environment</dt><dd>weather</dd>" in page
        assert '<details class="tools" id="tools"><summary>Tools offered (1: get_weather)</summary>' in page
        runs = s.get("/")[2].decode()
        assert "weather_agent / weather" in runs and "other_agent / elsewhere" in runs and "a1b2c3d4e5f6" not in runs
        assert "1 rollout" in s.get("/rollouts?env=elsewhere")[2].decode()
        assert "<option>weather</option>" in s.get("/rollouts")[2].decode()


def test_a_groups_failure_rows_and_excluded_members_show_none_not_not_a_number(tmp_path: Path) -> None:
    """Issue 75: a failure row's reward is null and an excluded member (handed none) has no advantage: the group
    page says none ("–"), not "not a number" nor TRL's placeholder 0 as if it were an advantage."""
    plain = write(tmp_path / "out.jsonl", [row(0, 0, 1.0)], [failure(7, 0), failure(7, 1, "sandbox")])
    scored = row(1, 0, 1.0) | {"train_step": 0, "train_group": 5, "train_reward": 1.0, "train_advantage": 0.5}
    excluded = failure(1, 1, "sandbox") | {"train_step": 0, "train_group": 5, "train_advantage": 0.0}
    train = write(tmp_path / "train.jsonl", [scored], [excluded | {"failure_attribution": "infrastructure"}])
    for path, group in ((plain, "group-0-1.html"), (train, "group-0-0.html")):
        out = tmp_path / f"bundle-{path.stem}"
        res = cli("view", str(path), "--export", str(out))
        assert res.returncode == 0, res.stderr
        page = (out / group).read_text()
        assert "not a number" not in page, page
        cells = re.findall(r'<td class="num(?: adv)?">([^<]*)</td>', page)
        assert cells.count("–") >= 2, cells  # (both rewards; the excluded member's reward, handed and advantage)
        if path == train:
            assert "+0.500" in cells and "+0.000" not in cells, cells
