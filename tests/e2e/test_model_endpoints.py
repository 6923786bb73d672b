"""A dead or wrong model endpoint is found once, before anything is published, not row by row.

Each model worker asks its adapter at start whether the endpoint serves the model (``GET {base_url}/models``:
connection refused, credentials refused, the model not listed); `run` reads its own workers' verdicts and
`publish` reads remote workers' through discovery: one line naming the URL, exit 2, nothing published.
During a batch an endpoint that fails is logged once per interval, and ``--quiet`` prints nothing but
the summary and the exit line. The LLM is ``tests/stub_openai.py`` (a test double; the real one is any OpenAI-compatible
server, vLLM's included, which lists its models the same way).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_runtime.cli.run import MULTI_PROCESS_MIN_ROLLOUTS
from gym_runtime.ops.nats_server import free_port
from tests.helpers import REPO, WEATHER, cli
from tests.stub_openai import StubOpenAI, StubReply, error_body

ROWS = WEATHER.parent / "data/example.jsonl"


def config(tmp: Path, base_url: str, model: str = "tiny", **extra: object) -> Path:
    policy = {"adapter": "openai", "api": "chat", "base_url": base_url, "model": model, "timeout_s": 5, **extra}
    cfg = {
        "namespace": "gym",
        "nats": "embedded",
        "models": {"policy": policy},
        "resources": {"weather": {"server": "resources.weather"}},
        "agents": {
            "weather_agent": {"agent": "agents.simple", "model": "policy", "resource": "weather", "max_steps": 4}
        },
    }
    path = tmp / "config.yaml"
    path.write_text(json.dumps(cfg))  # YAML is a superset of JSON
    return path


def run(cfg: Path, tmp: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return cli("run", str(cfg), "-i", str(ROWS), "-o", str(tmp / "out.jsonl"), *flags)


def stderr_lines(res: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.strip()]


def test_a_dead_base_url_is_one_line_and_exit_2_before_any_rollout(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    t0 = time.monotonic()
    res = run(config(tmp_path, url), tmp_path, "--quiet")
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr
    lines = stderr_lines(res)
    assert len(lines) == 1, res.stderr
    assert url in lines[0] and "cannot connect" in lines[0] and "Nothing was published" in lines[0]
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()
    assert took < 30, f"{took:.1f} s: found row by row?"


def test_a_model_the_server_does_not_serve_is_named_with_what_it_serves(tmp_path: Path) -> None:
    with StubOpenAI() as stub:  # the vLLM emulator serves "tiny"
        res = run(config(tmp_path, stub.base_url, model="tiny-typo"), tmp_path, "--quiet")
        posts = [q for q in stub.requests if q.method == "POST"]
    assert res.returncode == 2, res.stderr
    assert "does not serve model 'tiny-typo' (it serves: tiny)" in res.stderr
    assert posts == []  # not one generation was attempted


def many_rows(tmp: Path, n: int) -> Path:
    """``n`` rows (the example's, again): enough that ``--processes auto`` starts worker processes."""
    rows = ROWS.read_text().splitlines()
    path = tmp / "many.jsonl"
    path.write_text("\n".join(rows[i % len(rows)] for i in range(n)) + "\n")
    return path


def test_a_dead_base_url_is_refused_when_the_workers_run_in_processes(tmp_path: Path) -> None:
    """2,000 rows: ``auto`` starts a worker process per core (2 on CI); their model workers' verdict is read."""
    url = f"http://127.0.0.1:{free_port()}/v1"
    out = tmp_path / "out.jsonl"
    res = cli("run", str(config(tmp_path, url)), "-i", str(many_rows(tmp_path, MULTI_PROCESS_MIN_ROLLOUTS)),
              "-o", str(out), "--processes", "auto", "--quiet", timeout=300)  # fmt: skip
    assert res.returncode == 2, res.stderr
    [line] = stderr_lines(res)
    assert url in line and "cannot connect" in line and "Nothing was published" in line, line
    assert not out.exists() or not out.read_text()


def test_a_model_the_server_does_not_serve_is_refused_with_worker_processes(tmp_path: Path) -> None:
    with StubOpenAI() as stub:  # the vLLM emulator serves "tiny"
        res = run(config(tmp_path, stub.base_url, model="tiny-typo"), tmp_path, "--processes", "2", "--quiet")
        posts = [q for q in stub.requests if q.method == "POST"]
    assert res.returncode == 2, res.stderr
    [line] = stderr_lines(res)
    assert "does not serve model 'tiny-typo' (it serves: tiny)" in line and "Nothing was published" in line, line
    assert posts == []  # not one generation was attempted


def test_refused_credentials_are_named(tmp_path: Path) -> None:
    with StubOpenAI() as stub:
        stub.emulator.handle = lambda *a: (401, error_body(401, "invalid api key"))  # type: ignore[method-assign]
        res = run(config(tmp_path, stub.base_url, api_key="sk-wrong-key-123"), tmp_path, "--quiet")
    assert res.returncode == 2, res.stderr
    assert "refused the credentials (HTTP 401" in res.stderr
    assert "sk-wrong-key-123" not in res.stderr


@pytest.fixture
def dead_model_worker(nats_server, tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    cfg = config(tmp_path, f"http://127.0.0.1:{free_port()}/v1")
    p = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(cfg), "--nats", nats_server.url, "--in-process"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        assert "ready" in p.stdout.readline(), "the workers did not start"
        yield cfg, p
    finally:
        p.terminate()
        p.wait(30)


def test_publish_reads_a_remote_model_workers_verdict(nats_server, dead_model_worker) -> None:
    """The base_url may resolve only on the model's node: its worker checked it, publish asks it."""
    cfg, worker = dead_model_worker
    res = cli("publish", str(cfg), "-i", str(ROWS), "--nats", nats_server.url, "--batch", "never")
    assert res.returncode == 2, res.stderr
    assert "model 'policy' (worker " in res.stderr and "cannot connect to http://127.0.0.1:" in res.stderr
    assert "Traceback" not in res.stderr
    worker.terminate()
    _, err = worker.communicate(timeout=30)
    assert err.count("model.endpoint_unusable") == 1, err  # the service said why once


def test_an_endpoint_failing_during_a_batch_is_logged_once_and_quiet_is_quiet(tmp_path: Path) -> None:
    """It lists the model, then fails every generation: 5 failure rows, the cause said once, not per row (and the
    run stopped once its one endpoint is out of service: ``test_endpoint_outages``)."""
    down = StubReply(status=503, body=error_body(503, "Service Unavailable"))
    with StubOpenAI(handler=lambda req: down) as stub:
        stub.emulator.model = "tiny"
        cfg = config(tmp_path, stub.base_url, max_retries=2, retry_backoff_s=0.01)
        loud = run(cfg, tmp_path)
        quiet = run(cfg, tmp_path, "--quiet")
    assert loud.returncode == 1 and quiet.returncode == 1, loud.stderr
    assert "5 failed" in loud.stdout
    events = [json.loads(line).get("event") for line in stderr_lines(loud) if line.startswith("{")]
    assert events.count("model.retry") <= 1 and events.count("rollout.failed") <= 1, events
    # its one endpoint out of service after out_after (5) failed calls: the run stops, in one line naming it
    [line] = stderr_lines(quiet)
    assert line.startswith("gym-runtime: error: model 'policy': every endpoint is out of service ("), line
    assert stub.base_url.rstrip("/") in line and "HTTP 503" in line, line
