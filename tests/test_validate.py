"""``gym-runtime validate``: rows checked against the environment each routes to."""

from __future__ import annotations

import copy
import glob
from pathlib import Path

import pytest

from gym_runtime.config import load_config
from gym_runtime.data.validation import validate_files
from tests.helpers import REPO, cli, read_jsonl, write_jsonl

BUNDLED = sorted(Path(p).parent.parent for p in glob.glob(str(REPO / "resources" / "*" / "data" / "example.jsonl")))


@pytest.mark.parametrize("env", BUNDLED, ids=lambda p: p.name)
def test_every_bundled_example_is_valid_for_its_environment(env: Path) -> None:
    cfg = load_config(env / "config.yaml")
    report = validate_files(cfg, sorted((env / "data").glob("example*.jsonl")))  # not google_search's corpus
    assert report.problems == []
    assert report.rows >= 1 and sum(report.agents.values()) == report.rows


def test_every_bundled_environment_declares_its_task_fields() -> None:
    from gym_runtime.plugins import import_plugin
    from gym_runtime.resource import find_resource_class

    for env in BUNDLED:
        cls = find_resource_class(import_plugin(f"resources.{env.name}"))
        assert cls.task_fields is not None, env.name


def test_bundled_requires_name_packages_of_the_extra_they_tell_users_to_install() -> None:
    """Each optional package a bundled environment ``requires`` comes from a distribution of the extra its
    ``install`` line names (extras that name ``gym-runtime[other]`` included), and no core dependency is
    declared optional; math, instruction_following and structured_outputs verify in worker processes or
    lazily, where a missing package would otherwise score 0 instead of saying so."""
    import re
    import tomllib
    from importlib.metadata import packages_distributions

    from gym_runtime.plugins import import_plugin
    from gym_runtime.resource import find_resource_class

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}

    def dists(extra: str) -> set[str]:
        found = names(extras[extra])
        for r in extras[extra]:
            if m := re.match(r"gym-runtime\[(\w+)\]", r):
                found |= dists(m.group(1))
        return found

    core = names(project["dependencies"])
    provided = {mod: {d.lower().replace("_", "-") for d in ds} for mod, ds in packages_distributions().items()}
    declared = {}
    for env in BUNDLED:
        cls = find_resource_class(import_plugin(f"resources.{env.name}"))
        if not cls.requires:
            continue
        m = re.fullmatch(r"pip install 'gym-runtime\[(\w+)\]'", cls.install)
        assert m, (env.name, cls.install)
        for mod in cls.requires:
            assert provided.get(mod, set()) & dists(m.group(1)), (env.name, mod, m.group(1))
            assert not provided.get(mod, set()) & core, (env.name, mod, "is a core dependency")
        declared[env.name] = cls.requires
    assert {"math", "instruction_following", "structured_outputs", "reasoning_gym", "google_search"} <= set(declared)


def test_all_problems_listed_with_file_and_line(tmp_path: Path) -> None:
    rows = read_jsonl(REPO / "resources/counter/data/example.jsonl")
    rows[0]["initial_count"] = "3"
    del rows[1]["expected_count"]
    rows[2]["agent_ref"] = {"type": "responses_api_agents", "name": "nope"}
    rows[3]["responses_create_params"]["tools"].append({"type": "function", "name": "rm_rf", "parameters": {}})
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows, "{not json", {"initial_count": 1, "expected_count": 2}])
    r = cli("validate", "resources/counter/config.yaml", "-i", str(bad))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[0] == f"{bad}:1: counter: task field 'initial_count': expected int, got str"
    assert lines[1] == f"{bad}:2: counter: missing task field 'expected_count'"
    assert lines[2].startswith(f"{bad}:3: agent_ref.name 'nope' is not an agent of this config")
    assert lines[3].startswith(f"{bad}:4: counter: tool 'rm_rf' is not a tool of this environment")
    assert lines[4].startswith(f"{bad}:6: not valid JSON")
    assert lines[5] == f"{bad}:7: missing required field 'responses_create_params'"
    assert lines[-1] == "gym-runtime: error: 6 problems in 7 rows"
    assert "Traceback" not in r.stderr


