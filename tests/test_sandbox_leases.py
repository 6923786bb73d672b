"""A sandbox id is not a key to the sandbox (issue 73 item 3), on a real nats-server and a real Docker engine, in
process: every operation proves the lease that holds the sandbox, and one that does not is refused with the same
answer as an id nobody holds, so a caller that read an id (from a checkpoint, a log) can neither drive, read,
plant, restart, close nor take up another rollout's sandbox. A lease is random, and no log line or container
label carries it."""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable

import pytest

from gym_runtime.errors import Failure
from gym_runtime.messages import SandboxSpec
from gym_runtime.sandboxes.client import Sandbox, Sandboxes
from gym_runtime.sandboxes.engine_api import POOL
from gym_runtime.sandboxes.engine_http import Engine
from gym_runtime.transport.bus import Bus
from tests.test_sandbox_worker import fleet, pool, wait_for

__all__ = ["pool"]  # the fixture

SECRET = "the-first-rollouts-secret-5d1e"

# what a caller holding only a sandbox's id tries, each an operation of the author's API
TRIES: dict[str, Callable[[Sandbox], Awaitable[object]]] = {
    "exec": lambda b: b.exec("cat secret.txt"),
    "read": lambda b: b.read("secret.txt"),
    "write": lambda b: b.write("planted.txt", "planted"),
    "spawn": lambda b: b.spawn("touch spawned.txt"),
    "restart": lambda b: b.restart(),
}


def lease(bus: Bus, pool: str, key: str) -> Sandboxes:
    return Sandboxes(bus, pool, lease=key, deadline=time.time() + 300)


async def refusal(do: Callable[[Sandbox], Awaitable[object]], box: Sandbox) -> str:
    """The message a refused operation answers, the sandbox's own id taken out of it."""
    with pytest.raises(Failure) as refused:
        await do(box)
    assert refused.value.info.error_class == "tool_error" and not refused.value.info.retryable
    return refused.value.info.message.replace(box.id[:12], "<id>")


async def test_a_caller_with_a_sandboxs_id_but_not_its_lease_can_neither_drive_read_nor_close_it(
    bus: Bus, engine: Engine, base_image: str, pool: str
) -> None:
    async with fleet(bus, engine, pool) as worker:
        w = await worker(lease_grace_s=60)
        mine = lease(bus, pool, secrets.token_hex(16))
        box = await mine.create(SandboxSpec(restartable=True))
        await box.write("secret.txt", SECRET)
        running = await box.spawn("sleep 600")  # a restart would end it
        [handle] = mine.handles()  # what a checkpoint carries: the id and the worker's address, not the lease
        for thief_lease in (secrets.token_hex(16), "", "b1:0:0"):
            thief = lease(bus, pool, thief_lease)
            stolen = Sandbox(thief, handle.sandbox, handle.address, handle.spec)
            nobodys = Sandbox(thief, secrets.token_hex(32), handle.address, handle.spec)  # an id no one holds
            for op, do in TRIES.items():
                said = await refusal(do, stolen)
                assert said == await refusal(do, nobodys), op  # the answer does not say whether the id exists
                assert SECRET not in said
            await stolen.close()  # answered as a close of an id nobody holds: it ends nothing
            thief.take_up([handle])
            assert not await thief.reattach()
        # the sandbox is as its holder left it: there, its file unread and alone, its process running
        assert [c["Id"] for c in await engine.containers({POOL: f"gym.{pool}"})] == [box.id]
        assert (await box.exec("cat secret.txt; ls")).stdout == f"{SECRET}secret.txt\n".encode()
        assert (await running.poll()).exit_code is None
        assert w.stats()["sandboxes"] == 1
        await mine.close_all()
        assert await engine.containers({POOL: f"gym.{pool}"}) == []


async def test_a_lease_is_random_and_never_in_a_log_line_or_a_container_label(
    bus: Bus, engine: Engine, base_image: str, pool: str, capfd: pytest.CaptureFixture[str]
) -> None:
    async with fleet(bus, engine, pool) as worker:
        await worker(lease_grace_s=4, reap_interval_s=0.3)
        first, second = Sandboxes(bus, pool), Sandboxes(bus, pool)
        assert first.lease != second.lease and len(bytes.fromhex(first.lease)) >= 16  # 128 random bits
        box = await first.create(SandboxSpec())
        resumed = Sandboxes(bus, pool, lease=first.lease)  # a resumed attempt: the lease its checkpoint kept
        resumed.take_up(first.handles())
        assert await resumed.reattach()  # logged as reattached
        gone = await second.create(SandboxSpec())
        labels = str([c["Labels"] for c in await engine.containers({POOL: f"gym.{pool}"})])
        second.let_go()  # its holder falls silent: its sandbox ends after the grace (logged)

        async def only_box() -> bool:
            return [c["Id"] for c in await engine.containers({POOL: f"gym.{pool}"})] == [box.id]

        await wait_for(only_box, timeout=60)
        first.let_go()  # the resumed attempt holds it now
        await resumed.close_all()
        assert gone.id != box.id
    logged = capfd.readouterr()
    said = logged.out + logged.err
    assert "sandbox.reattached" in said and "sandbox.holder_gone" in said
    for secret in (first.lease, second.lease):
        assert secret not in said
        assert secret not in labels
