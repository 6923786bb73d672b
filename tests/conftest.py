"""Fixtures the scenario tests share (the root conftest.py holds the plain nats-server and bus)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.security import ROLES
from gym_runtime.transport.bus import Bus
from tests.docker import base_image, engine  # noqa: F401  (fixtures: a real Docker engine, or a skip)
from tests.helpers import connect_as, secured_server
from tests.podman import podman_base, podman_engine, podman_socket  # noqa: F401  (fixtures: Podman, or a skip)
from tests.swe_demo import swe_demo_image  # noqa: F401  (fixture: the SWE demo task's image)

# The Docker fixtures are imported here, not named in the root conftest's pytest_plugins: a project
# scaffolded inside this repository (`gym-runtime init`) has a `tests` package of its own, which that
# name would resolve to (tests/e2e/test_init.py runs one).


@pytest.fixture
def synced_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A nats-server with the default durability (sync before acknowledging): for tests that kill workers
    and count what was acknowledged (the root ``nats_server`` syncs on an interval, for speed)."""
    with EmbeddedServer(store_dir=str(tmp_path / "js")) as srv:
        yield srv


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, Path]]:
    """A ``server --secure`` server and its trust directory."""
    with secured_server(tmp_path) as (srv, auth):
        yield srv, auth


@pytest.fixture
async def buses(secured: tuple[EmbeddedServer, Path]) -> AsyncIterator[dict[str, Bus]]:
    """One bus per role on the secured server, each with that role's credentials."""
    srv, auth = secured
    out: dict[str, Bus] = {}
    try:
        for role in ROLES:
            out[role] = await connect_as(srv, auth, role)
        yield out
    finally:
        for b in out.values():
            await b.close()