def test_an_agent_ref_of_another_config_is_reported_and_agent_overrides_it(tmp_path: Path) -> None:
    rows = [
        {**row, "agent_ref": {"type": "responses_api_agents", "name": "someone_elses_agent"}}
        for row in read_jsonl(REPO / "resources/weather/data/example.jsonl")
    ]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    r = cli("validate", "resources/weather/config.yaml", "-i", str(data))
    assert r.returncode == 2
    assert "agent_ref.name 'someone_elses_agent' is not an agent of this config (weather_agent)" in r.stderr
    assert cli("validate", "resources/weather/config.yaml", "-i", str(data), "--agent", "weather_agent").returncode == 0


def test_valid_file_passes_and_counts_per_agent() -> None:
    r = cli("validate", "resources/mcqa/config.yaml", "-i", "resources/mcqa/data/example.jsonl")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "5 rows OK (mcqa_agent: 5)"


def test_semantic_task_checks_of_the_environment(tmp_path: Path) -> None:
    """Beyond types: the environment's own check (mcqa's grading_mode, code_gen's unit tests)."""
    mcqa = read_jsonl(REPO / "resources/mcqa/data/example.jsonl")[0]
    mcqa["grading_mode"] = "vibes"
    p = write_jsonl(tmp_path / "m.jsonl", [mcqa])
    report = validate_files(load_config(REPO / "resources/mcqa/config.yaml"), [p])
    assert len(report.problems) == 1 and "grading_mode must be one of" in report.problems[0]
    code = copy.deepcopy(read_jsonl(REPO / "resources/code_gen/data/example.jsonl")[0])
    del code["verifier_metadata"]["unit_tests"]
    p = write_jsonl(tmp_path / "c.jsonl", [code])
    report = validate_files(load_config(REPO / "resources/code_gen/config.yaml"), [p])
    assert report.problems == [f"{p}:1: code_gen: verifier_metadata.unit_tests is missing"]


def test_rows_without_agent_ref_need_an_agent_when_the_config_has_several(tmp_path: Path) -> None:
    cfg_path = tmp_path / "two.yaml"
    cfg_path.write_text(
        "models: {policy: {adapter: scripted}}\n"
        "resources: {counter: {server: resources.counter}, weather: {server: resources.weather}}\n"
        "agents:\n"
        "  counter_agent: {agent: agents.simple, model: policy, resource: counter}\n"
        "  weather_agent: {agent: agents.simple, model: policy, resource: weather}\n"
    )
    weather = str(REPO / "resources/weather/data/example.jsonl")
    r = cli("validate", str(cfg_path), "-i", weather)
    assert r.returncode == 2 and "pass --agent" in r.stderr
    r = cli("validate", str(cfg_path), "-i", weather, "--agent", "weather_agent")
    assert r.returncode == 0 and "weather_agent: 5" in r.stdout
    # The same weather rows routed to the counter lack its fields and offer a tool it does not have.
    r = cli("validate", str(cfg_path), "-i", weather, "--agent", "counter_agent")
    assert r.returncode == 2
    assert "counter: missing task field" in r.stderr and "tool 'get_weather' is not a tool" in r.stderr


def test_parquet_rows_are_validated_by_index(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the `data` extra is not installed")
    rows = read_jsonl(REPO / "resources/counter/data/example.jsonl")
    rows[3]["expected_count"] = -1.5
    datasets.Dataset.from_list([{**r, "expected_count": float(r["expected_count"])} for r in rows]).to_parquet(
        str(tmp_path / "rows.parquet")
    )
    r = cli("validate", "resources/counter/config.yaml", "-i", str(tmp_path / "rows.parquet"))
    assert r.returncode == 2  # an Arrow column is one type: every row's count became a float
    lines = r.stderr.strip().splitlines()
    assert lines[:5] == [
        f"{tmp_path / 'rows.parquet'}[{i}]: counter: task field 'expected_count': expected int, got float"
        for i in range(5)
    ]
    assert lines[-1] == "gym-runtime: error: 5 problems in 5 rows"
