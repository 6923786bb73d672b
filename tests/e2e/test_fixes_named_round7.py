"""Issue 75, item 2: the messages a new user met that named only the problem, each now naming its fix too, run as
the user runs them (the CLI as a subprocess, a real nats-server, real files).

Each case holds the words that name its fix; every case must end in one error line and exit 2, with no traceback,
within its timeout. The cases of one table run a few at a time (each its own process and folder): the suite pays
for the slowest, not the sum.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from gym_runtime.ops.nats_server import EmbeddedServer, free_port
from tests.helpers import REPO, WEATHER, as_from_a_terminal, cli, read_until
from tests.stub_openai import StubOpenAI

ROWS = REPO / "resources/weather/data/example.jsonl"
DEAD = f"nats://127.0.0.1:{free_port()}"  # a port nothing listens on
FAST = {"GYM_CONNECT_TIMEOUT_S": "2"}

# (id, argv with {t} for the case's folder, the words that name the fix, extra environment)
Case = tuple[str, list[str], list[str], dict[str, str]]


def one_line_naming(res: subprocess.CompletedProcess[str], fix: list[str], case: str) -> None:
    """A user's mistake: exit 2, one error line (JSON log lines aside), no traceback, the fix's words in it."""
    assert res.returncode == 2, (case, res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, (case, res.stderr)
    said = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert len(said) == 1, (case, res.stderr)
    for words in fix:
        assert words in said[0], (case, words, said[0])


def run_cases(cases: list[Case], folder: Callable[[str], Path], *, cwd: Path | None = None) -> None:
    """Each case in a folder of its own, two at a time; every failure is reported with its case's id."""

    def one(case: Case) -> tuple[Case, subprocess.CompletedProcess[str]]:
        name, argv, _, env = case
        t = folder(name)
        args = [a.replace("{t}", str(t)) for a in argv]
        return case, cli(*args, env={**FAST, **env}, cwd=cwd or t, timeout=90)

    with ThreadPoolExecutor(2) as pool:
        for (name, _, fix, _), res in pool.map(one, cases):
            one_line_naming(res, fix, name)


@pytest.fixture
def folder(tmp_path: Path) -> Callable[[str], Path]:
    def make(name: str) -> Path:
        t = tmp_path / name
        t.mkdir()
        (t / "rows.jsonl").write_text(ROWS.read_text())
        (t / "runs").mkdir()
        (t / "runs" / "a.jsonl").write_text("")
        (t / "empty").mkdir()
        return t

    return make


# ------------------------------------------------------------------------------- what argparse used to say


def test_an_argument_a_command_does_not_take_is_said_with_where_it_goes(folder: Callable[[str], Path]) -> None:
    run_cases(
        [
            (
                "start-namespace",
                ["start", "weather", "--namespace", "exp", "--nats", DEAD],
                ["`namespace: NAME` in the YAML", "--set namespace=NAME"],
                {},
            ),
            (
                "collect-config",
                ["collect", "weather", "--batch", "b1", "-o", "{t}/o.jsonl", "--nats", DEAD],
                ["collect takes no CONFIG", "--nats URL", "--namespace NAME"],
                {},
            ),
            (
                "collect-set",
                ["collect", "--batch", "b1", "-o", "{t}/o.jsonl", "--set", "namespace=exp", "--nats", DEAD],
                ["collect reads no config", "--namespace NAME"],
                {},
            ),
            ("diff-jsn", ["diff", "{t}/runs/a.jsonl", "{t}/runs/a.jsonl", "--jsn"], ["did you mean --json?"], {}),
            ("view-port-words", ["view", "{t}/runs/a.jsonl", "--port", "abc"], ["a port number, 0 to 65535"], {}),
        ],
        folder,
    )


def test_a_folder_given_for_a_file_names_the_files_in_it(folder: Callable[[str], Path]) -> None:
    run_cases(
        [
            ("view-folder", ["view", "{t}/runs"], ["a folder, not a file", "/runs/a.jsonl"], {}),
            ("diff-folder", ["diff", "{t}/runs/a.jsonl", "{t}/runs"], ["a folder, not a file", "/runs/a.jsonl"], {}),
            ("view-empty-folder", ["view", "{t}/empty"], ["give the rollouts JSONL files", "(none in "], {}),
        ],
        folder,
    )


def test_start_only_of_an_unknown_entry_lists_the_entries(folder: Callable[[str], Path]) -> None:
    run_cases(
        [
            (
                "only-unknown",
                ["start", "weather", "--nats", DEAD, "--only", "agents.nosuch"],
                ["(its agents: agents.weather_agent)"],
                {},
            ),
            (
                "only-typo",
                ["start", "weather", "--nats", DEAD, "--only", "agents.weather_agnt"],
                ["did you mean weather_agent?"],
                {},
            ),
            (
                "only-role-typo",
                ["start", "weather", "--nats", DEAD, "--only", "agent.weather_agent"],
                ["did you mean --only agents.weather_agent?"],
                {},
            ),
        ],
        folder,
    )


