"""A sandbox worker whose engine lacks the fleet's base image and that cannot build it (no ``debootstrap``: a
worker in a Compose container, a Slurm node without it) stops at start with one line saying where to build it
(issue 57: it was an ``EngineError`` traceback). A real Podman service on an empty store of the test's own,
a real nats-server; the worker's ``PATH`` has no ``debootstrap`` and its image cache is empty."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_runtime.ops.nats_server import EmbeddedServer
from tests.podman import CONTAINERS_CONF, PODMAN, STORAGE_CONF


@pytest.fixture
def empty_podman(tmp_path: Path) -> Iterator[str]:
    """A ``podman system service`` on a store that holds no image (stopped after the test, by its PID)."""
    if not os.path.exists(PODMAN) or not shutil.which("runc"):
        pytest.skip(f"no Podman engine: {PODMAN} or runc is not installed (apt-get install podman)")
    here = tmp_path / "podman"
    (here / "tmp").mkdir(parents=True)
    (here / "containers.conf").write_text(CONTAINERS_CONF.format(dir=here, store=here / "store"))
    (here / "storage.conf").write_text(STORAGE_CONF.format(store=here / "store"))
    env = {
        **os.environ,
        "CONTAINERS_CONF": str(here / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(here / "storage.conf"),
    }
    sock = here / "podman.sock"
    with open(here / "service.log", "wb") as log:
        proc = subprocess.Popen(
            [PODMAN, "system", "service", "--time=0", f"unix://{sock}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=here,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not sock.exists():
                assert proc.poll() is None and time.monotonic() < deadline, (here / "service.log").read_text()
                time.sleep(0.1)
            yield f"unix://{sock}"
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            # the store's overlay mount outlives the service: unmounted, so the test's folder can go
            subprocess.run(["umount", "-l", str(here / "store" / "root" / "overlay")], capture_output=True, check=False)


def test_a_pool_whose_base_image_cannot_be_built_here_says_where_to_build_it(
    empty_podman: str, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"sandboxes:\n  box: {{backend: podman, engine: '{empty_podman}', image: base}}\n")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "debootstrap").exists())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{path}"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # no cached root file system to import either
    argv = ["start", str(cfg), "--only", "sandboxes.box", "--nats", nats_server.url]
    r = subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "gym-runtime: error: sandboxes.box: the base image is not in the podman engine and cannot be built here"
        " (debootstrap is not installed (apt-get install debootstrap; .ci/docker.sh does)): build it where"
        " debootstrap runs as root, `python -m gym_runtime.sandboxes.images` with DOCKER_HOST set to this engine's"
        " socket (docs/deployment.md)"
    )
    assert "Traceback" not in r.stderr
