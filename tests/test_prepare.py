"""``gym-runtime prepare``: local Parquet/JSON files through ``datasets`` (the hub's code path) and JSONL."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gym_runtime.data.prepare import blend_counts
from gym_runtime.data.sources import PrepareError, parse_source
from tests.helpers import COMPAT, REPO, cli, read_jsonl, write_jsonl

datasets = pytest.importorskip("datasets", reason="the `data` extra is not installed (pip install -e '.[data]')")

CONFIG = """\
models: {policy: {adapter: scripted}}
resources: {counter: {server: resources.counter}, weather: {server: resources.weather}}
agents:
  counter_agent: {agent: agents.simple, model: policy, resource: counter}
  weather_agent: {agent: agents.simple, model: policy, resource: weather}
"""


def counter_rows(n: int) -> list[dict]:
    base = read_jsonl(REPO / "resources/counter/data/example.jsonl")[0]
    return [{**base, "initial_count": i, "expected_count": i + 15} for i in range(n)]


def weather_rows(n: int) -> list[dict]:
    base = read_jsonl(REPO / "resources/weather/data/example.jsonl")[0]
    rows = []
    for i in range(n):
        params = json.loads(json.dumps(base["responses_create_params"]))
        params["input"][-1]["content"] = f"weather in city {i}?"
        rows.append({"responses_create_params": params})
    return rows


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, Path]:
    """Two environments' rows: counter as a JSON array file, weather as Parquet, both via `datasets`."""
    cfg = tmp_path / "two.yaml"
    cfg.write_text(CONFIG)
    counter = tmp_path / "counter.json"
    counter.write_text(json.dumps(counter_rows(40) + counter_rows(5)))  # 5 exact duplicates
    weather = tmp_path / "weather.parquet"
    datasets.Dataset.from_list(weather_rows(20)).to_parquet(str(weather))
    return {"config": cfg, "counter": counter, "weather": weather}


def prepare(src: dict[str, Path], out: Path, *extra: str):
    return cli(
        "prepare",
        str(src["config"]),
        "-i",
        f"counter_agent={src['counter']}",
        "-i",
        f"weather_agent={src['weather']}",
        "-o",
        str(out),
        *extra,
    )


def test_counts_split_tags_and_metadata(sources: dict[str, Path], tmp_path: Path) -> None:
    r = prepare(sources, tmp_path / "out", "--val-fraction", "0.25", "--seed", "7")
    assert r.returncode == 0, r.stderr
    train, val = read_jsonl(tmp_path / "out/train.jsonl"), read_jsonl(tmp_path / "out/validation.jsonl")
    meta = json.loads((tmp_path / "out/metadata.json").read_text())
    assert (len(train), len(val)) == (45, 15)  # counter 40 (+5 dups dropped) → 30/10, weather 20 → 15/5
    assert meta["agents"]["counter_agent"] == {
        "rows": 45,
        "duplicates_dropped": 5,
        "train": 30,
        "train_available": 30,
        "validation": 10,
    }
    assert meta["agents"]["weather_agent"]["train"] == 15 and meta["agents"]["weather_agent"]["validation"] == 5
    assert meta["seed"] == 7 and [s["kind"] for s in meta["sources"]] == ["json", "parquet"]
    assert all(s["revision"].startswith("sha256:") for s in meta["sources"])
    names = [row["agent_ref"]["name"] for row in train]
    assert names.count("counter_agent") == 30 and names.count("weather_agent") == 15
    assert names[:15] != sorted(names[:15])  # interleaved, not one environment after the other
    assert all(row["agent_ref"]["type"] == "responses_api_agents" for row in train + val)
    # No row in both splits; rows came back through Arrow exactly as written (no null-filled keys).
    keys = {json.dumps(r, sort_keys=True) for r in train}
    assert not keys & {json.dumps(r, sort_keys=True) for r in val}
    assert all(
        set(r) == {"responses_create_params", "agent_ref"} for r in train if r["agent_ref"]["name"] == "weather_agent"
    )
    # The output validates and runs as it is.
    assert cli("validate", str(sources["config"]), "-i", str(tmp_path / "out/train.jsonl")).returncode == 0


