"""Container backends: command construction (no daemon needed), and their lifecycle on a real Docker engine
(the one ``DOCKER_HOST`` names, ``.ci/docker.sh start``; without one these skip with one line)."""

from __future__ import annotations

import os
import socket

import anyio
import pytest

from gym_runtime import testing
from gym_runtime.resources.swe import SWE, SWEOptions, make_backend
from gym_runtime.resources.swe.containers import OWNER_LABEL, ContainerCommands, swe_image
from gym_runtime.resources.swe.environments import ContainerBackend, EnvironmentError_
from gym_runtime.sandboxes.engine_http import Engine
from tests import differential

DOCKER = "/usr/bin/docker"  # Debian's CLI for its 20.10 engine, not whatever `docker` is first on PATH


def swe_gym_rows() -> list[dict]:
    return testing.read_jsonl(differential.compat_dir("nemo_gym", "mini_swe_agent", "example.jsonl"))


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


# ------------------------------------------------------------------ lifecycle on a real engine


def backend(start_timeout_s: float = 120) -> ContainerBackend:
    cmds = ContainerCommands(binary=DOCKER, shell_setup="", memory="256m", cpus="1", pids_limit=128)
    return ContainerBackend(cmds, lifetime_s=300, start_timeout_s=start_timeout_s, max_output=4096)


async def ours(engine: Engine) -> set[str]:
    """The names of this process's SWE containers the engine still has (running or not)."""
    listed = await engine.containers({OWNER_LABEL: f"{socket.gethostname()}:{os.getpid()}"})
    return {n.lstrip("/") for c in listed for n in c.get("Names", [])}


async def test_start_run_close(engine: Engine, swe_demo_image: str) -> None:
    env = await backend().start({"instance_id": "a__b-1", "image_name": swe_demo_image})
    assert env.name in await ours(engine)
    res = await env.run("echo hello > f.txt && cat f.txt && pwd && cat calc.py | head -1", 30)
    assert res.returncode == 0 and res.output == "hello\n/testbed\ndef add(a, b):\n", res.output
    await env.write("dir/x.txt", "content")
    assert (await env.run("cat dir/x.txt", 30)).output == "content"
    await env.close()
    await env.close()  # idempotent
    assert env.name not in await ours(engine)
    with pytest.raises(EnvironmentError_):
        await env.run("true", 1)


async def test_a_failed_start_says_why_and_leaves_no_container(engine: Engine, swe_demo_image: str) -> None:
    with pytest.raises(EnvironmentError_, match="could not start gym-runtime/no-such-image:1"):
        await backend().start({"instance_id": "x", "image_name": "gym-runtime/no-such-image:1"})
    assert await ours(engine) == set()


async def test_a_cancelled_start_leaves_no_container(engine: Engine, swe_demo_image: str) -> None:
    """Cancelled while ``docker run`` is on its way: the container is removed whichever side of the create
    the cancellation fell on (the engine finishes a create whose client went away)."""
    for delay in (0.05, 0.3, 1.0):
        with anyio.move_on_after(delay):
            env = await backend().start({"instance_id": "x", "image_name": swe_demo_image})
            await env.close()
        with anyio.fail_after(60):
            while await ours(engine):
                await anyio.sleep(0.2)  # polls the engine's own answer, not a guess of how long it takes


async def test_command_timeout_is_enforced_inside_and_outside(engine: Engine, swe_demo_image: str) -> None:
    env = await backend().start({"instance_id": "a__b-1", "image_name": swe_demo_image})
    try:
        with anyio.fail_after(30):
            res = await env.run("sleep 30; echo done", 1)
        assert res.returncode != 0 and "done" not in res.output
        # the container's own main process is `sleep 300`; the command's `sleep 30` was killed inside it too
        procs = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
        listing = (await env.run(procs, 10)).output
        assert "sleep 300 \n" in listing and "sleep 30 \n" not in listing, listing
    finally:
        await env.close()


async def test_resource_session_closes_its_container(engine: Engine, swe_demo_image: str) -> None:
    await SWE.setup({"backend": "docker", "engine_binary": DOCKER, "shell_setup": ""})
    try:
        inst = SWE()
        await inst.seed({"instance_id": "a__b-1", "image_name": swe_demo_image})
        out = await inst.call_tool("bash", '{"command": "echo hi", "extra": 1}')
        assert out == "<returncode>0</returncode>\n<output>\nhi\n</output>"
        assert len(await ours(engine)) == 1
        await inst.close()
        assert await ours(engine) == set()
    finally:
        await SWE.setup({})


async def test_the_next_worker_reaps_containers_of_killed_workers(engine: Engine, swe_demo_image: str) -> None:
    host = socket.gethostname()
    dead = "gym-swe-999999999-aa"
    body = {"Image": swe_demo_image, "Cmd": ["sleep", "300"], "Labels": {OWNER_LABEL: f"{host}:999999999"}}
    body["HostConfig"] = {"NetworkMode": "none"}
    await engine.start(await engine.create(body, name=dead))
    live = await backend().start({"instance_id": "a__b-1", "image_name": swe_demo_image})
    try:
        assert await backend().reap_orphans() == [dead]
        left = {n.lstrip("/") for c in await engine.containers({OWNER_LABEL: None}) for n in c.get("Names", [])}
        assert dead not in left and live.name in left  # a live owner's container stays
    finally:
        await live.close()
