"""Container backends: command construction (no daemon needed) and lifecycle against a STUB engine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest

from gym_runtime import testing
from gym_runtime.resources.swe import SWE, SWEOptions, make_backend
from gym_runtime.resources.swe.containers import OWNER_LABEL, ContainerCommands, swe_image
from gym_runtime.resources.swe.environments import ContainerBackend, EnvironmentError_

STUB = Path(__file__).resolve().parent / "stub_engine.py"


def swe_gym_rows() -> list[dict]:
    return testing.read_jsonl(testing.compat_dir("nemo_gym", "mini_swe_agent", "example.jsonl"))


def test_images_are_named_as_swe_gym_and_swe_bench_name_them() -> None:
    row = swe_gym_rows()[0]
    assert row["instance_id"] == "getmoto__moto-7365"
    assert swe_image(row) == "docker.io/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest"
    assert swe_image(row, "swe-bench") == "docker.io/swebench/sweb.eval.x86_64.getmoto_1776_moto-7365:latest"
    assert swe_image({"instance_id": "Project-MONAI__MONAI-6975"}) == (
        "docker.io/xingyaoww/sweb.eval.x86_64.project-monai_s_monai-6975:latest"
    )
    assert swe_image({**row, "image_name": "registry.local/x:1"}) == "registry.local/x:1"
    for r in swe_gym_rows():
        assert "__" not in swe_image(r)


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_docker_and_podman_run_a_self_removing_labelled_offline_container(engine: str) -> None:
    cmds = ContainerCommands(engine=engine)  # type: ignore[arg-type]
    argv = cmds.start("gym-swe-1-ab", swe_gym_rows()[0], 3600)
    assert argv[:4] == [engine, "run", "-d", "--rm"]
    assert argv[argv.index("--name") + 1] == "gym-swe-1-ab"
    assert argv[argv.index("--network") + 1] == "none"
    assert argv[argv.index("--label") + 1] == f"{OWNER_LABEL}={os.uname().nodename}:{os.getpid()}"
    assert argv[argv.index("--entrypoint") + 1] == "sleep"
    assert argv[-2:] == ["docker.io/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest", "3600"]
    assert "--pids-limit" in argv and "--memory" in argv
    ex = cmds.exec("gym-swe-1-ab", "ls -la", 30)
    assert ex[:5] == [engine, "exec", "-w", "/testbed", "gym-swe-1-ab"]
    assert ex[5:10] == ["timeout", "-s", "KILL", "30", "bash"]
    assert ex[10] == "-lc" and ex[11].endswith("cd /testbed\nls -la") and "activate testbed" in ex[11]
    assert cmds.remove("gym-swe-1-ab") == [engine, "rm", "-f", "gym-swe-1-ab"]
    assert cmds.write("gym-swe-1-ab", "a b.diff")[:4] == [engine, "exec", "-i", "gym-swe-1-ab"]
    assert "'/testbed/a b.diff'" in cmds.write("gym-swe-1-ab", "a b.diff")[-1]


def test_network_can_be_opened_explicitly() -> None:
    argv = ContainerCommands(network="bridge").start("n", {"instance_id": "a__b-1"}, 10)
    assert argv[argv.index("--network") + 1] == "bridge"


@pytest.mark.parametrize("engine", ["apptainer", "singularity"])
def test_apptainer_instances(engine: str) -> None:
    cmds = ContainerCommands(engine=engine)  # type: ignore[arg-type]
    row = swe_gym_rows()[0]
    argv = cmds.start("gym-swe-7-cd", row, 3600)
    assert argv[:3] == [engine, "instance", "start"]
    assert "--containall" in argv and "--writable-tmpfs" in argv and argv[argv.index("--network") + 1] == "none"
    assert argv[-2:] == ["docker://docker.io/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest", "gym-swe-7-cd"]
    assert cmds.exec("gym-swe-7-cd", "pwd", 5)[:4] == [engine, "exec", "--pwd", "/testbed"]
    assert cmds.exec("gym-swe-7-cd", "pwd", 5)[4] == "instance://gym-swe-7-cd"
    assert cmds.remove("gym-swe-7-cd") == [engine, "instance", "stop", "gym-swe-7-cd"]
    sif = ContainerCommands(engine=engine, sif_template="/cache/{instance_id}.sif")  # type: ignore[arg-type]
    assert sif.start("n", row, 10)[-2] == "/cache/getmoto__moto-7365.sif"


def test_orphans_are_containers_whose_owner_process_is_gone() -> None:
    host = "node1"
    listing = "\n".join(
        [
            f"gym-swe-1-aa {host}:{os.getpid()}",  # alive: this process
            f"gym-swe-2-bb {host}:999999999",  # no such pid
            "gym-swe-3-cc othernode:999999999",  # another host's: not ours to judge
            "unrelated-container x:1",
        ]
    )
    assert ContainerCommands().orphans(listing, host=host) == ["gym-swe-2-bb"]
    apptainer = ContainerCommands(engine="apptainer")
    assert apptainer.orphans(f"gym-swe-999999999-dd 12 img\ngym-swe-{os.getpid()}-ee 13 img", host=host) == [
        "gym-swe-999999999-dd"
    ]


def test_options_pick_the_backend() -> None:
    backend = make_backend(SWEOptions(backend="podman", network="slirp4netns"))
    assert isinstance(backend, ContainerBackend) and backend.cmds.binary == "podman"
    assert backend.cmds.network == "slirp4netns"


# ------------------------------------------------------------------ lifecycle against the stub engine


@pytest.fixture
def stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "engine.log"
    monkeypatch.setenv("STUB_ENGINE_LOG", str(log))
    monkeypatch.setenv("STUB_ENGINE_ROOT", str(tmp_path / "containers"))
    return log


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def backend(**kw: object) -> ContainerBackend:
    cmds = ContainerCommands(binary=str(STUB), shell_setup="")
    return ContainerBackend(cmds, lifetime_s=60, start_timeout_s=kw.pop("start_timeout_s", 30), max_output=4096)  # type: ignore[arg-type]


async def test_start_run_close(stub: Path) -> None:
    env = await backend().start({"instance_id": "a__b-1"})
    res = await env.run("echo hello > f.txt && cat f.txt && pwd", 10)
    assert res.returncode == 0 and res.output.startswith("hello\n") and res.output.rstrip().endswith(env.name)
    await env.write("dir/x.txt", "content")
    assert (await env.run("cat dir/x.txt", 10)).output == "content"
    await env.close()
    await env.close()  # idempotent
    assert [c[:2] for c in calls(stub)].count(["rm", "-f"]) == 1
    with pytest.raises(EnvironmentError_):
        await env.run("true", 1)


async def test_a_failed_start_still_removes_the_container(stub: Path) -> None:
    with pytest.raises(EnvironmentError_, match="could not start"):
        await backend().start({"instance_id": "x", "image_name": "missing:1"})
    log = calls(stub)
    name = log[0][log[0].index("--name") + 1]
    assert log[-1] == ["rm", "-f", name]


async def test_a_cancelled_or_timed_out_start_still_removes_the_container(stub: Path) -> None:
    with anyio.move_on_after(1.0):
        await backend().start({"instance_id": "x", "image_name": "slow:1"})
    log = calls(stub)
    assert log[-1][:2] == ["rm", "-f"] and log[-1][2] == log[0][log[0].index("--name") + 1]
    with pytest.raises(EnvironmentError_):
        await backend(start_timeout_s=0.5).start({"instance_id": "x", "image_name": "slow:2"})
    assert calls(stub)[-1][:2] == ["rm", "-f"]


async def test_command_timeout_is_enforced_inside_and_outside(stub: Path) -> None:
    env = await backend().start({"instance_id": "a__b-1"})
    with anyio.fail_after(20):
        res = await env.run("sleep 30", 1)
    assert res.returncode != 0
    await env.close()


async def test_resource_session_closes_its_container(stub: Path) -> None:
    await SWE.setup({"backend": "docker", "engine_binary": str(STUB), "shell_setup": ""})
    try:
        inst = SWE()
        await inst.seed({"instance_id": "a__b-1"})
        out = await inst.call_tool("bash", '{"command": "echo hi", "extra": 1}')
        assert out == "<returncode>0</returncode>\n<output>\nhi\n</output>"
        await inst.close()
        assert [c[:2] for c in calls(stub)].count(["rm", "-f"]) == 1
    finally:
        await SWE.setup({})


async def test_the_next_worker_reaps_containers_of_killed_workers(
    stub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = os.uname().nodename
    listing = tmp_path / "ps.txt"
    listing.write_text(f"gym-swe-999999999-aa {host}:999999999\ngym-swe-{os.getpid()}-bb {host}:{os.getpid()}\n")
    monkeypatch.setenv("STUB_ENGINE_PS", str(listing))
    assert await backend().reap_orphans() == ["gym-swe-999999999-aa"]
    assert calls(stub)[0][:2] == ["ps", "-a"] and calls(stub)[1:] == [["rm", "-f", "gym-swe-999999999-aa"]]
