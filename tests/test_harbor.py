"""Harbor's task format as ``gym_runtime.harbor`` reads it, without an engine: rewards by Harbor's rules (its
``Verifier._parse_reward_json``/``_parse_reward_text``, 0.26: reward.json first, finite numbers only; an empty
or unparsable file is an error), task.toml's keys, the base-image map, what a test.sh fetches, and the image's
name by content (the end-to-end runs on Docker are tests/e2e/test_harbor.py)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from gym_runtime.config import Config, config_from_dict
from gym_runtime.errors import ConfigError, UserError
from gym_runtime.harbor import (
    ImageOptions,
    RewardError,
    fetches,
    files_of,
    find_tasks,
    host_ca,
    image_ref,
    last_layer,
    load_task,
    parse_rewards,
    rewrite_from,
    row_reward,
)
from gym_runtime.harbor.hosting import ensure_config_images, harbor_config, parity_lines
from tests.helpers import REPO
from tests.hosting import harbor_python

TASKS = REPO / "tests" / "harbor_tasks"
GOOD = [
    (None, b"1\n", {"reward": 1.0}),
    (None, b" 0.5 ", {"reward": 0.5}),
    (b'{"reward": 0.25, "checks": 1}', b"1", {"reward": 0.25, "checks": 1.0}),  # json wins over txt
    (b'{"accuracy": 0.75}', None, {"accuracy": 0.75}),
    (b'{"reward": true}', None, {"reward": 1.0}),  # a JSON bool is an int to Harbor's check
]
BAD = [
    (None, None, "no reward file: test.sh wrote neither"),
    (None, b"", "reward file is empty: /logs/verifier/reward.txt"),
    (b"", b"1", "reward file is empty: /logs/verifier/reward.json"),
    (None, b"passed", "cannot parse a reward from /logs/verifier/reward.txt"),
    (None, b"nan", "non-finite reward nan in /logs/verifier/reward.txt"),
    (b'{"reward": "1"}', None, "non-numeric reward '1' in /logs/verifier/reward.json"),
    (b'{"reward": Infinity}', None, "non-finite reward inf"),
    (b"[1]", None, "must hold an object of rewards, not list"),
    (b"5", None, "must hold an object of rewards, not int"),
    (b"{reward: 1}", None, "cannot parse rewards from /logs/verifier/reward.json"),
]
# Harbor's own code on the same files: its Verifier's parsers, chosen as its verify() chooses (reward.json when it
# exists, else reward.txt, else RewardFileNotFoundError), the result validated as verify() returns it
_HARBOR = """
import json, sys, tempfile
from pathlib import Path
from types import SimpleNamespace
from harbor.models.verifier.result import VerifierResult
from harbor.verifier.verifier import RewardFileNotFoundError, Verifier

out = []
for rj, rt in json.loads(sys.stdin.read()):
    d = Path(tempfile.mkdtemp())
    paths = SimpleNamespace(reward_json_path=d / "reward.json", reward_text_path=d / "reward.txt")
    for path, data in ((paths.reward_json_path, rj), (paths.reward_text_path, rt)):
        if data is not None:
            path.write_bytes(data.encode("latin-1"))
    me = SimpleNamespace(trial_paths=paths)
    try:
        if paths.reward_json_path.exists():
            rewards = Verifier._parse_reward_json(me)
        elif paths.reward_text_path.exists():
            rewards = Verifier._parse_reward_text(me)
        else:
            raise RewardFileNotFoundError("none")
        out.append({"rewards": VerifierResult(rewards=rewards).rewards})
    except Exception as e:
        out.append({"error": type(e).__name__})
