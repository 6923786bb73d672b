"""A Ray cluster is one trust domain (issue 73, item 8): under ``start --ray`` each actor is handed its own entry's
credential alone, never ``admin.creds`` nor another role's, and the operator's node keeps the directory. On a real
local Ray cluster (three raylets) whose nodes were started with ``$GYM_AUTH_DIR`` naming the operator's whole
directory, as a node set up for ``start`` would be; a real ``server --secure`` bus.

Before: every worker was given ``--auth-dir`` of the operator's directory (every role's seed and ``admin.creds``
in it), so environment code in any worker, and any other job of the cluster, read them all there."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.security import AUTH_DIR_ENV, ensure_auth_dir
from tests.cluster import tasks_file
from tests.on_ray.cluster import collect, local_cluster, need_ray, once_each, publish, write_config

ray = need_ray()
from gym_runtime.placement.on_ray import OnRay  # noqa: E402  (after the skip: it imports ray)

OWN = {"agents.agent": "agent.creds", "models.policy": "model.creds", "resources.env": "resource.creds"}


@pytest.fixture(scope="module")
def trust(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The operator's ``server --secure`` directory: the CA's key, every role's seed and ``admin.creds``."""
    return ensure_auth_dir(tmp_path_factory.mktemp("operator") / "auth")


@pytest.fixture(scope="module")
def cluster(trust: Path) -> Iterator[Any]:
    os.environ[AUTH_DIR_ENV] = str(trust)  # what each node's Ray was started with (its raylet, its workers)
    try:
        with local_cluster([{"num_cpus": 0}, {"num_cpus": 2}, {"num_cpus": 2}]) as c:
            del os.environ[AUTH_DIR_ENV]  # (not this driver's commands: they are given --auth-dir)
            yield c
    finally:
        os.environ.pop(AUTH_DIR_ENV, None)


def _argv_env(pid: int) -> tuple[list[str], dict[str, str]]:
    """A process's command line and environment, as any process of its user reads them (``/proc``)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in e)
    return argv, env


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_each_actor_is_handed_only_its_own_roles_credential(cluster: Any, trust: Path, tmp_path: Path) -> None:
    """Each worker's ``--auth-dir`` is a directory of its own (0700) holding the CA and its role's seed alone, and
    gone with it; neither the worker nor its actor is pointed at the operator's directory (no ``--auth-dir`` of it;
    the worker no ``$GYM_AUTH_DIR``, though its node has one) or holds a seed in an argv, an environment or Ray's
    state; the workers serve a batch with what they were handed."""
    roles = {spec: {"num_cpus": 0.5} for spec in OWN}
    config = write_config(tmp_path, ray={"roles": roles})
    seeds = {p.name: p.read_bytes().strip().decode() for p in trust.glob("*.creds")}
    assert {"admin.creds", "publisher.creds", "sandbox.creds", *OWN.values()} <= set(seeds)
    with EmbeddedServer(store_dir=str(tmp_path / "js"), secure_dir=str(trust)) as srv:
        placed = OnRay(str(config), nats=srv.url, auth=ClientAuth(trust)).__enter__()
        dirs: list[Path] = []
        try:
            assert sorted(r.spec for r in placed.actors) == sorted(OWN)
            for r in placed.actors:
                assert r.pid is not None
                argv, env = _argv_env(r.pid)
                assert argv.count("--auth-dir") == 1, argv
                given = Path(argv[argv.index("--auth-dir") + 1])
                assert sorted(os.listdir(given)) == sorted(["ca.pem", OWN[r.spec]]), (r.spec, sorted(os.listdir(given)))
                assert (given / OWN[r.spec]).read_text().strip() == seeds[OWN[r.spec]]
                assert given.stat().st_mode & 0o077 == 0 and given != trust
                dirs.append(given)
                held = "\0".join(argv) + "\0" + "\0".join(f"{k}={v}" for k, v in env.items())
                assert AUTH_DIR_ENV not in env and str(trust) not in held, r.spec  # the node's variable not passed on
                assert [n for n, seed in seeds.items() if seed in held] == [], r.spec
                actor, actor_env = _argv_env(_parent(r.pid))  # (its environment is its node's: Ray's to set)
                held = "\0".join(actor) + "\0" + "\0".join(v for k, v in actor_env.items() if k != AUTH_DIR_ENV)
                assert str(trust) not in held and [n for n, seed in seeds.items() if seed in held] == [], r.spec
            state = str(ray._private.state.actors()) + str(ray.nodes())  # the GCS's actor table (no dashboard here)
            assert [n for n, seed in seeds.items() if seed in state] == []
            publish(config, srv.url, tasks_file(tmp_path, 8), "own", auth=trust)  # served with what they hold
            once_each(collect(srv.url, "own", tmp_path / "out.jsonl", timeout=120, auth=trust), 8)
        finally:
            placed.close()
    assert [d for d in dirs if d.exists()] == []  # each worker's credential went with it


def test_an_entry_without_its_own_credential_is_one_line_and_never_handed_admin(tmp_path: Path) -> None:
    """A directory holding ``admin.creds`` but not the model's: one line naming the file to copy, before Ray is
    asked for anything (``admin.creds`` would do for a worker started by hand; an actor is never handed it)."""
    from gym_runtime.errors import AuthError

    node = tmp_path / "node"
    node.mkdir()
    for name in ("ca.pem", "admin.creds", "agent.creds", "resource.creds"):
        (node / name).write_bytes((trust_dir(tmp_path) / name).read_bytes())
    config = write_config(tmp_path)
    with pytest.raises(AuthError, match=r"no model\.creds .*never handed admin\.creds"):
        OnRay(str(config), nats="tls://127.0.0.1:4222", auth=ClientAuth(node))


def trust_dir(tmp_path: Path) -> Path:
    return ensure_auth_dir(tmp_path / "auth")
