"""Fixtures the scenario tests share (the root conftest.py holds the plain nats-server and bus)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.credentials import ClientAuth
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.ops.security import ROLES
from gym_runtime.transport.bus import Bus


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, Path]]:
    """A ``server --secure`` server and its trust directory."""
    auth = tmp_path / "auth"
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"), secure_dir=str(auth))
    srv.start()
    try:
        yield srv, auth
    finally:
        srv.stop()


@pytest.fixture
async def buses(secured: tuple[EmbeddedServer, Path]) -> AsyncIterator[dict[str, Bus]]:
    """One bus per role on the secured server, each with that role's credentials."""
    srv, auth = secured
    out: dict[str, Bus] = {}
    try:
        for role in ROLES:
            out[role] = await Bus.connect(
                srv.url,
                namespace="gym",
                telemetry=Telemetry(),
                name=f"t-{role}",
                auth=ClientAuth(auth),
                role=role,
                initial_timeout=5,
            )
        yield out
    finally:
        for b in out.values():
            await b.close()
