"""Acknowledged means on disk: the servers gym-runtime starts sync every write before acknowledging it,
unless the config or ``server --sync`` asks for nats-server's 2-minute interval."""

from __future__ import annotations

import json
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest

from gym_runtime import SyncClient
from gym_runtime.config import load_config
from gym_runtime.errors import ConfigError
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import KV, kv_bucket
from tests.cluster import stream_messages
from tests.helpers import ROWS, WEATHER
from tests.pools import publish_results


def _sync_always(srv: EmbeddedServer) -> bool:
    assert srv.monitor_url is not None
    with urllib.request.urlopen(f"{srv.monitor_url}/varz", timeout=5) as r:
        return json.loads(r.read())["jetstream"]["config"].get("sync_always") is True


def test_a_started_server_syncs_before_acknowledging_unless_told_interval(tmp_path: Path) -> None:
    with EmbeddedServer(store_dir=str(tmp_path / "a"), http_port=0) as srv:
        assert _sync_always(srv)
    with EmbeddedServer(store_dir=str(tmp_path / "b"), http_port=0, sync="interval") as srv:
        assert not _sync_always(srv)


def test_a_temporary_store_deleted_at_stop_is_not_synced() -> None:
    """``run``'s and ``Client``'s embedded store: nothing reads it after a crash, so a sync would buy nothing."""
    with EmbeddedServer(http_port=0) as srv:
        assert not _sync_always(srv)


def test_jetstream_sync_is_read_from_the_config_and_a_wrong_value_names_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("jetstream: {sync: interval}\n")
    assert load_config(str(cfg)).jetstream.sync == "interval"
    cfg.write_text("jetstream: {sync: sometimes}\n")
    with pytest.raises(ConfigError, match="jetstream.sync"):
        load_config(str(cfg))


@pytest.mark.parametrize("sync", ["always", "interval"])
def test_a_killed_server_loses_nothing_with_either_setting(tmp_path: Path, sync: str) -> None:
    """A process kill is not a crash: the kernel holds every write the server made, synced or not."""
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"), sync=sync)
    srv.start()
    try:
        anyio.run(lambda: publish_results(srv.url, range(200), manifest=True))
        acked = stream_messages([srv.url], "GYM_RESULTS_agent")
        assert acked is not None and len(acked) == 200
        srv.kill()
        srv.start()
        assert stream_messages([srv.url], "GYM_RESULTS_agent") == acked
    finally:
        srv.stop()


def test_a_client_with_an_embedded_server_leaves_no_store_behind(tmp_path: Path, monkeypatch) -> None:
    """What a Client promises after a crash: nothing to resume. Its JetStream lives in a temporary
    directory that is removed when it exits; the rows it returned are all there is (keep them)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with SyncClient(WEATHER, nats="embedded") as c:
        assert [r["reward"] for r in c.submit(ROWS[:2]).gather()] == [1.0, 1.0]
        assert [p.name.startswith("gym-nats-") for p in tmp_path.iterdir()] == [True]
    assert not list(tmp_path.iterdir())


class Tried:
    """A bucket's real nats-py handle that says when a put has been tried once."""

    def __init__(self, kv: Any) -> None:
        self.kv, self.once = kv, anyio.Event()

    async def put(self, key: str, value: bytes) -> Any:
        try:
            return await self.kv.put(key, value)
        finally:
            self.once.set()


async def test_a_bucket_write_waits_for_its_stream_to_answer(bus: Bus) -> None:
    """CI's ``publish`` once died on "no response from stream" writing a batch's manifest into a cluster that had
    just started: the bucket's stream had no leader yet. Nobody received that write, so it is sent again."""
    handle = Tried(await bus.js.create_key_value(bucket="probe", history=1))
    await bus.js.delete_stream("KV_probe")  # no stream answers the bucket's subjects now
    kv = KV(handle, within_s=30)
    async with anyio.create_task_group() as tg:
        tg.start_soon(kv.put, "k", b"v")
        await handle.once.wait()
        await kv_bucket(bus, "probe")  # the stream answers again
    assert await (await kv_bucket(bus, "probe")).get("k") == b"v"
