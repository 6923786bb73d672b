"""Operator experience, tried as a user would: errors, progress, metrics, spans, logs, status, config semantics.

Every test drives the real CLI in a subprocess (real nats-server, real workers,
real files, real HTTP); only the LLM is a test double (``scripted``, or the
local OpenAI-compatible stub in ``tests/stub_openai.py``).
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.errors import ConfigError
from gym_runtime.ops.nats_server import EmbeddedServer, free_port
from tests.helpers import REPO, cli, read_jsonl, write_jsonl
from tests.stub_openai import StubOpenAI, StubReply

WEATHER = "resources/weather/config.yaml"
EXAMPLE = "resources/weather/data/example.jsonl"


def weather_rows(n: int = 5) -> list[dict[str, Any]]:
    rows = read_jsonl(REPO / EXAMPLE)
    return [dict(rows[i % len(rows)]) for i in range(n)]


def assert_user_error(res: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and "ExceptionGroup" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert 1 <= len(lines) <= 2, res.stderr  # one or two lines, whatever the mistake
    for f in fragments:
        assert f in res.stderr, (f, res.stderr)


# ------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("sets", "fragments"),
    [
        (["models.policy.adapter=nope"], ["models.policy.adapter: no such adapter module 'nope'"]),
        (["models.policy.adapter=openai"], ["models.policy", "no API key"]),
        (["resources.weather.server=resources.does_not_exist"], ["resources.weather.server: no such resource module"]),
        (["models.polcy.adapter=openai"], ["no key models.polcy", "did you mean models.policy?"]),
        (["agents.weather_agent.max_stepz=3"], ["did you mean agents.weather_agent.max_steps?"]),
        (["a=[1,"], ["--set a: the value '[1,' is not valid YAML"]),
    ],
)
def test_config_and_worker_mistakes_are_one_line_exit_2(tmp_path: Path, sets: list[str], fragments: list[str]) -> None:
    out = tmp_path / "out.jsonl"
    args = [x for s in sets for x in ("--set", s)]
    res = cli("run", WEATHER, "-i", EXAMPLE, "-o", str(out), *args, env={"OPENAI_API_KEY": ""})
    assert_user_error(res, *fragments)
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, no partial spool


def test_a_worker_pool_that_cannot_build_a_worker_exits_2(nats_server: EmbeddedServer) -> None:
    # the weather config starts three processes; the model's fails on the adapter name
    res = cli("start", WEATHER, "--nats", nats_server.url, "--set", "models.policy.adapter=nope")
    assert_user_error(res, "models.policy.adapter: no such adapter module 'nope'")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
        (["--limit", "x"], "argument --limit: expected a whole number"),
        (["--progress-every", "0"], "argument --progress-every: must be in (0, 100]"),
        (["--log-level", "loud"], "argument --log-level: invalid choice"),
        (["--processes", "0"], "argument --processes: expected auto, one, per-role or a number of processes, got '0'"),
        (
            ["--processes", "many"],
            ("argument --processes: expected auto, one, per-role or a number of processes, got 'many'"),
        ),
    ],
)
def test_bad_cli_values_are_one_line_exit_2(tmp_path: Path, argv: list[str], fragment: str) -> None:
    res = cli("run", WEATHER, "-i", EXAMPLE, "-o", str(tmp_path / "o.jsonl"), *argv)
    assert_user_error(res, fragment)
    [line] = res.stderr.strip().splitlines()  # the mistake, not argparse's whole usage block
    assert line.startswith("gym-runtime run: error: argument ") and line.endswith("(see gym-runtime run --help)")


def test_unwritable_output_is_refused_before_any_work(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for out in (blocker / "out.jsonl", tmp_path):  # under a regular file; a directory
        t0 = time.monotonic()
        res = cli("run", WEATHER, "-i", EXAMPLE, "-o", str(out), "--set", "models.policy.delay_s=5")
        assert_user_error(res, f"-o {out}")
        assert "batch" not in res.stdout  # no batch ran (with delay_s=5 it would take 10 s or more)
        assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        (b'{"responses_create_params": {"input": "caf\xe9"}}', ":2: not UTF-8 text (byte 0xe9"),
        (
            b'{"responses_create_params": {"input": "x"}, "deep": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            ":2: nesting too deep",
        ),
        (
            json.dumps({"responses_create_params": {"input": "x"}, "agent_ref": {"name": "ghost"}}).encode(),
            ":2: agent_ref.name 'ghost' is not an agent of this config (weather_agent); pass --agent weather_agent",
        ),
    ],
)
def test_bad_input_rows_name_file_and_line_and_publish_nothing(
    tmp_path: Path, nats_server: EmbeddedServer, line: bytes, fragment: str
) -> None:
    good = json.dumps(weather_rows(1)[0]).encode()
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(good + b"\n" + line + b"\n" + good + b"\n")
    res = cli("publish", WEATHER, "-i", str(inp), "--nats", nats_server.url)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert f"{inp}{fragment}" in res.stderr
    assert _stored_tasks(nats_server.url) == 0  # nothing published

    out = tmp_path / "out.jsonl"
    res = cli("run", WEATHER, "-i", str(inp), "-o", str(out))
    assert res.returncode == 2 and f"{inp}{fragment}" in res.stderr and not out.exists()


def _stored_tasks(url: str) -> int:
    async def count() -> int:
        from gym_runtime.observability.tracing import Telemetry
        from gym_runtime.transport.bus import Bus
        from gym_runtime.transport.jetstream import message_count
        from gym_runtime.transport.subjects import Subjects

        bus = await Bus.connect(url, namespace="gym", telemetry=Telemetry(), name="test")
        try:
            return await message_count(bus, Subjects("gym").tasks_stream)
        finally:
            await bus.close()

    from gym_runtime.service.loop import run_async

    return run_async(count)


def test_a_missing_optional_package_is_one_line_before_anything_starts(
    tmp_path: Path, nats_server: EmbeddedServer
) -> None:
    # A verifier that imports its package lazily (in a worker process, at the first verify) would score 0 or
    # crash mid-batch without it: `requires` makes run and a worker pool say so before any work. Validating
    # and publishing rows need no verifier (a publisher node may not have its packages).
    (tmp_path / "needy_env.py").write_text(
        "from gym_runtime.resources.weather import Weather\n"
        "class Needy(Weather):\n"
        "    requires = ('gym_runtime_absent_verifier_pkg', 'json')\n"
        '    install = "pip install absent-verifier-pkg"\n'
        "    async def verify(self, task, response):\n"
        "        import gym_runtime_absent_verifier_pkg\n"
        "        return 1.0\n"
    )
    env = {"PYTHONPATH": str(tmp_path)}
    line = (
        "resources.weather.server: 'needy_env' needs gym_runtime_absent_verifier_pkg "
        "(not installed: pip install absent-verifier-pkg)"
    )
    out = tmp_path / "out" / "o.jsonl"
    out.parent.mkdir()
    sets = ["--set", "resources.weather.server=needy_env"]
    assert_user_error(
        cli("run", WEATHER, "-i", EXAMPLE, "-o", str(out), "--nats", nats_server.url, *sets, env=env), line
    )
    assert not list(out.parent.iterdir())
    assert _stored_tasks(nats_server.url) == 0  # nothing published
    assert_user_error(cli("start", WEATHER, "--nats", nats_server.url, "--only", "resources", *sets, env=env), line)
    # a worker node says so before it waits for its server (a service keeps waiting for a dead one)
    dead = f"nats://127.0.0.1:{free_port()}"
    assert_user_error(cli("start", WEATHER, "--nats", dead, "--only", "resources", *sets, env=env, timeout=30), line)
    assert cli("validate", WEATHER, "-i", EXAMPLE, *sets, env=env).returncode == 0


def test_an_internal_bug_is_labelled_with_a_traceback(tmp_path: Path) -> None:
    # A resource whose setup() hits a bug (not a config mistake): the user is told it is a bug.
    mod = tmp_path / "buggy_env.py"
    mod.write_text(
        "from gym_runtime.resource import Resource\n"
        "class Buggy(Resource):\n"
        "    @classmethod\n"
        "    async def setup(cls, options):\n"
        "        return {}['missing']\n"
        "    async def verify(self, task, response):\n"
        "        return 1.0\n"
    )
    res = cli(
        "run",
        WEATHER,
        "-i",
        EXAMPLE,
        "-o",
        str(tmp_path / "o.jsonl"),
        "--set",
        "resources.weather.server=buggy_env",
        "--any-tools",  # Buggy has no get_weather: the rows' tool is refused otherwise, before the bug shows
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert res.returncode == 3, res.stderr
    assert "internal error (this is a bug in gym-runtime" in res.stderr
    assert "Traceback" in res.stderr and "KeyError: 'missing'" in res.stderr


def test_version_and_help_on_every_option() -> None:
    from gym_runtime import __version__
    from gym_runtime.cli import build_parser

    res = cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"gym-runtime {__version__}"
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    missing = [
        f"{name} {a.option_strings or a.dest}"
        for name, p in sub.choices.items()
        for a in p._actions
        if a.help is None and a.dest != "help"
    ]
    assert missing == []


# ------------------------------------------------------------------------------------------- progress


def test_progress_lines_without_a_terminal(tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", weather_rows(5))
    res = cli(
        "run", WEATHER, "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "--repeats", "4", "--progress-every", "25"
    )  # stderr is a pipe: lines, not a bar
    assert res.returncode == 0, res.stderr
    pattern = re.compile(r"^run: (\d+)/20 \((\d+)%\) [\d.]+/s ETA (\d+s|\?), 0 failed, mean reward 1\.0000, elapsed")
    lines = [m for m in map(pattern.match, res.stderr.splitlines()) if m]
    done = [int(m.group(1)) for m in lines]
    assert done[-1] == 20 and done == sorted(done)
    assert 4 <= len(lines) <= 6  # at 25, 50, 75 % (+ the final line), not one per row
    assert "\x1b[" not in res.stderr  # no terminal escapes in a log file

    quiet = cli("run", WEATHER, "-i", str(inp), "-o", str(tmp_path / "q.jsonl"), "--quiet")
    assert quiet.returncode == 0 and not re.search(r"^run: ", quiet.stderr, re.MULTILINE)


def test_publish_and_collect_show_progress(tmp_path: Path, nats_server: EmbeddedServer) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", weather_rows(40))
    res = cli("publish", WEATHER, "-i", str(inp), "--nats", nats_server.url, "--progress-every", "50")
    assert res.returncode == 0, res.stderr
    assert re.search(r"^publish: 40/40 \(100%\) [\d.]+/s", res.stderr, re.MULTILINE), res.stderr


def test_reverify_shows_progress(tmp_path: Path) -> None:
    d = REPO / "tests/compat/nemo_gym/example_multi_step"
    if not d.is_dir():
        raise FileNotFoundError(f"compat data not found at {d} (it ships in tests/compat)")
    res = cli(
        "reverify",
        "resources/multi_step/config.yaml",
        "-i",
        str(d / "example_rollouts.jsonl"),
        "--tasks",
        str(d / "example.jsonl"),
        "-o",
        str(tmp_path / "o.jsonl"),
    )
    assert res.returncode == 0, res.stderr
    assert re.search(
        r"^reverify: 5/5 \(100%\) [\d.]+/s ETA 0s, 0 failed, mean reward [\d.]+", res.stderr, re.MULTILINE
    ), res.stderr


def test_progress_line_figures() -> None:
    import io

    from gym_runtime.observability.progress import ProgressOptions, Tracker

    now = [0.0]
    buf = io.StringIO()
    with Tracker("run", ProgressOptions(every_pct=50, interval_s=1000), stream=buf, clock=lambda: now[0]) as t:
        for i in range(4):
            now[0] += 1.0
            t.result(i != 1, 1.0 if i else 0.0)
            t(i + 1, 4)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "run: 2/4 (50%) 1.0/s ETA 2s, 1 failed, mean reward 0.0000, elapsed 2s"
    assert lines[-1] == "run: 4/4 (100%) 1.0/s ETA 0s, 1 failed, mean reward 0.6667, elapsed 4s"


# ------------------------------------------------------------------------------------------- metrics


def scrape(*ports: int) -> dict[str, float]:
    """``/metrics`` of every port as {``name{labels}``: value} (labels sorted as the exporter writes them)."""
    out = {}
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = out.get(key, 0.0) + float(value)
    return out


def free_ports(n: int) -> int:
    """A base port P with P .. P+n-1 free on 127.0.0.1 (a worker pool serves metrics there)."""
    import socket

    for _ in range(50):
        base = free_port()
        try:
            with contextlib.ExitStack() as stack:
                for p in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def wait_until_serving(ports: range, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            scrape(*ports)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def total(metrics: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in metrics.items() if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


@pytest.mark.slow
def test_metrics_scraped_during_a_batch_add_up_to_the_rows_written(tmp_path: Path, nats_server: EmbeddedServer) -> None:
    rows = weather_rows(12)
    for r in rows[:3]:
        r["explode"] = True  # tests.envs.flaky's verifier raises on these: failure rows
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    base = free_ports(3)
    ports = range(base, base + 3)  # the weather config starts a pool: model, resource, agent on P, P+1, P+2
    sets = [
        "--set",
        "resources.weather.server=tests.envs.flaky",
        "--set",
        "agents.weather_agent.max_attempts=1",
        "--set",
        "models.policy.delay_s=0.4",
        "--set",
        "agents.weather_agent.concurrency=4",
    ]
    workers = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "start",
            WEATHER,
            "--nats",
            nats_server.url,
            *sets,
            "--metrics-port",
            str(base),
            "--metrics-host",
            "127.0.0.1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert workers.stdout is not None and "ready" in workers.stdout.readline()
        wait_until_serving(ports)
        # the same config as the workers (tasks carry its fingerprint; another config's would be refused)
        published = cli("publish", WEATHER, "-i", str(inp), "--nats", nats_server.url, "--batch", "m1", "-q", *sets)
        assert published.returncode == 0, published.stderr
        out = tmp_path / "out.jsonl"
        collector = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gym_runtime.cli",
                "collect",
                "--batch",
                "m1",
                "--nats",
                nats_server.url,
                "-o",
                str(out),
                "-q",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        during = None
        deadline = time.monotonic() + 60
        while collector.poll() is None and time.monotonic() < deadline:
            m = scrape(*ports)
            if total(m, "gym_inflight", gym_role="agent") > 0:
                during = m
                break
            time.sleep(0.1)
        assert during is not None, "no rollout was ever seen in flight"
        assert total(during, "gym_slots", gym_role="agent", gym_name="weather_agent") == 4
        assert total(during, "gym_rollouts_completed_total") + total(during, "gym_rollouts_failed_total") < 12

        status = cli("status", "--nats", nats_server.url, "--batch", "m1")
        assert status.returncode == 0, status.stderr
        assert re.match(r"batch m1: \d+/12 done \(\d+%\), \d+ failed, \d+ pending, rate ", status.stdout)

        collector.wait(120)
        assert collector.returncode == 1  # failure rows
        written = read_jsonl(out)
        failures = read_jsonl(tmp_path / "out_failures.jsonl")
        assert len(written) == 9 and len(failures) == 3

        after = scrape(*ports)
        assert total(after, "gym_rollouts_completed_total", gym_agent="weather_agent") == len(written)
        assert total(after, "gym_rollouts_failed_total", error_type="verify_error") == len(failures)
        assert total(after, "gym_reward_count", gym_agent="weather_agent") == len(written)
        assert total(after, "gym_reward_sum") == sum(r["reward"] for r in written)
        for stage in ("queue_wait", "model_call", "tool_call", "verify"):
            assert total(after, "gym_stage_duration_seconds_count", gym_stage=stage) >= 12, stage
        assert total(after, "gym_stage_duration_seconds_count", gym_stage="rollout") == 12
        assert total(after, "gym_stage_duration_seconds_sum", gym_stage="model_call") >= 0.4 * 12
        assert total(after, "gym_model_tokens_total", gen_ai_token_type="input") > 0
        assert total(after, "gym_model_tokens_total", gen_ai_token_type="output") > 0
        assert any(k.startswith("gym_queue_pending{") and "weather_agent" in k for k in after), list(after)
        services = {re.search(r'service_name="([^"]+)"', k).group(1) for k in after if k.startswith("target_info")}
        assert services == {"gym-runtime.model", "gym-runtime.resource", "gym-runtime.agent"}

        done = cli("status", "--nats", nats_server.url, "--batch", "m1", "--json")
        snap = json.loads(done.stdout)
        assert (snap["done"], snap["failed"], snap["pending"]) == (12, 3, 0)
        # (--watch runs until interrupted, a finished batch too: tests/e2e/test_new_user_edges.py)
        watched = cli("status", "--nats", nats_server.url, "--batch", "m1")
        assert watched.returncode == 0
        # the last progress line (the cost lines under it, since the ledger, aside)
        progress = [line for line in watched.stdout.splitlines() if line.startswith("batch m1: ")]
        assert progress[-1].startswith("batch m1: 12/12 done (100%), 3 failed, 0 pending")
    finally:
        workers.send_signal(signal.SIGTERM)
        workers.wait(60)


def test_metrics_port_in_use_is_a_user_error_and_the_default_address_is_loopback(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = cli(
            "run",
            WEATHER,
            "-i",
            EXAMPLE,
            "-o",
            str(tmp_path / "o.jsonl"),
            "--metrics-port",
            str(port),
        )
    # loopback unless asked (--metrics-host), like `server`: the default address is the one it names
    assert_user_error(res, f"--metrics-port {port}: 127.0.0.1:{port} is already in use")
    assert "give a free port, e.g. --metrics-port " in res.stderr, res.stderr  # issue 75: and which to give


# ------------------------------------------------------------------------------------------- spans, logs


def test_model_spans_carry_genai_attributes_and_services_are_named_per_role(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    res = cli(
        "run",
        WEATHER,
        "-i",
        EXAMPLE,
        "-o",
        str(tmp_path / "o.jsonl"),
        "--trace-file",
        str(spans),
        "-q",
        "--set",
        "models.policy.model=tiny-policy",
    )
    assert res.returncode == 0, res.stderr
    found = read_jsonl(spans)
    model_spans = [s for s in found if s["attributes"].get("gen_ai.operation.name") == "chat"]
    assert len(model_spans) == 10  # 5 rollouts x 2 model calls
    for s in model_spans:
        a = s["attributes"]
        assert a["gen_ai.request.model"] == "tiny-policy" and a["gen_ai.provider.name"] == "scripted"
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
        assert a["gen_ai.response.id"]
    assert {s["service"] for s in found} == {"gym-runtime.run"}


def test_logs_at_info_and_debug(tmp_path: Path) -> None:
    res = cli("run", WEATHER, "-i", EXAMPLE, "-o", str(tmp_path / "o.jsonl"), "--log-level", "info", "-q")
    events = [json.loads(x) for x in res.stderr.splitlines() if x.startswith("{")]
    names = [e["event"] for e in events]
    for expected in (
        "model.ready",
        "resource.ready",
        "agent.ready",
        "batch.start",
        "batch.end",
        "agent.stopped",
        "model.stopped",
        "resource.stopped",
    ):
        assert expected in names, expected
    assert "rollout.done" not in names  # per-rollout lines only at debug
    end = next(e for e in events if e["event"] == "batch.end")
    assert end["rows"] == 5 and end["failed"] == 0

    res = cli("run", WEATHER, "-i", EXAMPLE, "-o", str(tmp_path / "o.jsonl"), "--log-level", "debug", "-q")
    done = [json.loads(x) for x in res.stderr.splitlines() if x.startswith("{") and "rollout.done" in x]
    assert sorted(e["task_index"] for e in done) == [0, 1, 2, 3, 4]
    for e in done:
        assert e["rollout_index"] == 0 and len(e["trace_id"]) == 32 and e["batch"] and e["reward"] == 1.0


# ------------------------------------------------------------------------------------------- config


MODELS_PAGE = REPO / "docs" / "models.md"  # where the README's "Point the same config at a real model" moved


def readme_real_model_command() -> list[str]:
    """The first command under "Point the same config at a real model" in docs/models.md, as argv."""
    text = MODELS_PAGE.read_text()
    section = text.split("## Point the same config at a real model", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    command = " ".join(
        line.rstrip("\\").strip() for line in block.splitlines() if line.strip() and not line.startswith("export")
    )
    return shlex.split(command, comments=True)


def test_readme_real_model_example_sends_the_variable_as_the_bearer_token(tmp_path: Path) -> None:
    argv = readme_real_model_command()
    assert argv[0] == "gym-runtime" and "'models.policy.api_key=${POLICY_API_KEY}'" in MODELS_PAGE.read_text()
    argv = [a if a != "out.jsonl" else str(tmp_path / "out.jsonl") for a in argv[1:]]
    secret = "sk-test-from-the-environment"
    with StubOpenAI(handler=lambda req: StubReply()) as stub:  # /v1/responses: a plain text answer
        res = cli(*argv, env={"POLICY_API_KEY": secret, "OPENAI_BASE_URL": stub.base_url, "OPENAI_API_KEY": ""})
        auth = {r.headers.get("authorization") for r in stub.requests}
    assert res.returncode == 0, res.stderr
    assert auth == {f"Bearer {secret}"}  # not the text "${POLICY_API_KEY}"
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 5
    assert secret not in res.stderr and secret not in res.stdout


def test_set_is_applied_before_variable_substitution_and_plus_adds_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gym_runtime.config import load_config, resolve_config

    monkeypatch.setenv("JUDGE_KEY", "sk-judge")
    cfg = resolve_config(
        load_config(
            REPO / WEATHER,
            [
                "models.policy.model=${POLICY_MODEL:-gpt-4.1}",
                "+models.judge.adapter=openai",
                "+models.judge.api_key=${JUDGE_KEY}",
            ],
        )
    )
    assert cfg.models["policy"].options.model == "gpt-4.1"
    assert cfg.models["judge"].options.api_key == "sk-judge" and cfg.models["judge"].adapter == "openai"
    with pytest.raises(
        ConfigError, match=r"no key models\.judge; valid keys here: policy \(use \+KEY\.PATH=VALUE to add a new entry\)"
    ):
        load_config(REPO / WEATHER, ["models.judge.adapter=openai"])
    with pytest.raises(ConfigError, match=r"did you mean namespace\?"):
        load_config(REPO / WEATHER, ["namespac=x"])


def test_several_configs_merge_in_order(tmp_path: Path) -> None:
    from gym_runtime.config import load_config, merge_raw

    assert merge_raw([{"a": {"b": 1, "c": [1]}, "d": 1}, {"a": {"c": [2]}, "e": 2}]) == {
        "a": {"b": 1, "c": [2]},
        "d": 1,
        "e": 2,
    }
    extra = tmp_path / "counter.yaml"
    extra.write_text(
        "resources:\n  counter: {server: resources.counter}\n"
        "agents:\n  counter_agent: {agent: agents.simple, model: policy, resource: counter, max_steps: 8}\n"
        "  weather_agent: {max_steps: 3}\n"
    )
    cfg = load_config([REPO / WEATHER, extra])
    assert sorted(cfg.agents) == ["counter_agent", "weather_agent"]
    assert cfg.agents["weather_agent"].max_steps == 3 and cfg.agents["weather_agent"].resource == "weather"
    assert cfg.base_dir == str((REPO / WEATHER).parent)

    res = cli(
        "run", WEATHER, str(extra), "-i", EXAMPLE, "-o", str(tmp_path / "o.jsonl"), "--agent", "weather_agent", "-q"
    )
    assert res.returncode == 0, res.stderr
    assert len(read_jsonl(tmp_path / "o.jsonl")) == 5
