"""Exactly one row per task×repeat once the servers' duplicate window has passed.

The task and result streams remember a message id only for ``jetstream.duplicate_window_s`` (120 s by
default, 1 s here): a rollout run again later (the same batch published again, a task redelivered
after a long call) stores its result a second time. Every reader of the results — ``collect``, a
client's batch, ``status --batch`` — keeps the first result stored for each slot and drops the rest.
Real nats-server, real workers; the scripted policy is the LLM.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
import msgspec
import pytest

from gym_runtime import Client
from gym_runtime.config import ResolvedConfig, config_from_dict, resolve_config
from gym_runtime.data.batches import get_manifest
from gym_runtime.data.inputs import publish_rows
from gym_runtime.errors import StorageFull
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.status import BatchWatch
from gym_runtime.service.batches import collect_batch, publish_batch
from gym_runtime.service.runner import make_workers, run_batch, selected, start_workers
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.jetstream import ensure_streams
from gym_runtime.transport.subjects import Subjects
from tests.helpers import REPO, ROWS, read_jsonl, weather_config

WINDOW_S = 1.0


def windowed() -> ResolvedConfig:
    """The weather config with a duplicate window of ``WINDOW_S``."""
    cfg = weather_config()
    return resolve_config(
        msgspec.structs.replace(cfg, jetstream=msgspec.structs.replace(cfg.jetstream, duplicate_window_s=WINDOW_S))
    )


REPEATS = 2


async def test_a_batch_run_again_after_the_window_is_stored_twice_and_read_once(nats_server, tmp_path: Path) -> None:
    """The batch runs, then (the window passed) every rollout runs again: the stream holds each result
    twice, and ``collect`` writes the same file, each second result counted a duplicate; ``status
    --batch`` counts each slot once."""
    cfg = windowed()
    data = REPO / "resources/weather/data/example.jsonl"
    expected = len(ROWS) * REPEATS
    first = tmp_path / "first.jsonl"
    res = await run_batch(
        cfg, nats_server.url, input_path=data, out=first, telemetry=Telemetry(), batch="w", repeats=REPEATS
    )
    assert (res.stats.rows, res.stats.failures, res.stats.duplicates) == (expected, 0, 0)
    await anyio.sleep(WINDOW_S + 0.5)

    bus = await Bus.connect(
        nats_server.url, namespace="gym", telemetry=Telemetry(), name="test", jetstream=cfg.jetstream
    )
    results = Subjects("gym").results_stream("weather_agent")
    try:
        async with anyio.create_task_group() as tg:
            await start_workers(tg, make_workers(bus, cfg, selected(cfg, None)))
            # the same tasks under the same ids, past the window: each runs again and stores its result again,
            # as a task does that is redelivered after a long call whose result was stored but not acked
            await publish_rows(
                bus,
                ROWS,
                batch="w",
                agents=list(cfg.agents),
                repeats=REPEATS,
                task_fields=lambda a: {"fingerprint": cfg.fingerprints[("agent", a)]},
            )
            with anyio.fail_after(60):
                while (await bus.js.stream_info(results)).state.messages < 2 * expected:
                    await anyio.sleep(0.1)
            tg.cancel_scope.cancel()
        info = await bus.js.stream_info(results)
        assert info.config.duplicate_window == WINDOW_S
        assert info.state.messages == 2 * expected  # the server kept both runs' results

        again = await collect_batch(bus, "w", tmp_path / "again.jsonl")
        # every slot once; the second copies handled before the last slot filled count as duplicates: how
        # many depends on how the reader's pulls split the stream (it stops once every slot has its row: all
        # 10 read in one pull serially, 8 of 10 once at -n 4), never a row twice
        assert (again.rows, again.failures) == (expected, 0)
        assert again.duplicates <= expected
        assert read_jsonl(tmp_path / "again.jsonl") == read_jsonl(first)

        async with anyio.create_task_group() as tg:
            watch = await BatchWatch.open(bus, "w", tg)
            with anyio.fail_after(20):
                while watch.snapshot()["done"] < expected:
                    await anyio.sleep(0.1)
            await anyio.sleep(0.5)  # the duplicates read too: still one per slot (a span: load only stretches it)
            snap = watch.snapshot()
            assert (snap["done"], snap["failed"], snap["pending"]) == (expected, 0, 0)
            tg.cancel_scope.cancel()
    finally:
        await bus.close()


async def test_a_client_creates_the_streams_with_its_configs_settings(nats_server) -> None:
    """Before: ``Client`` connected without the config's ``jetstream:``, so streams it created first had
    the defaults (window, replicas, sizes) whatever the config said."""
    cfg = windowed()
    async with Client(cfg, nats=nats_server.url, workers=False) as client:
        for stream in (Subjects("gym").tasks_stream, Subjects("gym").results_stream("weather_agent")):
            info = await client.bus.js.stream_info(stream)
            assert info.config.duplicate_window == WINDOW_S


async def test_a_publish_run_again_after_the_window_adds_only_what_it_had_not_stored(nats_server) -> None:
    """The task stream takes 5 of 20 tasks and refuses the rest; the operator raises its limit and, the
    window long passed, runs the same publish again: the stream holds each of the 20 tasks once. A
    third run adds nothing. Before: only the server's memory of ids kept the second run from storing
    the first 5 again, so past the window they ran twice."""
    cfg = windowed()
    data = REPO / "resources/weather/data/example.jsonl"
    tasks = Subjects("gym").tasks_stream
    bus = await Bus.connect(
        nats_server.url, namespace="gym", telemetry=Telemetry(), name="test", jetstream=cfg.jetstream
    )
    try:
        await ensure_streams(bus)
        info = await bus.js.stream_info(tasks)
        await bus.js.update_stream(dataclasses.replace(info.config, max_msgs=5))
        with pytest.raises(StorageFull, match="; 5 tasks of batch p were stored"):
            await publish_batch(bus, cfg, data, batch="p", repeats=4)
        manifest = await get_manifest(bus, "p")
        assert manifest is not None and (manifest.stored, manifest.published) == (5, False)

        await anyio.sleep(WINDOW_S + 0.5)
        info = await bus.js.stream_info(tasks)
        await bus.js.update_stream(dataclasses.replace(info.config, max_msgs=-1))
        manifest = await publish_batch(bus, cfg, data, batch="p", repeats=4)
        assert (manifest.stored, manifest.published) == (20, True)
        await anyio.sleep(WINDOW_S + 0.5)
        await publish_batch(bus, cfg, data, batch="p", repeats=4)

        info = await bus.js.stream_info(tasks)
        ids = [(await bus.js.get_msg(tasks, seq)).headers["Nats-Msg-Id"] for seq in range(1, info.state.last_seq + 1)]
        assert sorted(ids) == sorted(f"p:{t}:{r}" for t in range(len(ROWS)) for r in range(4))
    finally:
        await bus.close()


async def test_a_retention_shorter_than_the_window_caps_it(nats_server) -> None:
    """``max_age_s: 60``: the streams are created with a 60 s window (the server refuses one longer than
    the retention). Before: the fixed one-hour window made any ``max_age_s`` under 3600 a setup error."""
    jetstream = config_from_dict({"jetstream": {"max_age_s": 60}}).jetstream
    bus = await Bus.connect(nats_server.url, namespace="gym", telemetry=Telemetry(), name="test", jetstream=jetstream)
    try:
        await ensure_streams(bus, ["a"])
        for stream in (Subjects("gym").tasks_stream, Subjects("gym").results_stream("a")):
            info = await bus.js.stream_info(stream)
            assert (info.config.duplicate_window, info.config.max_age) == (60.0, 60.0)
    finally:
        await bus.close()
