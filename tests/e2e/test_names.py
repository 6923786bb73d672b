"""Entry names and pool names are one rule (issue 33, "Names"): ``[A-Za-z0-9][A-Za-z0-9_-]*``.

A name is a token of every subject that names it (``{ns}.task.{agent}.{batch}``, ``{ns}.res.{name}.seed``,
a pool's ``{role}.{name}.creds``), and a leading ``_`` is the runtime's (``{ns}.result._lost``). Before,
an agent named ``_lost`` stored every result where collectors read only failures, and ``a.b``, ``*``,
``>`` or ``x y`` ended in a traceback (exit 3); ``--pool agents._lost`` was issued credentials.
Each mistake is now one line naming the key, exit 2, before anything is started or published.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gym_runtime.config import load_config
from gym_runtime.errors import ConfigError, UserError
from gym_runtime.ops.security import parse_pool
from tests.e2e.test_new_user_edges import assert_one_line
from tests.helpers import REPO, cli

WEATHER = (REPO / "resources/weather/config.yaml").read_text()
EXAMPLE = str(REPO / "resources/weather/data/example.jsonl")
BAD = ["a.b", "_lost", "*", ">", "x y", "-x", "é", ""]
# how each section's entry is renamed (the references to it follow)
RENAME = {
    "agents": [("weather_agent:", "{q}:")],
    "resources": [("  weather:", "  {q}:"), ("resource: weather", "resource: {q}")],
    "models": [("  policy:", "  {q}:"), ("model: policy", "model: {q}")],
}


def config_naming(tmp: Path, section: str, name: str) -> Path:
    text = WEATHER
    quoted = '"' + name + '"'
    for old, new in RENAME[section]:
        text = text.replace(old, new.format(q=quoted))
    p = tmp / "config.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("section", list(RENAME))
@pytest.mark.parametrize("name", BAD)
def test_a_bad_entry_name_is_a_config_error_naming_the_key(tmp_path: Path, section: str, name: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(config_naming(tmp_path, section, name))
    text = str(err.value)
    assert f"{section}: {name!r}" in text and "letters, digits, _ and -" in text
    assert str(tmp_path / "config.yaml") in text and "\n" not in text


@pytest.mark.parametrize("name", ["weather_agent", "Agent-2", "0x", "a_b-c"])
def test_good_names_load(tmp_path: Path, name: str) -> None:
    assert list(load_config(config_naming(tmp_path, "agents", name)).agents) == [name]


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (["validate", "{cfg}", "-i", EXAMPLE], "_lost"),
        (["run", "{cfg}", "-i", EXAMPLE, "-o", "{tmp}/out.jsonl"], "a.b"),
        (["start", "{cfg}", "--nats", "nats://127.0.0.1:9"], ">"),
        (["publish", "{cfg}", "-i", EXAMPLE, "--nats", "nats://127.0.0.1:9"], "x y"),
    ],
)
def test_every_command_says_so_in_one_line_exit_2(tmp_path: Path, command: list[str], name: str) -> None:
    cfg = config_naming(tmp_path, "agents", name)
    res = cli(*(a.format(cfg=cfg, tmp=tmp_path) for a in command), timeout=60)
    assert_one_line(res, f"agents: {name!r}", "letters, digits, _ and -")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("spec", ["agents._lost", "agents.a.b", "agents.*", "agents.>", "resources.x y", "models.é"])
def test_a_bad_pool_name_is_refused(spec: str) -> None:
    with pytest.raises(UserError, match="letters, digits, _ and -"):
        parse_pool(spec)


def test_server_issues_no_credential_for_a_bad_pool_name(tmp_path: Path) -> None:
    auth = tmp_path / "auth"
    res = cli(
        "server", "--secure", str(auth), "--pool", "agents._lost", "--store-dir", str(tmp_path / "js"), timeout=60
    )
    assert_one_line(res, "--pool 'agents._lost'", "letters, digits, _ and -")
    assert not auth.exists() or not list(auth.glob("*.creds"))
