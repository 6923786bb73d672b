"""Issue 75, "What a new user meets now" (points 3-9): each mistake tried as the user makes it, through the CLI in a
subprocess where the user meets it there: one line naming what to do, exit 2, no traceback, never "a bug in
gym-runtime". The Ray points (1, 2) are in ``tests/on_ray/test_ray_addresses.py``; the trainer points (9, 10) in
``tests/test_trainer_arguments.py`` and ``tests/trainers/test_trl_slips.py``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, WEATHER, cli

EXAMPLE = REPO / "resources/weather/data/example.jsonl"
RUN = REPO / "tests" / "data" / "train_run"


def one_line(res: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """The user's mistake said in one line (JSON log lines aside), exit 2, no traceback; that line."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr
    said = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert len(said) == 1, res.stderr
    for f in fragments:
        assert f in said[0], (f, said[0])
    return said[0]


# ------------------------------------------------------------------ 4. the user's own module is the user's bug

BROKEN = {
    "syntax": ("def broken(:\n", "SyntaxError: invalid syntax"),
    "indentation": ("if True:\nx = 1\n", "IndentationError: expected an indented block"),
    "import": ("import nosuch_package_of_theirs\n", "install 'nosuch_package_of_theirs', or fix that import"),
    "raises": ("LIMIT = 1 / 0\n", "ZeroDivisionError: division by zero"),
}


def broken_config(tmp_path: Path, role: str, code: str) -> Path:
    """A config beside the user's own module (found relative to the config) whose line 3 is ``code``."""
    if role == "resource":
        module = "from gym_runtime.resources.weather import Weather\n\nresource = Weather\n"
        text = WEATHER.read_text().replace("server: resources.weather", "server: my_env")
        name = "my_env"
    else:
        module = "from gym_runtime.agents.simple import run\n\n__all__ = ['run']\n"
        text = WEATHER.read_text().replace("agent: agents.simple", "agent: my_agent")
        name = "my_agent"
    lines = module.splitlines(keepends=True)
    (tmp_path / f"{name}.py").write_text("".join(lines[:2]) + code + "".join(lines[2:]))
    (tmp_path / "config.yaml").write_text(text)
    return tmp_path / "config.yaml"


@pytest.mark.parametrize("role", ["resource", "agent"])
@pytest.mark.parametrize("kind", list(BROKEN))
def test_an_error_in_the_users_own_module_is_one_line_naming_its_file_line_and_entry(
    role: str, kind: str, tmp_path: Path
) -> None:
    code, words = BROKEN[kind]
    config = broken_config(tmp_path, role, code)
    res = cli("run", str(config), "-i", str(EXAMPLE), "-o", str(tmp_path / "o.jsonl"), timeout=120)
    name = "my_env" if role == "resource" else "my_agent"
    entry = "resources.weather.server" if role == "resource" else "agents.weather_agent.agent"
    line = one_line(res, entry, words)
    assert f"{tmp_path / name}.py:" in line and ("fix the code there" in line or "fix that import" in line), line
    assert "pip install 'gym-runtime[envs]'" not in line  # the user's module is not one of the bundled ones
    assert not (tmp_path / "o.jsonl").exists()


# ------------------------------------------------------------------ 8. a negative checkpoint TTL is refused


def test_a_negative_checkpoint_ttl_is_refused_at_config_time(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    res = cli("run", "weather", "-o", str(out), "--set", "jetstream.checkpoint_ttl_s=-1")
    one_line(res, "jetstream.checkpoint_ttl_s: -1.0 must be >= 0 seconds", "0 keeps checkpoints until deleted")
    assert not out.exists()
    zero = cli("run", "weather", "-o", str(out), "--set", "jetstream.checkpoint_ttl_s=0", "--quiet")
    assert zero.returncode == 0, zero.stderr  # 0: kept until deleted, as the bucket's TTL of 0 says
    assert len([json.loads(x) for x in out.read_text().splitlines()]) == 5
