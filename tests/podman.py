"""A real Podman engine for the sandbox tests: ``podman system service`` on a socket of the test run's own,
with a ``containers.conf`` and ``storage.conf`` the tests own (no network: ``netns="none"``; cgroupfs;
events to a file; runc, as crun 1.8 refuses these machines' hybrid cgroups), stopped by its PID.

Without ``podman`` the tests skip with one line; with ``GYM_REQUIRE_PODMAN=1`` that skip is a failure.
Images live under ``$GYM_PODMAN_DIR`` (default ``/var/tmp/gym-runtime-podman``), so the base image is
imported once per machine.

**Why the state and temporary directories are the store's own** (``static_dir``, ``tmp_dir``). Podman keeps the
paths its database was made with and uses them over a ``containers.conf``'s: the store's first database had kept
the temporary directory of the test run that made it, under pytest's ``/tmp/pytest-of-*``, which any later pytest
run deletes as an old one. Every Podman process found its ``alive`` file gone then, and the first to come (a
stopping container's ``container cleanup``) *refreshed* the store: every container shown as ``created``, not
running ("can only create exec sessions on running containers"), and its exit files gone ("timed out waiting for
file .../exits/ID"). A database of its own (``static_dir``), made with a directory of the store's as its
temporary one, which no pytest run deletes, does not meet that.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest

from gym_runtime.sandboxes.engine_http import Engine, EngineError
from gym_runtime.sandboxes.images import ensure_base

REQUIRE_ENV = "GYM_REQUIRE_PODMAN"
PODMAN = "/usr/bin/podman"

CONTAINERS_CONF = """[containers]
netns = "none"
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{dir}/events.log"
tmp_dir = "{store}/tmp"
static_dir = "{store}/state"
"""
STORAGE_CONF = """[storage]
driver = "overlay"
graphroot = "{store}/root"
runroot = "{store}/run"
"""


def podman_store() -> Path:
    return Path(os.environ.get("GYM_PODMAN_DIR", "/var/tmp/gym-runtime-podman"))


@contextmanager
def store_to_ourselves() -> Iterator[Path]:
    """The tests' Podman store, held by one Podman service of this machine's test runs at a time (an flock on it,
    waited for). Services side by side on one store flaked under load: containers shown as "not running" to the
    other service, image listings and restarts failing mid-removal; one at a time, they do not meet."""
    store = podman_store()
    store.mkdir(parents=True, exist_ok=True)
    with open(store / ".tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield store
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(f"no Podman engine: {reason} (apt-get install podman)")


@pytest.fixture(scope="module")
def podman_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The socket of a ``podman system service`` started for this test run (stopped after it, by PID)."""
    if not os.path.exists(PODMAN) or not shutil.which("runc"):
        _unavailable(f"{PODMAN} or runc is not installed")
    here = tmp_path_factory.mktemp("podman")
    with store_to_ourselves() as store:
        yield from _service(here, store)


def _service(here: Path, store: Path) -> Iterator[str]:
    (here / "containers.conf").write_text(CONTAINERS_CONF.format(dir=here, store=store))
    (here / "storage.conf").write_text(STORAGE_CONF.format(store=store))
    env = {
        **os.environ,
        "CONTAINERS_CONF": str(here / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(here / "storage.conf"),
    }
    sock = here / "podman.sock"
    log = open(here / "service.log", "wb")  # noqa: SIM115 (the service's, closed after it)
    proc = subprocess.Popen(
        [PODMAN, "system", "service", "--time=0", f"unix://{sock}"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=here,  # conmon drops an empty `oom` file in its working directory after an OOM kill
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                _unavailable(f"podman system service did not start: {(here / 'service.log').read_text()[-300:]}")
            time.sleep(0.1)
        yield str(sock)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
async def podman_engine(podman_socket: str) -> AsyncIterator[Engine]:
    async with Engine(podman_socket) as e:
        deadline = time.monotonic() + 30
        while True:
            try:
                await e.ping()
                break
            except EngineError as exc:
                if time.monotonic() > deadline:
                    _unavailable(f"podman does not answer: {exc}")
                await anyio.sleep(0.2)
        yield e


@pytest.fixture
async def podman_base(podman_engine: Engine) -> str:
    return await ensure_base(podman_engine)


# The Docker cases' fixtures, here on Podman: a module that runs them imports these four (the conftest does not,
# so the Docker modules keep theirs).


@pytest.fixture
def engine(podman_engine: Engine) -> Engine:  # the Docker tests' engine, here Podman's
    return podman_engine


@pytest.fixture
def base_image(podman_base: str) -> str:
    return podman_base


@pytest.fixture
def pool() -> str:
    return f"p{uuid.uuid4().hex[:8]}"


@pytest.fixture
def backend_name() -> str:
    return "podman"
