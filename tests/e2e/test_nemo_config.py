"""NeMo Gym configs of bundled environments run unchanged (end to end with the replay / scripted model)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gym_runtime.config import load_config, redact, resolve_config
from gym_runtime.errors import ConfigError
from tests.helpers import COMPAT, REPO, prompt_key, read_jsonl

CONFIGS = COMPAT / "configs"
# NeMo Gym resources server → our bundled environment directory
BUNDLED = {
    "mcqa": "mcqa",
    "math_with_judge": "math",
    "workplace_assistant": "workplace_assistant",
    "example_single_tool_call": "weather",
}


def nemo_config(server: str) -> Path:
    return CONFIGS / "resources_servers" / server / "configs" / f"{server}.yaml"


def run(config: Path, data: Path, out: Path, *sets: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    args = [
        sys.executable,
        "-m",
        "gym_runtime.cli",
        "run",
        str(config),
        "-i",
        str(data),
        "-o",
        str(out),
        "--no-progress",
    ]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(
        args,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )


def rewards_by_prompt(path: Path) -> dict[tuple, float]:
    return {prompt_key(r["responses_create_params"]["input"]): r["reward"] for r in read_jsonl(path)}


@pytest.mark.parametrize("server", BUNDLED)
def test_nemo_gym_config_maps_onto_the_bundled_environment(server: str) -> None:
    cfg = load_config(nemo_config(server), ["+models.policy_model.adapter=scripted"])
    (agent_name,) = cfg.agents
    assert agent_name == f"{server}_simple_agent"  # NeMo Gym's instance names: rows' agent_ref keep working
    agent = cfg.agents[agent_name]
    assert (agent.agent, agent.model, agent.resource) == ("agents.simple", "policy_model", server)
    assert cfg.resources[server].server == f"resources.{BUNDLED[server]}"
    if server == "math_with_judge":
        assert cfg.resources[server].options == {
            "judge_model": "policy_model",
            "should_use_judge": False,
            "judge_responses_create_params": {"input": []},
        }
    if server == "workplace_assistant":
        assert agent.max_steps == 6


@pytest.mark.parametrize("server", BUNDLED)
def test_nemo_gym_config_runs_end_to_end_like_the_bundled_config(server: str, tmp_path: Path) -> None:
    """The NeMo Gym file and our own config give the same rewards for the same model outputs."""
    data = COMPAT / server / "example.jsonl"
    recorded = COMPAT / server / "example_rollouts.jsonl"
    # workplace_assistant's recorded rollouts are of other tasks than its example rows: use the scripted model.
    replay = server != "workplace_assistant"
    nemo_sets = [f"+models.policy_model.adapter={'replay' if replay else 'scripted'}"]
    ours_sets = [f"models.policy.adapter={'replay' if replay else 'scripted'}"]
    if replay:
        nemo_sets.append(f"+models.policy_model.rollouts={recorded}")
        ours_sets.append(f"models.policy.rollouts={recorded}")
    if server == "math_with_judge":
        # one example row (x_2016, powers of 2 + sqrt 3) takes math-verify ~4 s of CPU on an idle core, so under
        # the suite's load its 10 s default timeout scored it 0.0 in one run of a pair: time is not what this
        # compares, so both runs get the same generous limits
        limits = {"library_verifier_timeout_seconds": 120, "math_verify_timeout_seconds": 60}
        nemo_sets += [f"+resources.math_with_judge.options.{k}={v}" for k, v in limits.items()]
        ours_sets += [f"+resources.math.options.{k}={v}" for k, v in limits.items()]
    r = run(nemo_config(server), data, tmp_path / "nemo.jsonl", *nemo_sets)
    assert r.returncode == 0, r.stderr
    r = run(REPO / "resources" / BUNDLED[server] / "config.yaml", data, tmp_path / "ours.jsonl", *ours_sets)
    assert r.returncode == 0, r.stderr
    nemo, ours = rewards_by_prompt(tmp_path / "nemo.jsonl"), rewards_by_prompt(tmp_path / "ours.jsonl")
    assert len(nemo) == 5 and nemo == ours
    rows = read_jsonl(tmp_path / "nemo.jsonl")
    assert {row["agent_ref"]["name"] for row in rows} == {f"{server}_simple_agent"}
    if server == "example_single_tool_call":  # recorded without a judge: NeMo Gym's own rewards
        assert nemo == rewards_by_prompt(recorded)
    if server == "mcqa":  # NeMo Gym's grader reads `\\boxed{\nC: text\n}` since the recording (one 0 became 1)
        old = rewards_by_prompt(recorded)
        assert [p for p in old if old[p] != nemo[p]] == [p for p in old if old[p] == 0.0 and nemo[p] == 1.0]
        assert sum(nemo.values()) == sum(old.values()) + 1


def test_training_config_with_config_paths_env_yaml_and_inherit_from(tmp_path: Path) -> None:
    """A multi-environment NeMo Gym training config, run from NeMo Gym's root as `ng_run` would be."""
    root = tmp_path / "gym"
    for sub in ("resources_servers", "responses_api_models"):
        shutil.copytree(CONFIGS / sub, root / sub)
    (root / "env.yaml").write_text(
        "policy_base_url: http://127.0.0.1:9/v1\npolicy_api_key: sk-secret-123\npolicy_model_name: tiny\n"
    )
    (root / "weather_variant.yaml").write_text("weather_again:\n  _inherit_from: example_single_tool_call\n")
    (root / "train.yaml").write_text(
        "config_paths:\n"
        "  - resources_servers/mcqa/configs/mcqa.yaml\n"
        "  - resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml\n"
        "  - responses_api_models/openai_model/configs/openai_model.yaml\n"
        "  - weather_variant.yaml\n"
        "mcqa_simple_agent:\n  _inherit_from: base_agent.yaml\n"
    )
    (root / "base_agent.yaml").write_text("responses_api_agents:\n  simple_agent:\n    max_steps: 3\n")
    cwd = Path.cwd()
    os.chdir(root)
    try:
        cfg = resolve_config(load_config(root / "train.yaml"))
    finally:
        os.chdir(cwd)
    assert set(cfg.agents) == {"mcqa_simple_agent", "example_single_tool_call_simple_agent"}
    assert set(cfg.resources) == {"mcqa", "example_single_tool_call", "weather_again"}
    assert cfg.resources["weather_again"].server == "resources.weather"
    assert cfg.agents["mcqa_simple_agent"].max_steps == 3 and cfg.agents["mcqa_simple_agent"].resource == "mcqa"
    policy = cfg.models["policy_model"]
    assert (policy.adapter, policy.options.base_url, policy.options.model) == (
        "openai",
        "http://127.0.0.1:9/v1",
        "tiny",
    )
    assert policy.options.api_key == "sk-secret-123"
    assert "sk-secret-123" not in json.dumps(redact(cfg.config))
    # End to end: rows of two environments routed by their NeMo Gym agent_ref, the policy swapped for the
    # scripted model.
    rows = []
    for server in ("mcqa", "example_single_tool_call"):
        for row in read_jsonl(COMPAT / server / "example.jsonl")[:2]:
            rows.append({**row, "agent_ref": {"type": "responses_api_agents", "name": f"{server}_simple_agent"}})
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The same environments with the scripted test double as the policy model (no OpenAI endpoint here).
    (root / "train_offline.yaml").write_text(
        "config_paths:\n"
        "  - resources_servers/mcqa/configs/mcqa.yaml\n"
        "  - resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml\n"
    )
    r = run(
        root / "train_offline.yaml", data, tmp_path / "out.jsonl", "+models.policy_model.adapter=scripted", cwd=root
    )
    assert r.returncode == 0, r.stderr
    got = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(row["agent_ref"]["name"] for row in got) == sorted(row["agent_ref"]["name"] for row in rows)
    assert "sk-secret-123" not in r.stdout + r.stderr


