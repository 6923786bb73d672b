"""The NATS headers the runtime's messages carry (names, and the one rule on them: one place, so permissions,
tools and readers agree)."""

from __future__ import annotations

from collections.abc import Mapping

ERROR_HEADER = "Gym-Error"
REPLY_HEADER = "Gym-Reply"  # where a JetStream-queued request wants its answer
MSG_ID_HEADER = "Nats-Msg-Id"
# what JetStream sets on a direct get's answer (never on a message a client stores)
DIRECT_GET_HEADERS = ("Nats-Stream", "Nats-Sequence", "Nats-Subject")
BLOB_HEADER = "Gym-Blob"  # the body is in a blob stream: "{role}.{pool}.{key}.{chunks}.{sha256 hex}"
TTL_HEADER = "Nats-TTL"  # a stored message's own time to live (seconds): a call's or reply's large body
PROGRESS_HEADER = "Gym-Progress"  # "still working": keeps a caller's liveness timer alive
# the handler waits for a sandbox lease ("1"), or stopped waiting ("SECONDS" it waited): off the caller's clock
PAUSE_HEADER = "Gym-Paused"
# a part of the handler's output as it is produced, before the reply ("1" stdout, "2" stderr; the body: its bytes)
OUTPUT_HEADER = "Gym-Output"
# its values: an exec's stdout (1) and stderr (2); a generation's tokens so far (3: ``messages.GenerationProgress``)
OUTPUT_STREAMS = {"1": 1, "2": 2, "3": 3}
BUSY_HEADER = "Gym-Busy"  # "no free slot here": a direct call goes to the work queue instead
EXPIRES_HEADER = "Gym-Expires"  # a queued request's caller stops waiting for a worker then (epoch seconds)
# a control message as the runtime sends it: liveness beacons, pause, resume, cancel ("1"). A direct get's answer
# (a server's answer a requester borrowed into a control subject, with its own body) never has it as sent
CONTROL_HEADER = "Gym-Control"


def sent_as_control(headers: Mapping[str, str] | None) -> bool:
    """Whether a control message came as its sender sends it: the runtime's control header, and none of the
    headers JetStream puts on a direct get's answer (the rule the result readers use, ``data.intake``)."""
    if not headers or CONTROL_HEADER not in headers:
        return False
    return not any(h in headers for h in DIRECT_GET_HEADERS)


CONTROL = {CONTROL_HEADER: "1"}  # what a control message's sender adds (copied by every publish: never mutated)
