"""What a sandbox says when an author's call cannot be done, on a real Docker engine through sandbox workers on a
real nats-server: a program missing from the image is named (not the ``timeout`` every exec runs under), a write
to the read-only root says where to write instead, and a sandbox at its background-process cap says what to do."""

from __future__ import annotations

import time
import uuid

import pytest

from gym_runtime.errors import Failure
from gym_runtime.messages import EXEC_FIELDS, SandboxReply
from gym_runtime.sandboxes.client import Sandboxes, _result
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.sandboxes.spec import ExecResult
from gym_runtime.transport.bus import Bus
from gym_runtime.workers.sandbox_worker import MAX_PROCESSES
from tests.test_sandbox_worker import fleet


@pytest.fixture
def pool() -> str:
    return f"g{uuid.uuid4().hex[:8]}"


async def test_a_missing_program_the_read_only_root_and_the_process_cap_say_what_to_do(
    bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        await worker()
        boxes = Sandboxes(bus, pool, lease="m:0:0", deadline=time.time() + 300)
        async with boxes.sandbox() as box:
            r = await box.exec(["no-such-program", "--version"])
            assert r.exit_code == 127 and r.stderr.decode().startswith("no-such-program: "), r
            assert b"timeout" not in r.stderr, r
            with pytest.raises(Failure) as e:
                await box.write("/etc/motd", "hello")
            assert "write under /work, /tmp or /root, or give the pool `rootfs: writable`" in str(e.value)
            for _ in range(MAX_PROCESSES):
                await box.spawn(["sleep", "300"])
            with pytest.raises(Failure) as e:
                await box.spawn(["sleep", "300"])
            assert "wait for or kill one first" in str(e.value), e.value


def test_an_exec_reply_carries_every_field_of_its_result() -> None:
    """``SandboxReply.of_exec`` copies ``EXEC_FIELDS`` and the client reads them back: a field added to the
    author's ``ExecResult`` and not to the reply would be lost on the way."""
    assert ExecResult.__struct_fields__ == EXEC_FIELDS
    r = ExecResult(exit_code=3, stdout=b"o", stderr=b"e", truncated=True, timed_out=True, duration_s=1.5)
    assert _result(SandboxReply.of_exec("box", r)) == r