print(json.dumps(out))
"""


@pytest.mark.parametrize(("reward_json", "reward_txt", "rewards"), GOOD)
def test_rewards_are_read_as_harbor_reads_them(
    reward_json: bytes | None, reward_txt: bytes | None, rewards: dict[str, float]
) -> None:
    assert parse_rewards(reward_json, reward_txt) == rewards


@pytest.mark.parametrize(("reward_json", "reward_txt", "error"), BAD)
def test_a_reward_harbor_refuses_is_an_error(reward_json: bytes | None, reward_txt: bytes | None, error: str) -> None:
    with pytest.raises(RewardError) as e:
        parse_rewards(reward_json, reward_txt)
    assert error in str(e.value)


def test_harbors_own_parsing_code_reads_the_same_rewards_and_refuses_the_same_files() -> None:
    python = harbor_python()  # built once (minutes), then reused; $GYM_HARBOR_PYTHON overrides
    cases = [(rj, rt) for rj, rt, _ in GOOD + BAD]
    wire = json.dumps([[None if b is None else b.decode("latin-1") for b in case] for case in cases])
    run = subprocess.run([python, "-c", _HARBOR], input=wire, capture_output=True, text=True, timeout=120, check=True)
    theirs = json.loads(run.stdout)
    for (rj, rt), got in zip(cases, theirs, strict=True):
        try:
            ours: dict[str, object] = {"rewards": parse_rewards(rj, rt)}
        except RewardError:
            ours = {"error": True}
        if "error" in got:
            assert "error" in ours, (rj, rt, got)
        else:
            assert ours == got, (rj, rt)
    assert sum("error" in got for got in theirs) == len(BAD)


def test_the_rows_reward_is_named_reward_or_the_only_one() -> None:
    assert row_reward({"reward": 0.5, "checks": 2.0}) == 0.5
    assert row_reward({"accuracy": 0.75}) == 0.75
    with pytest.raises(RewardError, match=r"several rewards and none named 'reward': \['a', 'b'\]"):
        row_reward({"a": 1.0, "b": 0.0})


def test_task_toml_keys_and_a_dataset_of_tasks() -> None:
    tasks = find_tasks(TASKS)
    assert [t.name for t in tasks] == ["compile-c", "partial-stats", "read-file"]
    read = {t.name: t for t in tasks}["read-file"]
    assert (read.config.verifier.timeout_sec, read.config.agent.user, read.config.agent.timeout_sec) == (
        60.0,
        "agent",
        120.0,
    )
    partial = {t.name: t for t in tasks}["partial-stats"]
    assert partial.config.verifier.env == {"STATS_PATH": "/app/stats.json"} and partial.config.verifier.user == "nobody"
    assert find_tasks(TASKS / "read-file") == [read]  # one task directory is a dataset of one


def test_a_directory_that_is_not_a_task_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="holds no Harbor task"):
        find_tasks(tmp_path)
    shutil.copytree(TASKS / "read-file", tmp_path / "t")
    (tmp_path / "t" / "tests" / "test.sh").unlink()
    with pytest.raises(UserError, match=r"/t: a Harbor task needs tests/test.sh"):
        load_task(tmp_path / "t")
    (tmp_path / "t" / "task.toml").write_text("[verifier]\ntimeout_sec = 'soon'\n")
    with pytest.raises(UserError, match=r"task.toml: Expected `float`, got `str` - at `\$.verifier.timeout_sec`"):
        load_task(tmp_path / "t")


def test_from_lines_are_mapped_and_the_unmapped_external_ones_named() -> None:
    dockerfile = (
        "FROM --platform=linux/amd64 python:3.12-slim AS build\nRUN make\n"
        "FROM build AS test\nFROM ubuntu:24.04\nCOPY --from=build /x /x\n"
    )
    out, external = rewrite_from(dockerfile, {"python:3.12-slim": "gym-runtime/base:abc"})
    assert out.splitlines()[0] == "FROM --platform=linux/amd64 gym-runtime/base:abc AS build"
    assert out.splitlines()[2] == "FROM build AS test"  # a stage, not an image
    assert external == ["ubuntu:24.04"]


def test_what_a_test_sh_fetches_is_named(tmp_path: Path) -> None:
    task = tmp_path / "t"
    shutil.copytree(TASKS / "read-file", task)
    assert fetches(load_task(task)) == []
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\n# curl in a comment is nothing\napt-get update\napt-get install -y curl\n"
        "curl -LsSf https://astral.sh/uv/install.sh | sh\nuvx -p 3.13 -w pytest pytest /tests\n"
    )
    assert fetches(load_task(task)) == ["apt-get install", "curl", "uvx"]


def test_the_image_is_named_by_what_it_is_built_from(tmp_path: Path) -> None:
    shutil.copytree(TASKS / "read-file", tmp_path / "t")
    task = load_task(tmp_path / "t")
    opts = ImageOptions(base_images={"debian:bookworm-slim": "base"})
    ref = image_ref(task, opts)
    (tmp_path / "t" / "tests" / "test.sh").write_text("#!/bin/bash\nexit 0\n")  # not in the image
    assert image_ref(load_task(tmp_path / "t"), opts) == ref
    assert image_ref(task, ImageOptions(base_images=opts.base_images, bake=["true"])) != ref
    (tmp_path / "t" / "environment" / "secret.txt").write_text("other\n")
    assert image_ref(load_task(tmp_path / "t"), opts) != ref


def test_parity_lines_name_each_tasks_outcome(tmp_path: Path) -> None:
    shutil.copytree(TASKS / "read-file", tmp_path / "a")
    shutil.copytree(TASKS / "read-file", tmp_path / "b")
    shutil.copytree(TASKS / "read-file", tmp_path / "c")
    (tmp_path / "b" / "tests" / "test.sh").write_text("#!/bin/bash\nuvx pytest /tests\n")
    tasks = find_tasks(tmp_path)
    rows = [{"harbor_task": "a", "reward": 1.0, "harbor_rewards": {"reward": 1.0}}, {"harbor_task": "b", "reward": 0.0}]
    failures = [{"_ng_task_index": 2, "error_class": "timeout", "error": "slow"}]
    ok, lines = parity_lines(tasks, rows, failures)
    assert not ok
    assert lines == [
        "a: reward 1 (full) {'reward': 1.0}",
        "b: reward 0 is not the full reward 1: MISMATCH (its tests/test.sh fetches at verify time: uvx)",
        "c: failed (timeout): slow: MISMATCH",
    ]
    assert parity_lines(tasks[:1], rows[:1], [])[0]


def test_the_hosts_ca_is_given_to_the_baked_commands_only_and_removed() -> None:
    """Behind a TLS-intercepting proxy a bake's ``pip install`` needs the host's CA bundle (the classic build API
    has no secrets): it is in the bake layer's context, named to each baked command, and removed after them."""
    ca = host_ca()
    assert ca is not None and b"BEGIN CERTIFICATE" in ca

    def layer(bake: list[str]) -> tuple[list[str], set[str]]:
        with tarfile.open(fileobj=io.BytesIO(last_layer("stage", "", "", bake, ca))) as t:
            names = set(t.getnames())
            member = t.extractfile("Dockerfile")
            assert member is not None
            return member.read().decode().splitlines(), names

    lines, names = layer(["pip install pytest", "echo done"])
    assert names == {"Dockerfile", ".gym-host-ca.crt"}
    runs = [ln for ln in lines if ln.startswith("RUN ")][1:]
    env = "PIP_CERT=/tmp/.gym-host-ca.crt REQUESTS_CA_BUNDLE=/tmp/.gym-host-ca.crt"
    assert [r.split(" && ", 1)[1] for r in runs[:2]] == ["pip install pytest", "echo done"]
    assert all(env in r for r in runs[:2]) and runs[2] == "RUN rm -f /tmp/.gym-host-ca.crt"
    assert not any(ln.startswith("ENV") for ln in lines)  # nothing of it stays in the image's environment
    assert layer([]) == (lines[:3], {"Dockerfile"})  # nothing baked: no CA at all


