"""Issue 67, item 18: every command with the mistakes a user makes, run as the user runs it (the CLI as a subprocess),
each message checked for what to do: the flag, key, file, command or value to give, not only what is wrong.

The mistakes are the walk's kinds: a missing or misspelled file, a file of the wrong kind, a bad flag value, a dead
bus, a dead model URL, an output over its input. Each case holds the words that name its fix; every case must also
end in one error line and exit 2 (``health``: its own exit 1, unhealthy), with no traceback, within its timeout (no
hang), and must not be taken as right (no rows written where a mistake was refused).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from gym_runtime.ops.nats_server import free_port
from tests.helpers import REPO, WEATHER, cli

ROWS = REPO / "resources/weather/data/example.jsonl"
DEAD = f"nats://127.0.0.1:{free_port()}"  # a port nothing listens on
FAST = {"GYM_CONNECT_TIMEOUT_S": "2"}  # a dead bus said after 2 s, not 10

# (id, argv with {t} for the test's folder, the words that name the fix, exit code)
CASES: list[tuple[str, list[str], list[str], int]] = [
    (
        "run-missing-config",
        ["run", "{t}/nosuch/config.yaml", "-i", "{t}/rows.jsonl", "-o", "{t}/o.jsonl"],
        ["give a config YAML's path, or a bundled environment's name (", "weather"],
        2,
    ),
    ("run-misspelled-bundled", ["run", "wether", "-o", "{t}/o.jsonl"], ["did you mean 'weather'?"], 2),
    (
        "run-missing-input",
        ["run", "weather", "-i", "{t}/missing.jsonl", "-o", "{t}/o.jsonl"],
        ["give -i the path of a JSONL file of task rows"],
        2,
    ),
    (
        "run-output-over-input",
        ["run", "weather", "-i", "{t}/rows.jsonl", "-o", "{t}/rows.jsonl"],
        ["give another -o, e.g. -o"],
        2,
    ),
    ("run-repeats-0", ["run", "weather", "-o", "{t}/o.jsonl", "--repeats", "0"], ["--repeats: must be at least 1"], 2),
    (
        "run-processes-abc",
        ["run", "weather", "-o", "{t}/o.jsonl", "--processes", "abc"],
        ["expected auto, one, per-role or a number"],
        2,
    ),
    (
        "run-rows-as-config",
        ["run", "{t}/rows.jsonl", "-i", "{t}/rows.jsonl", "-o", "{t}/o.jsonl"],
        ["a JSONL file of task rows goes after -i"],
        2,
    ),
    (
        "run-config-as-rows",
        ["run", "weather", "-i", "{t}/config.yaml", "-o", "{t}/o.jsonl"],
        ["-i takes task rows", "CONFIG argument"],
        2,
    ),
    ("run-bad-json-line", ["run", "weather", "-i", "{t}/junk.jsonl", "-o", "{t}/o.jsonl"], ["junk.jsonl:1:"], 2),
    ("run-dead-bus", ["run", "weather", "-o", "{t}/o.jsonl", "--nats", DEAD], ["`gym-runtime server`", "--nats"], 2),
    (
        "run-dead-model",
        ["run", "{t}/dead_model.yaml", "-i", "{t}/rows.jsonl", "-o", "{t}/o.jsonl"],
        ["check models.policy.base_url"],
        2,
    ),
    (
        "run-set-typo",
        ["run", "weather", "-o", "{t}/o.jsonl", "--set", "models.polcy.delay_s=1"],
        ["did you mean models.policy?"],
        2,
    ),
    ("run-budget-words", ["run", "weather", "-o", "{t}/o.jsonl", "--budget", "lots"], ["(200000tokens)"], 2),
    ("run-unknown-agent", ["run", "weather", "-o", "{t}/o.jsonl", "--agent", "nosuch"], ["(weather_agent)"], 2),
    (
        "run-trace-file-in-a-file",
        ["run", "weather", "-o", "{t}/o.jsonl", "--trace-file", "{t}/rows.jsonl/x"],
        ["give a path outside it"],
        2,
    ),
    ("publish-dead-bus", ["publish", "weather", "-i", "{t}/rows.jsonl", "--nats", DEAD], ["`gym-runtime server`"], 2),
    ("publish-missing-input", ["publish", "weather", "-i", "{t}/missing.jsonl", "--nats", DEAD], ["give -i"], 2),
    ("collect-no-bus", ["collect", "--batch", "b1", "-o", "{t}/o.jsonl"], ["--nats URL", "`gym-runtime server`"], 2),
    ("collect-dead-bus", ["collect", "--batch", "b1", "-o", "{t}/o.jsonl", "--nats", DEAD], ["give --nats"], 2),
    ("status-dead-bus", ["status", "--nats", DEAD], ["`gym-runtime server`"], 2),
    ("status-monitoring-url", ["status", "--nats", "http://127.0.0.1:8222"], ["expected nats://HOST:4222"], 2),
    ("explain-dead-bus", ["explain", "b1", "0", "--nats", DEAD], ["`gym-runtime server`"], 2),
    ("purge-dead-bus", ["purge", "--batch", "b1", "--nats", DEAD], ["`gym-runtime server`"], 2),
    ("health-dead-bus", ["health", "--nats", DEAD], ["`gym-runtime server`"], 1),
    ("health-bad-role", ["health", "--nats", DEAD, "--role", "agent.x"], ["e.g. --role agents"], 2),
    ("validate-missing-input", ["validate", "weather", "-i", "{t}/missing.jsonl"], ["give -i the path"], 2),
    (
        "validate-missing-config",
        ["validate", "{t}/nosuch.yaml", "-i", "{t}/rows.jsonl"],
        ["give a config YAML's path"],
        2,
    ),
    (
        "prepare-rows-as-config",
        ["prepare", "{t}/missing.jsonl", "-o", "{t}/prep"],
        ["a JSONL file of task rows goes after -i"],
        2,
    ),
    ("view-missing-file", ["view", "{t}/missing.jsonl"], ["give a rollouts JSONL"], 2),
    ("diff-missing-file", ["diff", "{t}/missing.jsonl", "{t}/rows.jsonl"], ["give a rollouts JSONL"], 2),
    ("export-output-over-input", ["export", "{t}/rows.jsonl", "-o", "{t}/rows.jsonl"], ["give another -o"], 2),
    (
        "reverify-missing-input",
        ["reverify", "weather", "-i", "{t}/missing.jsonl", "-o", "{t}/r.jsonl"],
        ["the rollouts JSONL that `run` or `collect` wrote"],
        2,
    ),
    (
        "reverify-task-rows",
        ["reverify", "weather", "-i", "{t}/rows.jsonl", "-o", "{t}/r.jsonl"],
        ["-i takes the rollouts `run` or `collect` wrote"],
        2,
    ),
    (
        "reverify-output-over-input",
        ["reverify", "weather", "-i", "{t}/rows.jsonl", "-o", "{t}/rows.jsonl"],
        ["give another -o"],
        2,
    ),
    ("start-missing-config", ["start", "{t}/nosuch/config.yaml"], ["a bundled environment's name ("], 2),
    ("start-no-bus", ["start", "weather", "--only", "agents.weather_agent"], ["--nats URL"], 2),
    ("start-unknown-entry", ["start", "weather", "--nats", DEAD, "--only", "agents.nosuch"], ["--only"], 2),
    ("gateway-port-out-of-range", ["gateway", "weather", "--port", "70000"], ["give one in 0..65535"], 2),
    ("server-port-words", ["server", "--port", "abc"], ["expected a port number"], 2),
    ("init-not-an-identifier", ["init", "{t}/My-Env"], ["(e.g. my_env)"], 2),
]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    t = tmp_path  # each mistake in a folder of its own: one that wrote over its input spoils no other case
    (t / "rows.jsonl").write_text(ROWS.read_text())
    (t / "config.yaml").write_text(WEATHER.read_text())
    (t / "junk.jsonl").write_text("not json\n")
    cfg = yaml.safe_load(WEATHER.read_text()) | {"base_dir": str(WEATHER.parent)}
    cfg["models"]["policy"] = {"adapter": "openai", "base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "m"}
    (t / "dead_model.yaml").write_text(yaml.safe_dump(cfg))
    return t


@pytest.mark.parametrize(("argv", "fix", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_naming_its_fix(folder: Path, argv: list[str], fix: list[str], code: int) -> None:
    args = [a.replace("{t}", str(folder)) for a in argv]
    rows_before = (folder / "rows.jsonl").read_text()
    try:
        res = cli(*args, env=FAST, cwd=folder, timeout=90)
    except subprocess.TimeoutExpired:  # a hang
        pytest.fail(f"no answer within 90 s: {args}")
    assert res.returncode == code, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr
    said = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("{")]
    errors = [line for line in said if "error:" in line]
    assert len(errors) == 1, res.stderr  # one line (a problem list under it, as validate and reverify give)
    for words in fix:
        assert words in res.stderr, (words, res.stderr)
    assert (folder / "rows.jsonl").read_text() == rows_before  # a refused command wrote nothing over its input
    assert not (folder / "o.jsonl").exists()  # nor rows of a run that should not have run
    assert not any(json.loads(line).get("level") == "error" for line in res.stderr.splitlines() if line[:1] == "{")