# ----------------------------------------------------------------------------------- files and modules


def test_a_bundled_configs_errors_name_it_where_it_is_not_inside_the_editable_build(tmp_path: Path) -> None:
    res = cli("run", "weather", "-o", str(tmp_path / "o.jsonl"), "--set", "agents.weather_agent.max_steps=abc")
    one_line_naming(res, ["agents.weather_agent.max_steps"], "bundled-config")
    assert "__editable__" not in res.stderr, res.stderr
    named = res.stderr.removeprefix("gym-runtime: error: ").partition(": ")[0]
    assert (REPO / named).samefile(WEATHER), named  # run from the clone: resources/weather/config.yaml


def test_a_typo_in_the_last_part_of_ones_own_module_path_is_a_did_you_mean(tmp_path: Path) -> None:
    (tmp_path / "my_agents").mkdir()
    (tmp_path / "my_agents" / "__init__.py").write_text("")
    (tmp_path / "my_agents" / "run_code.py").write_text("async def run(ctx):\n    raise NotImplementedError\n")
    cfg = yaml.safe_load(WEATHER.read_text()) | {"base_dir": str(WEATHER.parent)}
    cfg["agents"]["weather_agent"]["agent"] = "my_agents.run_cod"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    res = cli("run", "c.yaml", "-o", "o.jsonl", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    one_line_naming(res, ["no such agent module 'my_agents.run_cod'; did you mean 'my_agents.run_code'?"], "typo")


def test_a_client_of_a_config_that_is_not_there_names_the_bundled_ones(tmp_path: Path) -> None:
    code = "from gym_runtime import Client\nClient('nosuch/config.yaml', workers=False)\n"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert "nosuch/config.yaml: config file not found" in last and "a bundled environment's name (" in last, last
    assert "weather" in last, last


SANDBOXED = """\
models:
  policy: {adapter: scripted}
sandboxes:
  box: {backend: docker, image: base}
agents:
  coder: {agent: agents.simple, model: policy, sandbox: box}
"""


def test_a_missing_container_engine_says_how_to_start_or_name_one(folder: Callable[[str], Path]) -> None:
    def make(name: str) -> Path:
        t = folder(name)
        (t / "c.yaml").write_text(SANDBOXED)
        return t

    fix = ["bash .ci/docker.sh start", "DOCKER_HOST=unix://"]
    run_cases(
        [
            (
                "no-docker-host",
                ["run", "{t}/c.yaml", "-i", "{t}/rows.jsonl", "-o", "{t}/o.jsonl"],
                fix,
                {"DOCKER_HOST": ""},
            ),
            (
                "dead-socket",
                ["run", "{t}/c.yaml", "-i", "{t}/rows.jsonl", "-o", "{t}/o.jsonl"],
                ["does not answer", *fix],
                {"DOCKER_HOST": "unix:///nonexistent/docker.sock"},
            ),
            (
                "parity-no-docker-host",
                ["parity", str(REPO / "tests/harbor_tasks"), "--harbor"],
                fix,
                {"DOCKER_HOST": ""},
            ),
            (
                "parity-no-tasks",
                ["parity", "{t}/empty", "--harbor"],
                ["holds no Harbor task", "task.toml, instruction.md, environment/Dockerfile, tests/test.sh"],
                {},
            ),
        ],
        make,
    )


# --------------------------------------------------------------------------------------- on a real bus


@pytest.fixture
def elsewhere(nats_server: EmbeddedServer, tmp_path: Path) -> str:
    """A bus whose one batch, b1, is in namespace exp (published by the real CLI; no worker takes it)."""
    cfg = yaml.safe_load(WEATHER.read_text()) | {"namespace": "exp", "base_dir": str(WEATHER.parent)}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(cfg))
    res = cli("publish", str(tmp_path / "exp.yaml"), "-i", str(ROWS), "--nats", nats_server.url, "--batch", "b1")
    assert res.returncode == 0, res.stderr
    return nats_server.url


def test_purge_and_view_of_a_batch_not_in_the_namespace_say_where_it_is(
    elsewhere: str, folder: Callable[[str], Path]
) -> None:
    run_cases(
        [
            ("purge-elsewhere", ["purge", "--batch", "b1", "--nats", elsewhere], ["add --namespace exp"], {}),
            (
                "view-elsewhere",
                ["view", "--batch", "b1", "--nats", elsewhere, "--port", "0"],
                ["namespace 'gym' holds no batch", "add --namespace exp"],
                {},
            ),
            (
                "view-unknown",
                ["view", "--batch", "b2", "--nats", elsewhere, "--namespace", "exp", "--port", "0"],
                ["no batch 'b2' in namespace 'exp'", "its batches: b1"],
                {},
            ),
        ],
        folder,
    )


