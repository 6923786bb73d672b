"""A real Docker engine for the sandbox tests: the one ``DOCKER_HOST`` names (``.ci/docker.sh start``).

Without one the tests skip with one line; with ``GYM_REQUIRE_DOCKER=1`` (CI's first pass) that skip is a
failure. The base image is built once per machine (``gym_runtime.sandboxes.images``, cached by hash).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from gym_runtime.sandboxes.engine_http import Engine, EngineError, socket_of
from gym_runtime.sandboxes.images import ensure_base

REQUIRE_ENV = "GYM_REQUIRE_DOCKER"


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(f'no Docker engine: {reason} (eval "$(bash .ci/docker.sh start)")')


def docker_socket() -> str:
    """The engine's socket, or a skip (a failure under GYM_REQUIRE_DOCKER=1)."""
    host = os.environ.get("DOCKER_HOST", "")
    if not host:
        _unavailable("DOCKER_HOST is not set")
    path = socket_of(host)
    if not os.path.exists(path):
        _unavailable(f"{path} does not exist")
    return path


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    path = docker_socket()
    async with Engine(path) as e:
        try:
            await e.ping()
        except EngineError as exc:
            _unavailable(str(exc))
        yield e


@pytest.fixture
async def base_image(engine: Engine) -> str:
    return await ensure_base(engine)
