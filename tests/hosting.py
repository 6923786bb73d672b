"""What the hosted-environment tests share: a `start` child on its built environment, checked for ports; Harbor's
own package in an environment of its own (``harbor_python``)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gym_runtime.nemo_gym.hosting import env as hosting_env
from tests.helpers import REPO, cli


def catalogue_root(*build: str) -> Path:
    """The installed catalogue (nemo-gym's resources_servers) in the shared base layer, built if missing
    (``build``: what ``env build`` builds first); skips without a Python >= 3.13, unless GYM_REQUIRE_HOSTING=1."""
    try:
        hosting_env.find_python()
    except hosting_env.EnvError as e:
        if os.environ.get("GYM_REQUIRE_HOSTING") == "1":
            raise
        pytest.skip(f"hosting needs a Python >= 3.13: {e}")
    r = cli("env", "build", *build, timeout=900)
    assert r.returncode == 0, r.stderr
    return hosting_env.servers_root(
        next(p for p in hosting_env.cache_dir().glob("base-*") if (p / ".complete").is_file())
    )


def nemo_gym_python() -> str:
    """The interpreter of the shared base layer (nemo-gym ``NEMO_GYM_VERSION`` on a Python >= 3.13, as its
    metadata asks), built once and cached as the hosted servers' (CI builds it before the tests); skips without a
    Python >= 3.13, unless GYM_REQUIRE_HOSTING=1."""
    try:
        python = hosting_env.find_python()
    except hosting_env.EnvError as e:
        if os.environ.get("GYM_REQUIRE_HOSTING") == "1":
            raise
        pytest.skip(f"nemo-gym's own client needs a Python >= 3.13: {e}")
    base, _ = hosting_env.build_base(python, hosting_env.nemo_gym_version(), hosting_env.repo_root(), lambda _: None)
    return str(base / "bin" / "python")


HARBOR = "harbor==0.26.0"  # the Harbor whose verifier and reward parsing tests/test_harbor.py compares with ours
HARBOR_PYTHON_ENV = "GYM_HARBOR_PYTHON"  # an override: a Python >= 3.12 with harbor installed


def harbor_python() -> str:
    """A Python with ``HARBOR`` installed: ``$GYM_HARBOR_PYTHON``, else one built once beside the hosted layers
    (``envs/harbor-<hash>``, a venv of a Python >= 3.13 the hosted servers' search finds, as Harbor needs
    >= 3.12) and reused; one builder at a time (xdist workers wait on its lock), a half-built one built again."""
    given = os.environ.get(HARBOR_PYTHON_ENV)
    if given:
        return given
    base = hosting_env.find_python()
    key = hashlib.sha256(f"{base}\0{os.path.realpath(base)}\0{HARBOR}".encode()).hexdigest()[:16]
    root = hosting_env.cache_dir() / f"harbor-{key}"
    python = root / "bin" / "python"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".complete").is_file():
            shutil.rmtree(root, ignore_errors=True)
            subprocess.run([base, "-m", "venv", str(root)], check=True, timeout=300)
            pip = [str(python), "-m", "pip", "install", "--progress-bar", "off", HARBOR]
            r = subprocess.run(pip, capture_output=True, text=True, timeout=1800)
            assert r.returncode == 0, f"installing {HARBOR} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
            (root / ".complete").touch()
    return str(python)


def assert_hosted_worker_opens_no_port(config: Path, url: str, only: str) -> None:
    """`start --only ONLY` runs the hosted code in a process on its built layer's interpreter (a hosted agent's
    worker; a hosted server's guest, its worker on ours), and no process of it listens on a socket: their
    sockets (listed while they run) are loopback connections to the bus."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_runtime.cli", "start", str(config), "--nats", url, "--only", only],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        assert "workers ready" in proc.stdout.readline()
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        hosted = [p for p in tree if p.cmdline()[0].startswith(str(hosting_env.cache_dir()))]
        assert len(hosted) == 1, [p.cmdline() for p in tree]  # the built layer's interpreter runs its code
        socks = [s for p in tree for s in p.net_connections(kind="inet")]
        assert socks, "the worker holds its bus connection"
        assert not [s for s in socks if s.status == psutil.CONN_LISTEN]
        assert all(s.raddr and s.raddr.ip in ("127.0.0.1", "::1") for s in socks)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listeners_while_running(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 600
) -> tuple[subprocess.CompletedProcess[str], set[tuple[str, str, int]], set[str]]:
    """Run ``argv`` and list, every 0.2 s while it runs, the listening TCP sockets of its whole process tree
    (foreign processes it starts included): (the finished process, {(process name, ip, port)}, process names)."""
    import os
    import time

    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, **(env or {})}
    )
    seen: set[tuple[str, str, int]] = set()
    names: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.Error:
                break
            for p in tree:
                try:
                    names.add(p.name())
                    seen |= {
                        (p.name(), c.laddr.ip, c.laddr.port)
                        for c in p.net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN
                    }
                except psutil.Error:
                    continue
            time.sleep(0.2)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), seen, names
