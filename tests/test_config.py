"""Config loading: YAML → Structs, `${VAR}` interpolation, `--set`, errors that name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gym_runtime.config import load_config, redact
from gym_runtime.errors import ConfigError
from tests.helpers import cli

BASE = """\
namespace: gym
models:
  policy:
    adapter: openai
    base_url: ${POLICY_BASE_URL:-http://localhost:8000/v1}
    api_key: ${POLICY_API_KEY}
    model: ${POLICY_MODEL:-gpt-4.1}
    concurrency: ${POLICY_CONCURRENCY:-16}
resources:
  weather: {server: resources.weather, replicas: 2}
agents:
  weather_agent: {agent: agents.simple, model: policy, resource: weather, max_steps: 8}
"""


def write(tmp: Path, text: str = BASE, env_yaml: str | None = None) -> Path:
    p = tmp / "config.yaml"
    p.write_text(text)
    if env_yaml is not None:
        (tmp / "env.yaml").write_text(env_yaml)
    return p


def test_variables_from_environment_and_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLICY_API_KEY", "sk-test-123")
    monkeypatch.setenv("POLICY_CONCURRENCY", "32")
    cfg = load_config(write(tmp_path))
    policy = cfg.models["policy"]
    assert policy.options.api_key == "sk-test-123"
    assert policy.options.base_url == "http://localhost:8000/v1" and policy.options.model == "gpt-4.1"
    assert policy.concurrency == 32  # a whole-value variable becomes a number
    assert cfg.resources["weather"].replicas == 2


def test_env_yaml_beside_the_config_fills_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLICY_API_KEY", raising=False)
    cfg = load_config(write(tmp_path, env_yaml="POLICY_API_KEY: from-env-yaml\nPOLICY_MODEL: my-model\n"))
    assert cfg.models["policy"].options.api_key == "from-env-yaml"
    assert cfg.models["policy"].options.model == "my-model"


def test_missing_variable_names_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLICY_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"models\.policy\.api_key: environment variable POLICY_API_KEY is not set"):
        load_config(write(tmp_path))


def test_set_overrides_any_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLICY_API_KEY", "k")
    cfg = load_config(
        write(tmp_path),
        ["models.policy.adapter=vllm", "agents.weather_agent.max_steps=3", "models.policy.timeout_s=0.5"],
    )
    assert cfg.models["policy"].adapter == "vllm"
    assert cfg.agents["weather_agent"].max_steps == 3
    assert cfg.models["policy"].options.timeout_s == 0.5


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("max_steps: 8", "max_steps: 8, max_stepz: 2"), "agents.weather_agent.max_stepz: unknown key"),
        (("replicas: 2", "replicas: two"), "resources.weather.replicas: Expected `int`"),
        (("namespace: gym", "namespace: gym\nnats_url: x"), "nats_url: unknown key"),
        (("model: policy,", "model: polcy,"), "agents.weather_agent.model: no model named 'polcy'"),
        (("namespace: gym", "namespace: a.b"), "namespace: 'a.b' may only hold"),
        # a models entry is flat: the adapter's own Options validate the keys that are not the worker's
        (("adapter: openai", "adapter: openai\n    base_urll: x"), "models.policy.base_urll: unknown key"),
        (
            ("adapter: openai", "adapter: openai\n    api: completions"),
            "models.policy.api: Invalid enum value 'completions'",
        ),
        (("adapter: openai", "adapter: scripted"), "models.policy.base_url: unknown key"),
        (
            ("adapter: openai", "adapter: nope"),
            "models.policy.adapter: no such adapter module 'nope' "
            "(bundled: openai, replay, scripted, vllm, vllm_engine",
        ),
        (("adapter: openai", "adapter: openai\n    rollouts: x.jsonl"), "models.policy.rollouts: unknown key"),
    ],
)
def test_bad_config_names_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: tuple[str, str], message: str
) -> None:
    monkeypatch.setenv("POLICY_API_KEY", "k")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, BASE.replace(*edit)))
    assert message in str(err.value)
    assert str(tmp_path / "config.yaml") in str(err.value)


def test_secrets_never_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLICY_API_KEY", "sk-very-secret")
    cfg = load_config(write(tmp_path))
    assert "sk-very-secret" not in repr(cfg)
    assert redact(cfg)["models"]["policy"]["api_key"] == "***"


def test_cli_reports_config_errors_with_exit_code_2(tmp_path: Path) -> None:
    cfg = write(tmp_path, BASE.replace("max_steps: 8", "max_steps: 8, bogus: 1").replace("${POLICY_API_KEY}", "x"))
    res = cli("run", str(cfg), "-i", "resources/weather/data/example.jsonl", "-o", str(tmp_path / "o.jsonl"))
    assert res.returncode == 2
    assert "agents.weather_agent.bogus: unknown key" in res.stderr


def test_vllm_engine_options_validate_without_vllm_installed(tmp_path: Path) -> None:
    """The adapter's options import and check at load time even where the heavy extra is absent."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text("models:\n  policy: {adapter: vllm_engine, model: /m, engine_args: {max_model_len: 1024}}\n")
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # any `import vllm` now fails
        "from gym_runtime.config import load_config\n"
        f"m = load_config({str(cfg)!r}).models['policy']\n"
        "print(type(m.options).__module__, m.options.engine_args['max_model_len'],"
        " 'vllm' in sys.modules and sys.modules['vllm'] is not None)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["gym_runtime.models.vllm_engine", "1024", "False"]