def test_same_seed_same_files_other_seed_other_order(sources: dict[str, Path], tmp_path: Path) -> None:
    for out, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert prepare(sources, tmp_path / out, "--val-fraction", "0.1", "--seed", seed).returncode == 0
    a, b, c = ((tmp_path / o / "train.jsonl").read_bytes() for o in "abc")
    assert a == b
    assert (tmp_path / "a/validation.jsonl").read_bytes() == (tmp_path / "b/validation.jsonl").read_bytes()
    assert a != c


def test_blend_by_weights_downsamples_to_the_mix(sources: dict[str, Path], tmp_path: Path) -> None:
    r = prepare(sources, tmp_path / "out", "--weights", "counter_agent=0.5,weather_agent=0.5")
    assert r.returncode == 0, r.stderr
    names = [row["agent_ref"]["name"] for row in read_jsonl(tmp_path / "out/train.jsonl")]
    assert names.count("counter_agent") == 20 and names.count("weather_agent") == 20
    meta = json.loads((tmp_path / "out/metadata.json").read_text())
    assert meta["weights"] == {"counter_agent": 0.5, "weather_agent": 0.5}
    assert meta["agents"]["counter_agent"]["train_available"] == 40
    assert blend_counts({"a": 100, "b": 10}, {"a": 0.7, "b": 0.3}) == {"a": 23, "b": 10}
    assert blend_counts({"a": 100, "b": 10}, {"a": 1, "b": 0}) == {"a": 100, "b": 0}


def test_bad_rows_reported_and_nothing_written(sources: dict[str, Path], tmp_path: Path) -> None:
    rows = counter_rows(3)
    rows[1]["expected_count"] = "many"
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows, "{oops"])
    args = (
        "prepare",
        str(sources["config"]),
        "-i",
        f"counter_agent={bad}",
        "-i",
        f"weather_agent={sources['weather']}",
        "-o",
        str(tmp_path / "out"),
    )
    r = cli(*args)
    assert r.returncode == 2
    assert f"{bad}:2: counter: task field 'expected_count': expected int, got str" in r.stderr
    assert f"{bad}:4: not valid JSON" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "gym-runtime: error: 2 problems in the input rows (nothing was written)"
    assert not (tmp_path / "out").exists()
    r = cli(*args, "--drop-invalid")
    assert r.returncode == 0 and "2 invalid rows dropped" in r.stdout
    assert json.loads((tmp_path / "out/metadata.json").read_text())["agents"]["counter_agent"]["train"] == 2


