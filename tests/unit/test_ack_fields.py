"""A delivery's count, stream sequence and time stored, read off its JetStream reply subject (``ack_fields``): the
same numbers nats-py's ``Msg.metadata`` gives for both forms the server writes, and nothing for other replies."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.subjects import AckFields, ack_fields, ack_reply

FIRST_FORM = "$JS.ACK.GYM_TASKS.agent_weather.3.1187.912.1764316800123456789.41"
SECOND_FORM = "$JS.ACK.hub.ACC7HASH.GYM_TASKS.agent_weather.1.55.54.1764316800000000001.0.x7Gq"
DOMAINLESS_SECOND_FORM = "$JS.ACK._.ACC7HASH.GYM_TASKS.agent_weather.12.9000.77.1764316800999999999.3"


@pytest.mark.parametrize("reply", [FIRST_FORM, SECOND_FORM, DOMAINLESS_SECOND_FORM])
def test_the_fields_are_what_nats_py_reads(reply: str) -> None:
    theirs = Msg.Metadata._from_reply(reply)
    ours = ack_fields(reply)
    assert ours is not None
    assert ours.delivered == theirs.num_delivered
    assert ours.stream_seq == theirs.sequence.stream
    assert ours.stored_ns / 1e9 == pytest.approx(theirs.timestamp.timestamp(), abs=1e-6)


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "_INBOX.agent._.abc.res.7",  # a core request's reply
        "$JS.ACK.GYM_TASKS.agent_weather.3.1187",  # too few tokens
        "$JS.ACK.GYM_TASKS.agent_weather.x.1187.912.1764316800123456789.41",  # not a number
        "$JS.API.CONSUMER.MSG.NEXT.GYM_TASKS.agent_weather.3.1187.912",
    ],
)
def test_any_other_reply_has_none(reply: str) -> None:
    assert ack_fields(reply) is None


class _Core:
    subject, data, headers = "gym.call.model.policy", b"", None

    def __init__(self, reply: str) -> None:
        self.reply = reply

    async def ack(self) -> None: ...

    async def nak(self, delay: float | None = None) -> None: ...

    async def term(self) -> None: ...

    async def in_progress(self) -> None: ...


def test_a_delivery_reads_them_and_a_core_message_has_the_defaults() -> None:
    stored = Delivery(_Core(ack_reply("GYM_TASKS", "c", AckFields(4, 77, 1_764_316_800_500_000_000))))
    assert (stored.attempt, stored.stream_seq, stored.enqueued_at) == (4, 77, pytest.approx(1_764_316_800.5))
    core = Delivery(_Core("_INBOX.agent._.abc.res.7"))
    assert (core.attempt, core.stream_seq, core.enqueued_at) == (1, 0, None)
