"""Storage limits: every stream has a default size limit, sized from measured message sizes, that starts on a
small disk; a full stream is one clear line for a command and a ``storage_full`` failure row for a worker.

Real nats-server (a small one: ``max_file_store``), real workers in this process, real ``gym-runtime``
subprocesses; the scripted policy is the only double.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from gym_runtime.config import config_from_dict, load_config, resolve_config
from gym_runtime.data import batches
from gym_runtime.data.collector import Collector
from gym_runtime.data.inputs import publish_rows
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.service.runner import drain, make_workers, selected, start_workers
from gym_runtime.transport import jetstream
from gym_runtime.transport.bus import Bus
from tests.cluster import LocalCluster
from tests.helpers import REPO, cli, put_batch, read_jsonl

WEATHER = REPO / "resources/weather/config.yaml"
WEATHER_ROWS = read_jsonl(REPO / "resources/weather/data/example.jsonl")


async def _limits(bus: Bus) -> dict[str, int]:
    await jetstream.ensure_streams(bus, ["weather_agent"])
    await jetstream.ensure_blob_stream(bus, "agent")
    await jetstream.ensure_kept_stream(bus)
    await batches._kv(bus)
    s = bus.subjects
    names = [
        s.tasks_stream,
        s.results_stream("weather_agent"),
        s.model_stream,
        s.blob_stream("agent"),
        s.kept_stream,
        "KV_GYM_BATCHES",
    ]
    out = {}
    for name in names:
        cfg = await jetstream.stream_config(bus, name)
        assert cfg is not None, name
        out[name] = cfg["max_bytes"]
    return out


async def test_every_stream_and_bucket_has_a_size_limit_by_default(bus: Bus) -> None:
    limits = await _limits(bus)
    assert all(size > 0 for size in limits.values()), limits  # was -1 (unbounded) for every one


async def test_the_defaults_admit_a_million_rollout_batch_measured_on_weather(bus: Bus, tmp_path: Path) -> None:
    """Tasks and results of a real weather batch, measured in the streams: a 1,000,000-rollout batch's
    tasks (published at once) and results fit the default limits."""
    repeats = 40
    n = repeats * len(WEATHER_ROWS)
    cfg = load_config(WEATHER, [])
    names = bus.subjects
    await publish_rows(bus, WEATHER_ROWS, batch="m", agents=["weather_agent"], repeats=repeats)
    task_bytes = (await jetstream.stream_config(bus, names.tasks_stream) or {})["bytes"] / n
    workers = make_workers(bus, resolve_config(cfg), selected(cfg, None))
    async with anyio.create_task_group() as tg:
        await start_workers(tg, workers)
        with anyio.fail_after(60):
            manifest = await put_batch(bus, "m", len(WEATHER_ROWS), repeats=repeats, agent="weather_agent")
            stats = await Collector(bus, manifest, tmp_path / "o.jsonl").run()
        await drain(workers, timeout=5)
        tg.cancel_scope.cancel()
    assert stats.rows == n
    result_bytes = (await jetstream.stream_config(bus, names.results_stream("weather_agent")) or {})["bytes"] / n
    limits = await _limits(bus)
    assert 300 < task_bytes < 2_000 and 800 < result_bytes < 4_000, (task_bytes, result_bytes)
    assert limits[names.tasks_stream] >= 1_000_000 * task_bytes * 2  # rows twice a weather row's size fit too
    assert limits[names.results_stream("weather_agent")] >= 1_000_000 * result_bytes * 2  # per agent


def small_server(tmp_path: Path, store: int) -> EmbeddedServer:
    return EmbeddedServer(store_dir=str(tmp_path / "js"), max_store=store)


async def test_defaults_start_on_a_small_disk_and_an_explicit_limit_it_cannot_hold_is_one_line(
    tmp_path: Path,
) -> None:
    """JetStream reserves every stream's max_bytes: the defaults (13 GiB together) are lowered to what a
    3 GiB server holds, so a plain run on a small laptop disk starts; a limit the user set is not lowered."""
    with small_server(tmp_path, 3 << 30) as srv:
        bus = await Bus.connect(srv.url, namespace="gym", telemetry=Telemetry(), name="t")
        try:
            limits = await _limits(bus)
            assert all(64 << 20 <= size <= 2 << 30 for size in limits.values()), limits
            assert sum(limits.values()) <= 3 << 30
            bus2 = Bus(bus.nc, namespace="other", telemetry=bus.telemetry)
            bus2.jetstream_config = config_from_dict({"jetstream": {"tasks_max_bytes": "5GB"}}).jetstream
            with pytest.raises(jetstream.JetStreamSetupError, match=r"cannot reserve jetstream\.tasks_max_bytes"):
                await jetstream.ensure_streams(bus2)
        finally:
            await bus.close()


async def test_streams_made_after_a_default_that_took_most_of_the_store_still_start(tmp_path: Path) -> None:
    """The task stream's default (2 GiB) fits a 2.2 GiB store whole and leaves ~200 MiB for every stream after
    it: each of those is lowered below the usual 64 MiB floor rather than refused, and the run starts (CI's disk
    once had this little free: ``run`` stopped at the kept stream)."""
    with small_server(tmp_path, (2 << 30) + (200 << 20)) as srv:
        bus = await Bus.connect(srv.url, namespace="gym", telemetry=Telemetry(), name="t")
        try:
            await jetstream.ensure_streams(bus, ["quiz_agent", "repair_agent"])
            await jetstream.ensure_kept_stream(bus)
            await jetstream.ensure_attempts_stream(bus)
            for role in ("agent", "env"):
                await jetstream.ensure_blob_stream(bus, role)
            limits = await _limits(bus)
            assert bus.subjects.kept_stream in limits, limits
            assert all(size >= 1 << 20 for size in limits.values()), limits
            assert sum(limits.values()) <= (2 << 30) + (200 << 20), limits
        finally:
            await bus.close()


async def test_streams_made_at_once_by_many_writers_on_a_store_too_small_for_their_defaults_all_start(
    tmp_path: Path,
) -> None:
    """Each agent's worker, the reader and the publisher make their streams at the same moment, each on its own
    connection. nats-server checks each against the reservations as they were, so together they may be accepted
    beyond what it holds; it then refuses every new stream and every update. CI's ``run`` of six agents once
    stopped so ("cannot reserve jetstream.kept_max_bytes"). And defaults that fit whole may leave too little for
    a stream made later: it takes room from a mostly empty one. Limits a user set are never lowered."""
    store = (30 << 30) + (300 << 20)  # 3/4 of the 40.4 GB CI's disk had free: less than the defaults below
    agents = [f"agent{i}" for i in range(8)]
    with small_server(tmp_path, store) as srv:
        buses = [await Bus.connect(srv.url, namespace="gym", telemetry=Telemetry(), name=f"t{i}") for i in range(12)]
        try:
            async with anyio.create_task_group() as tg:
                for i, agent in enumerate(agents):
                    tg.start_soon(jetstream.ensure_results_stream, buses[i], agent)
                tg.start_soon(jetstream.ensure_streams, buses[8])
                tg.start_soon(jetstream.ensure_kept_stream, buses[9])
                tg.start_soon(jetstream.ensure_attempts_stream, buses[10])
                for role in ("agent", "env", "model"):
                    tg.start_soon(jetstream.ensure_blob_stream, buses[11], role)
                tg.start_soon(batches._kv, buses[11])
            # later, one at a time: more agents than the store holds at even the smallest default
            late = [f"late{i}" for i in range(12)]
            for agent in late:
                await jetstream.ensure_results_stream(buses[0], agent)
            mine = Bus(buses[0].nc, namespace="gym", telemetry=buses[0].telemetry)
            mine.jetstream_config = config_from_dict({"jetstream": {"results_max_bytes": "3MB"}}).jetstream
            await jetstream.ensure_results_stream(mine, "set_by_user")
            await jetstream.ensure_results_stream(buses[1], "after_it")
            s = buses[0].subjects
            names = [s.results_stream(a) for a in [*agents, *late, "set_by_user", "after_it"]]
            names += [s.tasks_stream, s.model_stream, s.kept_stream, s.attempts_stream, "KV_GYM_BATCHES"]
            limits = {n: ((await jetstream.stream_config(buses[0], n)) or {}).get("max_bytes", 0) for n in names}
            assert all(size >= 1 << 20 for size in limits.values()), limits
            assert limits[s.results_stream("set_by_user")] == 3 << 20, limits
            account = json.loads((await buses[0].nc.request("$JS.API.INFO", b"", timeout=10)).data)
            assert account["reserved_storage"] <= store, (account["reserved_storage"] - store, limits)
        finally:
            for b in buses:
                await b.close()


async def test_a_default_a_cluster_cannot_place_is_lowered_and_an_explicit_one_is_one_line(tmp_path: Path) -> None:
    """A cluster refuses a limit no node can reserve with "no suitable peers for placement" (400, 10005), not a
    single server's err_code: the Compose recipe failed so on the kept stream's default on a fuller disk. A
    default is lowered there too; a limit the user set is one line. One stream each: a cluster places by its
    peers' last reported reservations, so how streams created in quick succession share a store depends on
    when those reports come (nats-server may over-commit, or refuse what has just been freed)."""
    store = 768 << 20  # below the kept stream's default (1 GiB)
    c = LocalCluster(tmp_path / "nats", size=3, max_store=store).start()
    try:
        bus = await Bus.connect(c.url, namespace="gym", telemetry=Telemetry(), name="t")
        try:
            bus.jetstream_config = config_from_dict({"jetstream": {"replicas": 3}}).jetstream
            await jetstream.ensure_kept_stream(bus)
            kept = await jetstream.stream_config(bus, bus.subjects.kept_stream)
            assert kept is not None and 256 << 20 <= kept["max_bytes"] <= 512 << 20, kept
            bus2 = Bus(bus.nc, namespace="other", telemetry=bus.telemetry)
            bus2.jetstream_config = config_from_dict({"jetstream": {"replicas": 3, "tasks_max_bytes": "1GB"}}).jetstream
            with pytest.raises(jetstream.JetStreamSetupError, match=r"cannot reserve jetstream\.tasks_max_bytes"):
                await jetstream.ensure_streams(bus2)
        finally:
            await bus.close()
    finally:
        c.stop()


@pytest.mark.parametrize("command", ["publish", "run"])
def test_a_full_task_stream_is_one_line_naming_the_key_exit_2(command: str, tmp_path: Path) -> None:
    """2,000 tasks of ~626 B into a 200 KB task stream (``run``'s workers drain it meanwhile, not fast enough)."""
    with EmbeddedServer(store_dir=str(tmp_path / "js")) as srv:
        how = ["--batch", "full", "-q"] if command == "publish" else ["-o", str(tmp_path / "o.jsonl"), "--no-progress"]
        res = cli(
            command,
            str(WEATHER),
            "-i",
            str(REPO / "resources/weather/data/example.jsonl"),
            "--repeats",
            "400",
            "--nats",
            srv.url,
            *how,
            "--set",
            "jetstream.tasks_max_bytes=200KB",
        )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    line = lines[0]
    assert line.startswith("gym-runtime: error: stream GYM_TASKS is full"), line
    assert "raise jetstream.tasks_max_bytes" in line
    stored = int(line.split("; ")[-1].split(" tasks of batch ")[0])
    assert 100 < stored < 2000  # ~626 B each in 200 KB: said, not silent


def run_full(tmp_path: Path, key: str, *sets: str, repeats: int = 1) -> tuple[Any, list[dict[str, Any]]]:
    """``gym-runtime run`` of the weather rows with ``--set``s; (the process, its rows), after
    checking that it printed no traceback and that every failure is a ``storage_full`` naming ``key``."""
    out = tmp_path / "o.jsonl"
    overrides = [x for kv in sets for x in ("--set", kv)]
    res = cli(
        "run",
        str(WEATHER),
        "-i",
        str(REPO / "resources/weather/data/example.jsonl"),
        "-o",
        str(out),
        "--repeats",
        str(repeats),
        "--no-progress",
        *overrides,
        timeout=180,
    )
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    rows = read_jsonl(out) if out.exists() else []
    failures = read_jsonl(tmp_path / "o_failures.jsonl")
    assert len(rows) + len(failures) == repeats * len(WEATHER_ROWS), res.stderr[-2000:]
    assert failures and {f["error_class"] for f in failures} == {"storage_full"}, failures[:1]
    assert all(f"raise jetstream.{key}" in f["error"] for f in failures)
    return res, rows


def test_a_full_blob_stream_makes_failure_rows_not_a_hang(tmp_path: Path) -> None:
    """Bodies over the max payload (9 MB each, several per rollout) fill a 40 MB blob stream: the rollouts
    that cannot store theirs end as ``storage_full`` failure rows naming the key; the command finishes, logs
    the cause a few times, not per rollout, and prints no traceback."""
    res, _ = run_full(
        tmp_path,
        "blobs_max_bytes",
        "resources.weather.server=tests.envs.big",
        "resources.weather.options.size=9000000",
        "jetstream.blobs_max_bytes=40MB",
    )
    assert res.returncode == 1  # rollouts failed (not a crash: 3, not a usage error: 2)
    assert res.stderr.count("storage") < 10, res.stderr[-3000:]  # the cause once per interval, not per rollout


def test_a_full_model_queue_fails_the_calls_it_refuses_as_storage_full(tmp_path: Path) -> None:
    """One slow model slot, 20 rollouts: calls wait in the model queue, which holds ~6 of them (4 KB).
    A refused call is a ``storage_full`` failure row at once (it was dropped silently before: a discard-old
    queue and an unacked publish); the others complete."""
    res, rows = run_full(
        tmp_path,
        "model_max_bytes",
        "models.policy.concurrency=1",
        "models.policy.delay_s=0.05",
        "jetstream.model_max_bytes=4KB",
        repeats=4,
    )
    assert rows and res.stderr.count("storage") < 10, res.stderr[-3000:]


def test_an_agents_full_results_stream_makes_its_slots_storage_full_rows(tmp_path: Path) -> None:
    """20 weather results (~1.8 KB each) into a 16 KB results stream of the agent's own: the stream refuses the
    rest (it never drops a stored result to make room), the worker says so in a line every 10 s, not per
    rollout, and ``run`` ends with every slot a row or a ``storage_full`` failure row naming the stream, exit 1.
    Before: a shared discard-old stream dropped the oldest results, which became ``lost`` rows."""
    res, rows = run_full(tmp_path, "results_max_bytes", "jetstream.results_max_bytes=16KB", repeats=4)
    assert res.returncode == 1, res.stderr[-3000:]
    failures = read_jsonl(tmp_path / "o_failures.jsonl")
    assert 0 < len(rows) < 20 and len(rows) + len(failures) == 20
    assert all("GYM_RESULTS_weather_agent" in f["error"] for f in failures), failures[0]
    assert res.stderr.count("result.not_stored") < 5, res.stderr[-3000:]
