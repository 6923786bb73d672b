"""deploy/slurm/gym-runtime.sbatch on a real Slurm (slurmctld + four slurmd on loopback, tests/slurm.py).

End to end with ``sbatch --wait``, plain and secured; a running job cancelled mid-batch drains (its steps get
SIGTERM and exit, none is SIGKILLed) and the same job submitted again on the same store and batch finishes it,
every row exactly once; a job without GPUs or with too few nodes stops at once with one line naming what to
change.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_runtime.ops.nats_server import free_port
from tests.docker import docker_socket
from tests.helpers import REPO, read_jsonl
from tests.podman import CONTAINERS_CONF, PODMAN, STORAGE_CONF, store_to_ourselves
from tests.slurm import NODES, REQUIRE_ENV, Cluster, local_slurm, missing

SBATCH = REPO / "deploy/slurm/gym-runtime.sbatch"
ROWS = REPO / "resources/weather/data/example.jsonl"


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[Cluster]:
    why = missing()
    if why is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {why}")
        pytest.skip(why)
    with local_slurm(tmp_path / "slurm") as cluster:
        yield cluster


def recipe_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The recipe's knobs for this machine: one venv (this one), servers on the nodes' own addresses."""
    return {
        "GYM_VENV": str(Path(sys.executable).parent.parent),
        "GYM_LISTEN": "node",
        "GYM_VLLM": "0",  # the config's scripted policy: no vLLM server
        "GYM_REPLICAS": "1",
        "GYM_STORE": str(tmp_path / "store"),
        "GYM_NATS_PORT": str(free_port()),
        "GYM_ROUTE_PORT": str(free_port()),
        "GYM_MONITOR_PORT": str(free_port()),
        **extra,
    }


def config(tmp_path: Path, *, delay_s: float = 0.0, agent_concurrency: int | None = None) -> Path:
    """deploy/config.yaml, its 20GB stream limits lowered (three servers reserve them on one disk)."""
    text = (REPO / "deploy/config.yaml").read_text().replace("_max_bytes: 20GB", "_max_bytes: 1GB")
    if delay_s:
        text = text.replace("    adapter: scripted\n", f"    adapter: scripted\n    delay_s: {delay_s}\n")
    if agent_concurrency is not None:
        assert "concurrency: 256," in text
        text = text.replace("concurrency: 256,", f"concurrency: {agent_concurrency},")
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def sbatch(cluster: Cluster, env: dict[str, str], log: Path, *args: str, wait: bool = True) -> Any:
    argv = ["sbatch", "--nodes=4", f"--output={log}", *(["--wait"] if wait else ["--parsable"]), str(SBATCH), *args]
    return cluster.run(*argv, env=env, timeout=600)


@pytest.mark.parametrize("secured", [False, True], ids=["plain", "secured"])
def test_the_recipe_runs_a_batch_end_to_end_and_drains_its_steps(slurm: Cluster, tmp_path: Path, secured: bool) -> None:
    env = recipe_env(tmp_path, **({"GYM_SECURE_DIR": str(tmp_path / "auth")} if secured else {}))
    out, log = tmp_path / "out.jsonl", tmp_path / "job.log"
    res = sbatch(slurm, env, log, str(config(tmp_path)), str(ROWS), str(out))
    text = log.read_text() if log.exists() else ""
    assert res.returncode == 0, res.stderr + text[-3000:]
    rows = read_jsonl(out)
    assert len(rows) == len(read_jsonl(ROWS)) and all(r["reward"] == 1.0 for r in rows)
    # the steps were told to stop (SIGTERM to their tasks) and exited: none was SIGKILLed
    assert "Killed" not in text and "forcing job termination" not in text, text[-3000:]


def _acked_results(monitor: str) -> int:
    """Results stored so far (the results stream's messages), from the first node's monitoring port."""
    with urllib.request.urlopen(f"{monitor}/jsz?streams=true", timeout=5) as r:
        jsz = json.loads(r.read())
    streams = [s for a in jsz.get("account_details", []) for s in a.get("stream_detail", [])]
    return sum(s["state"]["messages"] for s in streams if s["name"] == "GYM_RESULTS_weather_agent")