def test_datasets_rows_are_reported_by_index(sources: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    rows = counter_rows(3)
    rows[2]["initial_count"] = 1.5
    datasets.Dataset.from_list([{**r, "initial_count": float(r["initial_count"])} for r in rows]).to_parquet(str(bad))
    r = cli("prepare", str(sources["config"]), "-i", f"counter_agent={bad}", "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    assert f"{bad}[2]: counter: task field 'initial_count': expected int, got float" in r.stderr


def test_user_mistakes_are_one_line(sources: dict[str, Path], tmp_path: Path) -> None:
    base = ("prepare", str(sources["config"]), "-o", str(tmp_path / "out"))
    cases = {
        ("-i", str(tmp_path / "missing.jsonl")): "missing.jsonl: file not found",
        ("-i", "notanid"): "notanid: no such file, and not a Hugging Face dataset id",
        # an agent's environment's own dataset is AGENT=env: said where a name was meant as one
        ("-i", "counter_agent=my_vf"): "counter_agent=env[:SPLIT] reads the dataset of the agent's environment",
        ("-i", f"nobody={sources['counter']}"): "'nobody' is not an agent of this config",
        ("-i", f"counter_agent={sources['counter']}", "--weights", "x=1"): "--weights: x not agents",
        ("-i", f"counter_agent={sources['counter']}", "--val-fraction", "1.5"): "--val-fraction 1.5",
    }
    for extra, text in cases.items():
        r = cli(*base, *extra)
        assert r.returncode == 2 and text in r.stderr, (extra, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_small_input_still_gets_validation_rows_or_says_why_not(tmp_path: Path) -> None:
    """--val-fraction 0.1 of 4 rows rounds to 0: one row goes to validation; an agent with one row says so."""
    cfg = tmp_path / "two.yaml"
    cfg.write_text(CONFIG)
    few, one = tmp_path / "few.jsonl", tmp_path / "one.jsonl"
    write_jsonl(few, counter_rows(4))
    write_jsonl(one, weather_rows(1))
    r = cli(
        "prepare", str(cfg), "-i", f"counter_agent={few}", "-i", f"weather_agent={one}", "-o", str(tmp_path / "out"),
        "--val-fraction", "0.1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "out/metadata.json").read_text())
    assert meta["agents"]["counter_agent"]["validation"] == 1 and meta["agents"]["counter_agent"]["train"] == 3
    assert meta["agents"]["weather_agent"]["validation"] == 0
    assert "weather_agent: 1 row, none left for validation (--val-fraction 0.1)" in r.stderr


def test_hub_source_syntax() -> None:
    s = parse_source("hf:nvidia/Nemotron-RL-knowledge-mcqa@abc123:validation")
    assert (s.kind, s.spec, s.revision, s.split) == ("hub", "nvidia/Nemotron-RL-knowledge-mcqa", "abc123", "validation")
    s = parse_source("mcqa_agent=hf:nvidia/Nemotron-RL-math-OpenMathReasoning/train.jsonl")
    assert (s.kind, s.spec, s.agent) == (
        "hub_file",
        "nvidia/Nemotron-RL-math-OpenMathReasoning/train.jsonl",
        "mcqa_agent",
    )
    assert parse_source("owner/name").kind == "hub"
    with pytest.raises(PrepareError):
        parse_source("data.csv")


def test_nemo_gym_datasets_entries_as_ng_prepare_data_takes_them(tmp_path: Path) -> None:
    """A NeMo Gym config with no -i: its datasets: entries' local jsonl_fpath files (no model server needed)."""
    import shutil
    import subprocess
    import sys

    from gym_runtime.data.prepare import nemo_sources

    root = tmp_path / "gym"
    shutil.copytree(COMPAT / "configs" / "resources_servers", root / "resources_servers")
    data = root / "resources_servers" / "mcqa" / "data"
    data.mkdir()
    rows = read_jsonl(COMPAT / "mcqa" / "example.jsonl")
    write_jsonl(data / "train.jsonl", rows[:4])
    write_jsonl(data / "validation.jsonl", rows[4:])
    write_jsonl(data / "example.jsonl", rows)
    config = root / "resources_servers" / "mcqa" / "configs" / "mcqa.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", "prepare", str(config), "-o", str(tmp_path / "out")],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    train, val = read_jsonl(tmp_path / "out/train.jsonl"), read_jsonl(tmp_path / "out/validation.jsonl")
    assert (len(train), len(val)) == (4, 1)  # the validation entry stays validation, whole
    assert {row["agent_ref"]["name"] for row in train + val} == {"mcqa_simple_agent"}
    # Entries whose file is absent fall back to their Hugging Face source (not downloaded here).
    (data / "train.jsonl").unlink()
    cwd = Path.cwd()
    os.chdir(root)
    try:
        srcs = nemo_sources(config)
    finally:
        os.chdir(cwd)
    assert [(s.kind, s.spec, s.role) for s in srcs] == [
        ("hub", "nvidia/Nemotron-RL-knowledge-mcqa", None),
        ("jsonl", str(data / "validation.jsonl"), "validation"),
    ]


def test_a_verifiers_04_agents_env_dataset_is_refused_with_the_rows_to_write(tmp_path: Path) -> None:
    """A 0.4 taskset loads only on its own built environment: `prepare -i vf04=env` says what rows to give
    (it said "no dataset_rows", which names no way forward)."""
    cfg = tmp_path / "vf04.yaml"
    cfg.write_text(
        "models: {policy: {adapter: scripted}}\n"
        "agents:\n  vf04: {agent: agents.verifiers_v1, model: policy, options: {env: {taskset: {id: my_taskset}}}}\n"
    )
    r = cli("prepare", str(cfg), "-i", "vf04=env", "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and not (tmp_path / "out").exists()
    assert r.stderr.strip().splitlines() == [
        "gym-runtime: error: vf04=env: a verifiers 0.4 taskset loads only in its own built environment, so prepare"
        ' cannot list it: give rows {"responses_create_params": {"input": []}, "verifiers": {"index": I}} for the'
        " tasks to run (the first N: gym_runtime.agents.verifiers_v1.rows(N); docs/bring-your-environment.md,"
        " verifiers 0.4)"
    ]
