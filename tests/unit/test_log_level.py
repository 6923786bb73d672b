"""The level a worker hands its guest process (``logs.level``), whatever set structlog up in this process.

Found in a pre-check: a test had left structlog on stdlib's ``BoundLogger`` (whose ``get_effective_level``
reads its instance), and every guest spawned after it in that xdist worker failed to start.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog

from gym_runtime.observability import logs


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.mark.parametrize("level", ["debug", "info", "warning", "error"])
def test_the_configured_level_is_the_guests(level: str) -> None:
    logs.configure(level)
    assert logs.level() == level


def test_another_set_up_or_none_is_warning() -> None:
    structlog.configure(wrapper_class=structlog.stdlib.BoundLogger)
    assert logs.level() == "warning"
    structlog.reset_defaults()
    assert logs.level() == "warning"