def test_a_cancelled_job_drains_and_the_same_job_again_finishes_the_batch(slurm: Cluster, tmp_path: Path) -> None:
    env = recipe_env(tmp_path, GYM_BATCH="resumed", GYM_REPEATS="20")
    # a few rollouts at a time, so the batch is still running when the job is cancelled (with the config's
    # 256 every rollout ran at once and a quiet machine finished all 100 before the cancel came)
    cfg, out = config(tmp_path, delay_s=0.3, agent_concurrency=2), tmp_path / "out.jsonl"
    first = sbatch(slurm, env, tmp_path / "first.log", str(cfg), str(ROWS), str(out), wait=False)
    assert first.returncode == 0, first.stderr
    job = first.stdout.strip().split(";")[0]
    monitor = f"http://{NODES['n1']}:{env['GYM_MONITOR_PORT']}"
    deadline = time.monotonic() + 180
    while True:  # mid-batch: some results stored, the batch not done
        try:
            stored = _acked_results(monitor)
        except OSError:
            stored = 0
        if stored >= 5:
            break
        assert time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.5)
    assert slurm.run("scancel", job).returncode == 0
    deadline = time.monotonic() + 120
    while slurm.run("squeue", "--noheader", "--jobs", job).stdout.strip():
        assert time.monotonic() < deadline, "the cancelled job did not end within 120 s"
        time.sleep(0.5)
    text = (tmp_path / "first.log").read_text()
    assert "Killed" not in text, text[-3000:]  # cancelling sends SIGTERM: every worker drained and exited
    assert not out.exists()

    again = sbatch(slurm, env, tmp_path / "again.log", str(cfg), str(ROWS), str(out))
    assert again.returncode == 0, (tmp_path / "again.log").read_text()[-3000:]
    rows = read_jsonl(out)
    slots = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]
    assert len(rows) == 20 * len(read_jsonl(ROWS)) and len(set(slots)) == len(slots)


@pytest.mark.parametrize(
    ("nodes", "extra", "names"),
    [
        (2, {"GYM_VLLM": "0"}, "submit with sbatch --nodes=4 or more"),
        (4, {"GYM_VLLM": "1"}, "submit with sbatch --gpus-per-node=N, or set GYM_VLLM=0"),
    ],
    ids=["too-few-nodes", "no-gpus"],
)
def test_defaults_that_do_not_fit_the_cluster_stop_with_one_line(
    slurm: Cluster, tmp_path: Path, nodes: int, extra: dict[str, str], names: str
) -> None:
    env = recipe_env(tmp_path, **extra)
    log = tmp_path / "job.log"
    argv = ["sbatch", f"--nodes={nodes}", f"--output={log}", "--wait", str(SBATCH)]
    res = slurm.run(*argv, str(config(tmp_path)), str(ROWS), str(tmp_path / "out.jsonl"), env=env, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gym-runtime.sbatch: error: ") and names in lines[0], lines


BOX_AGENT = REPO / "tests" / "envs" / "box_agent.py"  # loaded as a user's module: by name, from PYTHONPATH


def run_box_pool(slurm: Cluster, tmp_path: Path, backend: str, **extra: str) -> None:
    """The recipe on a config whose agent runs each rollout in a sandbox of a pool on ``backend``: every row
    scored (the sandbox printed what it should), no step SIGKILLed."""
    pool = f"s{backend[0]}{os.getpid()}"  # this test's own: pools of other runs on the engine keep their containers
    cfg = config(tmp_path)
    raw = yaml.safe_load(cfg.read_text())
    raw["sandboxes"] = {pool: {"backend": backend, "image": "base", "max_live": 4}}
    raw["agents"]["weather_agent"].update(agent="box_agent", sandbox=pool, timeout_s=120)
    cfg.write_text(yaml.safe_dump(raw))
    env = recipe_env(tmp_path, PYTHONPATH=f"{BOX_AGENT.parent}{os.pathsep}{REPO}", **extra)
    out, log = tmp_path / "out.jsonl", tmp_path / "job.log"
    res = sbatch(slurm, env, log, str(cfg), str(ROWS), str(out))
    text = log.read_text() if log.exists() else ""
    assert res.returncode == 0, res.stderr + text[-3000:]
    rows = read_jsonl(out)
    assert len(rows) == len(read_jsonl(ROWS)) and all(r["reward"] == 1.0 and "sandbox_wait_s" in r for r in rows)
    assert "Killed" not in text, text[-3000:]


def test_the_recipe_starts_the_configs_sandbox_pool_on_each_cpu_node(slurm: Cluster, tmp_path: Path) -> None:
    """A config with a sandbox pool: the script starts its worker on the CPU node, on that node's engine (here
    the test engine, DOCKER_HOST), and every rollout's sandbox runs there. Before, no step started the pool and
    every rollout waited for one until it failed."""
    run_box_pool(slurm, tmp_path, "docker", DOCKER_HOST=f"unix://{docker_socket()}")


def test_the_recipe_starts_a_podman_sandbox_pool_with_a_podman_service_per_node(slurm: Cluster, tmp_path: Path) -> None:
    """GYM_PODMAN=1 and a pool on Podman: each CPU node's step starts `podman system service` on a socket of the
    job's and the pool's worker on it (the base image imported from the shared cache); rollouts' sandboxes run
    there."""
    if not os.path.exists(PODMAN) or not shutil.which("runc"):
        pytest.skip(f"no Podman engine: {PODMAN} or runc is not installed (apt-get install podman)")
    conf = tmp_path / "podman"
    (conf / "tmp").mkdir(parents=True)
    with store_to_ourselves() as store:  # the nodes' services are the only ones on the store meanwhile
        (conf / "containers.conf").write_text(CONTAINERS_CONF.format(dir=conf, store=store))
        (conf / "storage.conf").write_text(STORAGE_CONF.format(store=store))
        confs = {
            "CONTAINERS_CONF": str(conf / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(conf / "storage.conf"),
        }
        run_box_pool(slurm, tmp_path, "podman", GYM_PODMAN="1", **confs)
