"""W3C trace context with no exporter configured: every message a rollout sends carries its task's
``traceparent``, so a collector downstream can join a trace; malformed headers start a fresh trace.

Real nats-server and workers; a spy connection reads the headers of every message on the bus.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import nats

from gym_runtime.config import load_config, resolve_config
from gym_runtime.observability import tracing
from gym_runtime.observability.tracing import Telemetry
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.service.runner import run_batch
from tests.helpers import REPO

WEATHER = REPO / "resources/weather/config.yaml"
ROWS = REPO / "resources/weather/data/example.jsonl"


async def test_every_message_of_a_rollout_carries_its_task_trace(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    spy = await nats.connect(nats_server.url)
    seen: list[tuple[str, str]] = []  # (subject, traceparent)

    async def record(msg) -> None:  # type: ignore[no-untyped-def]
        tp = (msg.headers or {}).get("traceparent")
        if tp is not None:
            seen.append((msg.subject, tp))

    await spy.subscribe("gym.>", cb=record)
    await spy.subscribe("_INBOX.>", cb=record)  # replies
    await spy.flush()
    result = await run_batch(
        resolve_config(load_config(WEATHER)),
        nats_server.url,
        input_path=ROWS,
        out=tmp_path / "o.jsonl",
        telemetry=Telemetry(),
        limit=3,
    )
    await spy.flush()
    await spy.close()
    assert result.stats.rows == 3 and result.stats.failures == 0

    tasks = {tp[3:35] for subject, tp in seen if subject.startswith("gym.task.")}
    assert len(tasks) == 3  # one fresh trace per task
    by_trace: dict[str, set[str]] = defaultdict(set)
    for subject, tp in seen:
        assert len(tp) == 55 and tp.startswith("00-") and tp == tp.lower(), tp
        by_trace[tp[3:35]].add(subject.split(".")[1] if subject.startswith("gym.") else "reply")
    assert set(by_trace) == tasks, "a message carried a trace no task started"
    for kinds in by_trace.values():  # the rollout's seed, model calls, verify, replies and result
        assert {"task", "res", "call", "result", "reply"} <= kinds, kinds


def carried_on(tel: Telemetry, incoming: str) -> str:
    """The ``traceparent`` a handler of a message with ``incoming`` puts on what it sends."""
    with tel.span("handler", parent=tel.extract({"traceparent": incoming})):
        return tel.inject({})["traceparent"]


def test_malformed_or_invalid_traceparent_is_not_carried_on() -> None:
    tel = Telemetry()
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert carried_on(tel, good) == good
    assert carried_on(tel, good.upper()) == good  # normalized
    with tel.span("handler", parent=tel.extract({"traceparent": good})):
        assert tel.current_ids() == ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    for bad in (
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g",  # not hex
        "00-0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331-01",  # wrong separator
        good + "0",
        "",
    ):
        fresh = carried_on(tel, bad)  # a trace of its own
        assert len(fresh) == 55 and "0af7651916cd43dd8448eb211c80319c" not in fresh, (bad, fresh)


def test_a_header_checked_again_gets_the_same_answer_and_the_checks_kept_are_bounded() -> None:
    """A rollout's messages carry one ``traceparent``, checked once and remembered (``tracing._CHECKED``): each
    answer is the first one's, and no more than ``CHECKED_KEPT`` headers are kept, however many come."""
    tel = Telemetry()
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    bad = "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for _ in range(3):
        assert tel.extract({"traceparent": good}) == good
        assert tel.extract({"traceparent": good.upper()}) == good
        assert tel.extract({"traceparent": bad}) is None
    for i in range(tracing.CHECKED_KEPT + 10):
        assert (
            tel.extract({"traceparent": f"00-{i + 1:032x}-b7ad6b7169203331-01"})
            == f"00-{i + 1:032x}-b7ad6b7169203331-01"
        )
    assert len(tracing._CHECKED) <= tracing.CHECKED_KEPT
    assert tel.extract({"traceparent": good.upper()}) == good and tel.extract({"traceparent": bad}) is None
