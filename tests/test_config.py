"""Config loading: YAML → Structs, `${VAR}` interpolation, `--set`, errors that name the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gym_runtime.client import Client
from gym_runtime.config import Config, ResolvedConfig, load_config, redact, resolve_config, resolve_models
from gym_runtime.errors import ClientError, ConfigError
from tests.helpers import REPO, cli

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
    cfg = resolve_config(load_config(write(tmp_path)))
    policy = cfg.models["policy"]
    assert policy.options.api_key == "sk-test-123"
    assert policy.options.base_url == "http://localhost:8000/v1" and policy.options.model == "gpt-4.1"
    assert policy.concurrency == 32  # a whole-value variable becomes a number
    assert cfg.resources["weather"].replicas == 2


def test_env_yaml_beside_the_config_fills_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLICY_API_KEY", raising=False)
    cfg = resolve_config(
        load_config(write(tmp_path, env_yaml="POLICY_API_KEY: from-env-yaml\nPOLICY_MODEL: my-model\n"))
    )
    assert cfg.models["policy"].options.api_key == "from-env-yaml"
    assert cfg.models["policy"].options.model == "my-model"


def test_missing_variable_names_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLICY_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"models\.policy\.api_key: environment variable POLICY_API_KEY is not set"):
        load_config(write(tmp_path))


def test_set_overrides_any_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLICY_API_KEY", "k")
    cfg = resolve_config(
        load_config(
            write(tmp_path),
            ["models.policy.adapter=vllm", "agents.weather_agent.max_steps=3", "models.policy.timeout_s=0.5"],
        )
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
            "(bundled: openai, replay, scripted, transformers, verl_server, vllm, vllm_engine",
        ),
        (("adapter: openai", "adapter: openai\n    rollouts: x.jsonl"), "models.policy.rollouts: unknown key"),
        (("max_steps: 8", "max_steps: 8, sandbox: box"), "agents.weather_agent.sandbox: no sandbox pool named 'box'"),
        (
            ("max_steps: 8}", "max_steps: 8, sandbox: box, ack_wait_s: 60}\nsandboxes: {box: {lease_grace_s: 30}}"),
            "sandboxes.box.lease_grace_s (30) must exceed agents.weather_agent.ack_wait_s (60)",
        ),
        (  # issue 75: a pool the agent's environment leases in must outlive a redelivery too
            ("replicas: 2}", "replicas: 2, sandbox: box}\nsandboxes: {box: {lease_grace_s: 30}}"),
            "sandboxes.box.lease_grace_s (30) must exceed agents.weather_agent.ack_wait_s (",
        ),
        (  # issue 75: an entry ray.roles names that the config has not is said with the ones it has
            ("namespace: gym", "namespace: gym\nray: {roles: {agents.weather_agnt: {num_cpus: 1}}}"),
            "ray.roles: 'agents.weather_agnt' names no entry of the config's agents; did you mean "
            "agents.weather_agent? (its entries: models.policy, resources.weather, agents.weather_agent)",
        ),
        (
            ("namespace: gym", "namespace: gym\nray: {nats: heed}"),
            "ray.nats: Invalid enum value 'heed' (one of: config, head)",
        ),
        (
            ("namespace: gym", "namespace: gym\nsandboxes: {box: {backend: lxc}}"),
            "sandboxes.box.backend: Invalid enum value 'lxc'",
        ),
        (
            ("namespace: gym", "namespace: gym\nsandboxes: {box: {limits: {memory_mb: 0}}}"),
            "sandboxes.box.limits: limits must be positive",
        ),
        (("replicas: 2", "replicas: 2, isolation: thread"), "resources.weather.isolation: Invalid enum value 'thread'"),
        (("replicas: 2", "replicas: 2, call_timeout_s: 0"), "call_timeout_s must be > 0"),
    ],
)
def test_bad_config_names_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: tuple[str, str], message: str
) -> None:
    monkeypatch.setenv("POLICY_API_KEY", "k")
    with pytest.raises(ConfigError) as err:
        resolve_config(load_config(write(tmp_path, BASE.replace(*edit))))
    assert message in str(err.value)
    assert str(tmp_path / "config.yaml") in str(err.value)


@pytest.mark.parametrize("isolation", ["", ", isolation: process", ", isolation: none"])
def test_hosted_servers_take_either_isolation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolation: str) -> None:
    """A hosted NeMo Gym server runs in a guest process unless its entry says ``isolation: none``."""
    monkeypatch.setenv("POLICY_API_KEY", "k")
    text = BASE.replace("server: resources.weather", f"nemo_gym: mcqa{isolation}")
    cfg = resolve_config(load_config(write(tmp_path, text)))
    assert cfg.resources["weather"].isolation == (isolation.split(": ")[1] if isolation else None)


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
    """The adapter's options import and check when resolved even where the heavy extra is absent."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text("models:\n  policy: {adapter: vllm_engine, model: /m, engine_args: {max_model_len: 1024}}\n")
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # any `import vllm` now fails
        "from gym_runtime.config import load_config, resolve_config\n"
        f"m = resolve_config(load_config({str(cfg)!r})).models['policy']\n"
        "print(type(m.options).__module__, m.options.engine_args['max_model_len'],"
        " 'vllm' in sys.modules and sys.modules['vllm'] is not None)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["gym_runtime.models.vllm_engine", "1024", "False"]