async def test_a_harbor_entry_without_tasks_or_with_a_bad_map_is_one_line_before_any_engine_is_asked() -> None:
    """``run``/``start`` read a Harbor entry's image options as the environment does: a mistake is one line naming
    the key (exit 2), said before an engine is opened (this config's names a socket that does not exist)."""

    def cfg(options: dict[str, object]) -> Config:
        raw = harbor_config(str(TASKS), ImageOptions(), "unix:///nonexistent/docker.sock", 60)
        raw["resources"]["harbor"]["options"] = options
        return config_from_dict({**raw, "base_dir": "."})

    with pytest.raises(ConfigError, match=r"^resources\.harbor\.options\.tasks: name a Harbor task directory"):
        await ensure_config_images(cfg({}))
    with pytest.raises(ConfigError, match=r"^resources\.harbor\.options: Expected `array`, got `str` - at `\$\.bake`"):
        await ensure_config_images(cfg({"tasks": str(TASKS), "bake": "pip install pytest"}))
    with pytest.raises(ConfigError, match=r"^sandboxes\.harbor: the docker engine does not answer"):
        await ensure_config_images(cfg({"tasks": str(TASKS)}))
    await ensure_config_images(cfg({"tasks": str(TASKS)}), pools=["other"])  # not served


LINKED = "a symbolic link in a Harbor task is refused (its files must be its own)"


@pytest.mark.parametrize(
    "where",
    [
        "task.toml",
        "instruction.md",
        "environment/Dockerfile",
        "environment/data",
        "tests",
        "tests/sub/helper.sh",
        "solution/solve.sh",
    ],
)
def test_a_link_anywhere_a_task_is_read_from_is_refused_naming_it(tmp_path: Path, where: str) -> None:
    """Even a link that stays inside the task: a task's files are its own, read without following anything."""
    task = tmp_path / "t"
    shutil.copytree(TASKS / "read-file", task)
    (task / "tests" / "sub").mkdir()
    (task / "tests" / "sub" / "helper.sh").write_text("true\n")
    spare = tmp_path / "spare"  # what the link names: a copy of the file or directory it replaces
    link = task / where
    if link.is_dir():
        shutil.copytree(link, spare)
        shutil.rmtree(link)
    elif link.exists():
        shutil.copy(link, spare)
        link.unlink()
    else:
        spare.mkdir()
    link.symlink_to(spare)
    with pytest.raises(UserError) as e:
        find_tasks(tmp_path)
    assert str(e.value) == f"{link}: {LINKED}"


def test_a_dataset_task_that_is_a_link_a_fifo_and_a_link_made_after_loading_are_refused(tmp_path: Path) -> None:
    (tmp_path / "set").mkdir()
    shutil.copytree(TASKS / "read-file", tmp_path / "elsewhere")
    (tmp_path / "set" / "task").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError, match=f"^{tmp_path}/set/task: {re.escape(LINKED)}$"):
        find_tasks(tmp_path / "set")
    task = tmp_path / "elsewhere"
    os.mkfifo(task / "tests" / "pipe")  # a reader would wait on it forever
    with pytest.raises(UserError, match=r"/tests/pipe: not a regular file or a directory"):
        load_task(task)
    (task / "tests" / "pipe").unlink()
    loaded = load_task(task)
    (task / "tests" / "late").symlink_to(task / "task.toml")  # made since: refused where the tree is read
    with pytest.raises(UserError, match=f"/tests/late: {re.escape(LINKED)}$"):
        files_of(loaded.dir / "tests")