@pytest.mark.parametrize(
    ("path", "text"),
    [
        (
            CONFIGS / "responses_api_agents/mini_swe_agent/configs/mini_swe_agent.yaml",
            "NeMo Gym agent 'mini_swe_agent' has no gym-runtime equivalent; supported: simple_agent",
        ),
    ],
)
def test_unknown_nemo_gym_servers_are_one_clear_error(path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match=text):
        load_config(path)
    r = subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", "validate", str(path), "-i", "x.jsonl"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 2 and text in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_resources_server_without_a_port_is_hosted() -> None:
    """A catalogue server we did not port is hosted (its own code in our workers), its settings kept as written;
    a ported one stays native."""
    cfg = load_config(
        CONFIGS / "resources_servers/google_search/configs/google_search.yaml",
        ["+models.policy_model.adapter=scripted"],
    )
    (res,) = cfg.resources.values()
    assert res.nemo_gym == "google_search" and res.server == ""
    assert "entrypoint" not in res.options and "domain" not in res.options
    cfg = load_config(nemo_config("mcqa"), ["+models.policy_model.adapter=scripted"])
    assert cfg.resources["mcqa"].server == "resources.mcqa" and not cfg.resources["mcqa"].hosted


def test_missing_config_path_and_bad_inherit_are_errors(tmp_path: Path) -> None:
    bad = tmp_path / "train.yaml"
    bad.write_text("config_paths: [nowhere/x.yaml]\n")
    with pytest.raises(ConfigError, match="config_paths: nowhere/x.yaml not found"):
        load_config(bad)
    bad.write_text(f"config_paths: [{nemo_config('mcqa')}]\nother:\n  _inherit_from: no.such.path\n")
    with pytest.raises(ConfigError, match="_inherit_from: 'no.such.path' is not a path of the config"):
        load_config(bad)