# ------------------------------------------------------------------ loading imports no plugin

# Prints the modules a load imported that are plugins (bundled environments, agents, adapters, the
# hosted-server drivers, the user's own package) or their heavy dependencies; then what resolving says.
PURITY = """\
import json, sys
from gym_runtime.config import load_config, redact, resolve_config, resolve_models
before = set(sys.modules)
cfg = load_config(sys.argv[1:])
json.dumps(redact(cfg)), repr(cfg)  # printing an unresolved config imports nothing either
plugins = ("gym_runtime.agents.", "gym_runtime.resources.", "gym_runtime.models.", "gym_runtime.nemo_gym.hosting",
           "boom", "nosuch", "openai", "vllm", "verifiers", "openenv", "math_verify", "datasets")
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith(plugins))))
try:
    resolve_models(cfg)  # what a publisher resolves: the adapters, never an agent or environment
    print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith(plugins[:2]))))
    resolve_config(cfg)
    print("resolved")
except Exception as e:
    print(f"error: {type(e).__name__}: {e}")
"""


def loaded_plugins(*configs: Path, cwd: Path | None = None) -> tuple[list[str], str]:
    env = {**os.environ, "POLICY_API_KEY": "k", "JUDGE_API_KEY": "k", "POLICY_BASE_URL": "http://127.0.0.1:9/v1"}
    res = subprocess.run(
        [sys.executable, "-c", PURITY, *map(str, configs)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    imported, *published, resolved = res.stdout.splitlines()
    assert published in ([], ["[]"])  # publishing imported no agent or environment module either
    return json.loads(imported), resolved


BUNDLED_CONFIGS = sorted(REPO.glob("resources/*/config.yaml")) + [REPO / "deploy" / "config.yaml"]


@pytest.mark.parametrize("config", BUNDLED_CONFIGS, ids=lambda p: p.parent.name)
def test_loading_a_bundled_config_imports_no_plugin(config: Path) -> None:
    imported, _ = loaded_plugins(config)
    assert imported == []


def test_loading_imports_no_plugin_even_a_missing_or_broken_one(tmp_path: Path) -> None:
    """A config naming modules that do not exist or raise on import loads (it is data); resolving it is
    where they are imported: the missing one and the broken one each named in one line."""
    (tmp_path / "boom").mkdir()
    (tmp_path / "boom" / "__init__.py").write_text("raise RuntimeError('a plugin was imported')\n")
    entries = {
        "broken": ("boom.model", "boom.env", "boom.agent"),
        "missing": ("nosuch.adapter", "nosuch.env", "nosuch.agent"),
    }
    for name, (adapter, server, agent) in entries.items():
        (tmp_path / f"{name}.yaml").write_text(
            f"models:\n  policy: {{adapter: {adapter}, api_key: sk-LITERAL-1, token: '${{JUDGE_API_KEY}}'}}\n"
            f"resources:\n  env: {{server: {server}}}\n"
            f"agents:\n  a: {{agent: {agent}, model: policy, resource: env, options: {{user_model: policy}}}}\n"
        )
    imported, resolved = loaded_plugins(tmp_path / "broken.yaml", cwd=tmp_path)
    assert imported == [] and resolved.startswith("error: ConfigError: ")
    # the user's own module raising at import is their error, named by entry, file and line (issue 75 point 4)
    assert "models.policy.adapter" in resolved and "boom/__init__.py:1: RuntimeError: a plugin was imported" in resolved
    imported, resolved = loaded_plugins(tmp_path / "missing.yaml", cwd=tmp_path)
    assert imported == []
    assert resolved.startswith("error: ConfigError: ") and "no such adapter module 'nosuch.adapter'" in resolved


def test_unresolved_options_hide_what_looks_secret_and_what_came_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any adapter says which of its keys are secrets, a key named like one, or one whose value
    came from ${VAR}, is redacted in repr and redact(); once resolved, the adapter decides, as before."""
    monkeypatch.setenv("ODD_SECRET", "sk-from-env-2")
    path = write(tmp_path, BASE.replace("${POLICY_API_KEY}", "sk-literal-1"))
    judge = [
        "+models.judge.adapter=openai",
        "+models.judge.model=${ODD_SECRET}",
        "+models.judge.headers={X-Key: hdr-secret-3}",
        "+models.judge.base_url=http://judge:8000/v1",
    ]
    cfg = load_config(path, judge)
    shown = repr(cfg) + json.dumps(redact(cfg))
    for secret in ("sk-literal-1", "sk-from-env-2", "hdr-secret-3"):
        assert secret not in shown
    assert redact(cfg)["models"]["judge"]["headers"] == {"X-Key": "***"}
    assert redact(cfg)["models"]["judge"]["base_url"] == "http://judge:8000/v1"  # a plain value stays readable
    assert redact(cfg)["models"]["policy"]["model"] == "***"  # ${POLICY_MODEL:-gpt-4.1}: from the environment
    resolved = resolve_config(cfg)
    shown = repr(resolved) + json.dumps(redact(resolved.config))
    assert "sk-literal-1" not in shown and "hdr-secret-3" not in shown
    assert resolved.models["judge"].options.model == "sk-from-env-2"  # resolved: the adapter's own rule


def test_pricing_names_model_entries_and_refuses_negative_prices() -> None:
    """A ``pricing`` key for a model the config lacks, or a negative price: one line, exit 2."""
    weather = str(REPO / "resources/weather/config.yaml")
    for setting, said in (
        ("+pricing.models.nope.input_per_1m=1", "pricing.models.nope: no model named 'nope' under models"),
        ("+pricing.models.policy.output_per_1m=-1", "pricing: models.policy.output_per_1m: -1.0 must be >= 0"),
        ("pricing.cpu_hour=-2", "pricing: cpu_hour: -2.0 must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=said.replace(".", r"\.").replace("(", r"\(")):
            load_config(weather, [setting])
    done = cli("validate", weather, "--set", "pricing.cpu_hour=-2")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert load_config(weather, ["+pricing.models.policy.input_per_1m=3"]).pricing.models["policy"].input_per_1m == 3


# ------------------------------------------------------------------ resolved once, as a value of its own


def test_resolving_returns_a_frozen_value_and_leaves_the_loaded_config_as_it_was() -> None:
    """``resolve_config`` parses the adapters' options, loads the agent modules and computes the fingerprints
    once, into a frozen ``ResolvedConfig``; the loaded ``Config`` is not changed (it used to be, in place)."""
    cfg = load_config(REPO / "resources/weather/config.yaml")
    written = msgspec.to_builtins(cfg)
    resolved = resolve_config(cfg)
    assert msgspec.to_builtins(cfg) == written  # the adapter's options still as written
    assert resolved.models["policy"].options is not cfg.models["policy"].options
    view = resolved.agent("weather_agent")  # what an agent worker takes of it, in one read
    assert view.module.__name__ == "gym_runtime.agents.simple" and view.entry is resolved.agents["weather_agent"]
    assert view.fingerprint == resolved.fingerprints[("agent", "weather_agent")]
    assert set(view.parts) == {"agent", "model.policy", "resource"}
    assert view.model_fingerprints == {"policy": resolved.fingerprints[("model", "policy")]}
    assert set(resolved.fingerprints) == {("model", "policy"), ("resource", "weather"), ("agent", "weather_agent")}
    assert resolved.fields[("model", "policy")]  # what workers announce, per key
    with pytest.raises(AttributeError):
        resolved.fingerprints = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        resolved.fingerprints[("model", "policy")] = "x"  # type: ignore[index]
    # what workers read on every task, set apart once: the sections no holder can change, the namespace
    assert resolved.namespace == cfg.namespace and resolved.jetstream == cfg.jetstream
    assert resolved.reward_bound == cfg.reward_bound
    # every key of the config is set apart but ``ray``, which ``start --ray`` reads of the loaded config
    assert set(Config.__struct_fields__) - set(ResolvedConfig.__struct_fields__) == {"ray"}
    assert resolved.agents["weather_agent"] is resolved.config.agents["weather_agent"]
    # every key read where it is held (``resolved.gateway``), never ``resolved.config.gateway``
    assert (resolved.nats, resolved.gateway, resolved.base_dir, resolved.source) == (
        cfg.nats,
        cfg.gateway,
        cfg.base_dir,
        cfg.source,
    )
    # live workers of another config's entry are named by the keys that differ (``config.fingerprints``)
    theirs = {"role": "model", "name": "policy", "worker": "w1", "fingerprint": "other", "fields": {}}
    assert resolved.mismatches([theirs]) == [
        "model 'policy' (1 worker: w1) differs in " + ", ".join(sorted(resolved.fields[("model", "policy")]))
    ]
    assert resolved.mismatches([{**theirs, "fingerprint": resolved.fingerprints[("model", "policy")]}]) == []
    with pytest.raises(TypeError):
        resolved.agents["another"] = resolved.agents["weather_agent"]  # type: ignore[index]
    with pytest.raises(TypeError):
        del resolved.models["policy"]  # type: ignore[attr-defined]
    # a publisher's resolution: the same fingerprints, no agent module loaded (it starts no agent worker)
    publisher = resolve_models(cfg)
    assert publisher.fingerprints == resolved.fingerprints and publisher.agent_modules == {}
    with pytest.raises(TypeError, match="resolve_config, not resolve_models"):
        publisher.agent("weather_agent")
    cfg.agents["weather_agent"].max_steps = 99  # a later change to the loaded config: not the resolved one's
    assert resolved.agents["weather_agent"].max_steps != 99


def test_client_takes_a_resolved_config_or_a_path_never_a_loaded_one() -> None:
    cfg = load_config(REPO / "resources/weather/config.yaml")
    with pytest.raises(ClientError, match="not a Config"):
        Client(cfg)  # type: ignore[arg-type]
    with pytest.raises(ClientError, match="need resolve_config"):
        Client(resolve_models(cfg))  # workers in this process need the agent modules
    assert Client(resolve_models(cfg), workers=False).config.fingerprints == resolve_config(cfg).fingerprints
