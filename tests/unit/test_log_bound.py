"""``logs.bound``: the ids a scope binds are on every line logged inside it, and gone (or the outer scope's again)
after it, as structlog's own ``bind_contextvars`` and ``reset_contextvars`` leave them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog
from structlog.contextvars import bind_contextvars, get_contextvars, reset_contextvars

from gym_runtime.observability import logs


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_a_scope_binds_its_ids_and_restores_what_each_key_held(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("info")
    outer = bind_contextvars(batch="outer")
    try:
        with logs.bound(batch="b1", task_index=3, rollout_index=0, trace_id="abc"):
            assert get_contextvars() == {"batch": "b1", "task_index": 3, "rollout_index": 0, "trace_id": "abc"}
            with logs.bound(rollout_index=1):
                logs.get("t").info("inner")
            logs.get("t").info("after_inner")
        assert get_contextvars() == {"batch": "outer"}
    finally:
        reset_contextvars(**outer)
    assert get_contextvars() == {}
    err = capsys.readouterr().err
    inner, after = (line for line in err.splitlines() if '"event"' in line)
    assert '"batch": "b1"' in inner and '"rollout_index": 1' in inner and '"trace_id": "abc"' in inner
    assert '"rollout_index": 0' in after and '"task_index": 3' in after