def test_start_publish_collect_take_a_nemo_gym_config(nats_server, tmp_path: Path) -> None:
    """The distributed commands read the same NeMo Gym file (worker pools re-load it in each process)."""
    import signal

    config = nemo_config("example_single_tool_call")
    sets = ["--set", "+models.policy_model.adapter=scripted"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pool = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "start",
            str(config),
            "--nats",
            nats_server.url,
            "--replicas",
            "1",
            *sets,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        data = COMPAT / "example_single_tool_call" / "example.jsonl"
        pub = subprocess.run(
            [
                sys.executable,
                "-m",
                "gym_runtime.cli",
                "publish",
                str(config),
                "-i",
                str(data),
                "--nats",
                nats_server.url,
                *sets,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
            env=env,
        )
        assert pub.returncode == 0, pub.stderr
        batch = pub.stdout.strip()
        out = tmp_path / "out.jsonl"
        col = subprocess.run(
            [
                sys.executable,
                "-m",
                "gym_runtime.cli",
                "collect",
                "--batch",
                batch,
                "--nats",
                nats_server.url,
                "-o",
                str(out),
                "--no-progress",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            timeout=180,
            env=env,
        )
        assert col.returncode == 0, col.stderr
        rows = read_jsonl(out)
        assert len(rows) == 5 and {r["agent_ref"]["name"] for r in rows} == {"example_single_tool_call_simple_agent"}
        assert all(r["reward"] == 1.0 for r in rows)
    finally:
        pool.send_signal(signal.SIGTERM)
        try:
            pool.wait(60)
        except subprocess.TimeoutExpired:
            pool.kill()


def test_validate_needs_no_model_server_for_a_nemo_gym_config() -> None:
    """validate/prepare never call a model: NeMo Gym's separate policy model file is not needed for them."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "validate",
            str(nemo_config("mcqa")),
            "-i",
            str(COMPAT / "mcqa" / "example.jsonl"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "5 rows OK (mcqa_simple_agent: 5)"
    # run does call it: there the missing model is still an error
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gym_runtime.cli",
            "run",
            str(nemo_config("mcqa")),
            "-i",
            str(COMPAT / "mcqa" / "example.jsonl"),
            "-o",
            "/dev/null",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert r.returncode == 2 and "no model named 'policy_model'" in r.stderr


@pytest.mark.parametrize(
    ("model_file", "adapter", "token_ids"),
    [
        ("openai_model/configs/openai_model.yaml", "openai", None),
        ("vllm_model/configs/vllm_model.yaml", "vllm", False),
        ("vllm_model/configs/vllm_model_for_training.yaml", "vllm", True),
    ],
)
def test_nemo_gym_model_servers_map_onto_our_adapters(
    tmp_path: Path, model_file: str, adapter: str, token_ids: bool | None
) -> None:
    (tmp_path / "train.yaml").write_text(
        f"config_paths: [{nemo_config('mcqa')}, {CONFIGS / 'responses_api_models' / model_file}]\n"
        "policy_base_url: http://127.0.0.1:9/v1\npolicy_api_key: sk-abc-SECRET\npolicy_model_name: tiny\n"
    )
    cfg = resolve_config(load_config(tmp_path / "train.yaml"))
    m = cfg.models["policy_model"]
    assert (m.adapter, m.options.base_url, m.options.model, m.options.api_key) == (
        adapter,
        "http://127.0.0.1:9/v1",
        "tiny",
        "sk-abc-SECRET",
    )
    if token_ids is not None:
        assert m.options.return_token_ids is token_ids
    assert "sk-abc-SECRET" not in json.dumps(redact(cfg.config))