def test_a_listener_on_a_taken_port_names_a_free_one(folder: Callable[[str], Path]) -> None:
    """A second `server`, `gateway`, `view` or `--metrics-port` on a port another process holds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        free = "give a free port, e.g. "
        run_cases(
            [
                ("server", ["server", "--port", port, "--store-dir", "{t}/js"], [free + "--port "], {}),
                ("gateway", ["gateway", "weather", "--port", port], [free + "--port ", "or --port 0"], {}),
                ("view", ["view", "{t}/runs/a.jsonl", "--port", port], [free + "--port ", "or --port 0"], {}),
                (
                    "metrics",
                    ["run", "weather", "-o", "{t}/o.jsonl", "--metrics-port", port],
                    [free + "--metrics-port "],
                    {},
                ),
            ],
            folder,
        )


def test_reverify_of_rows_another_environment_made_names_that_one(tmp_path: Path) -> None:
    made = cli("run", "math", "-o", str(tmp_path / "math.jsonl"), "--quiet")
    assert made.returncode in (0, 1), made.stderr  # (the scripted policy's answers may fail math's checks)
    res = cli("reverify", "weather", "-i", str(tmp_path / "math.jsonl"), "-o", str(tmp_path / "r.jsonl"))
    one_line_naming(
        res,
        ["these rows' provenance.env", "names the bundled environment 'math'", "gym-runtime reverify math -i"],
        "reverify-other-env",
    )
    assert not (tmp_path / "r.jsonl").exists()  # refused before any row was re-graded


def test_a_model_url_that_answers_404_is_refused_at_start_naming_the_api_path(tmp_path: Path) -> None:
    """vLLM's API is under /v1: a base_url without it (or with the route pasted in) answers 404 to every call. The
    start-up check finds the API at /v1 and says so, before anything is published (the vLLM double serves it)."""
    with StubOpenAI() as stub:
        origin = stub.base_url.removesuffix("/v1")
        for case, url in (("no-v1", origin), ("route-pasted", f"{stub.base_url}/chat/completions")):
            res = cli(
                "run",
                "weather",
                "-o",
                str(tmp_path / f"{case}.jsonl"),
                "--set",
                "models.policy.adapter=openai",
                "--set",
                f"models.policy.base_url={url}",
                "--set",
                "models.policy.model=tiny",
            )
            one_line_naming(res, [f"{url} answers 404", f"set base_url: {stub.base_url}"], case)
            assert not (tmp_path / f"{case}.jsonl").exists()


def test_ctrl_c_on_a_per_role_run_is_one_line_saying_what_was_kept(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches its whole foreground process group: the run, its role processes and (before)
    the embedded nats-server, which died first, so that the children logged its loss as JSON ``nats.error`` lines
    before the run's own line. The server is its owner's to stop now; the one line says what was kept, where."""
    out, store = tmp_path / "o.jsonl", tmp_path / "store"
    argv = ["run", "weather", "-o", str(out), "--processes", "per-role", "--repeats", "50", "--store-dir", str(store)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", *argv, "--set", "models.policy.delay_s=1"],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=as_from_a_terminal,
        start_new_session=True,  # its own group, as a terminal's job is
    )
    spool = Path(f"{out}.partial")
    deadline = time.monotonic() + 120
    while not (spool.exists() and spool.stat().st_size > 0):  # rollouts are arriving
        assert proc.poll() is None and time.monotonic() < deadline, "no rollout arrived"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    said = [line for line in err.splitlines() if line.strip() and not line.startswith("run: ")]  # progress aside
    assert len(said) == 1, err  # no nats.error line before it
    assert said[0].startswith("gym-runtime: error: interrupted: "), said
    assert f"kept in the store {store} as batch " in said[0] and "run the same command with --batch " in said[0]


def test_ctrl_c_on_collect_says_the_file_was_not_written_and_the_results_stay(elsewhere: str, tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    argv = ["collect", "--batch", "b1", "--namespace", "exp", "--nats", elsewhere, "-o", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", *argv],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=as_from_a_terminal,
    )
    assert proc.stderr is not None
    seen, said = read_until(proc.stderr, "no worker serves agent", 120)  # it is collecting (and waits: no worker)
    assert seen, said
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("gym-runtime: error: interrupted: no row was read yet;"), last
    assert f"{out} is written whole when every row is in, so it was not written" in last, last
    assert "run the same collect again" in last and not out.exists()
