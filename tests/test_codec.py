"""transport.codec: msgpack by default, JSON when the Content-Type header says so (DESIGN §3, §5).

Every envelope round-trips in both encodings; unknown fields from a newer sender are ignored;
an unknown message kind or a body that is not one is refused, never guessed at.
"""

from __future__ import annotations

import msgspec
import pytest

from gym_runtime.messages import (
    CloseSession,
    ErrorInfo,
    ErrorReply,
    FunctionCall,
    Message,
    ModelRequest,
    Reasoning,
    RolloutResult,
    RolloutTask,
    SeedRequest,
    ToolCall,
    ToolReply,
    VerifyReply,
    create_params,
)
from gym_runtime.transport.codec import CONTENT_TYPE, JSON, Codec

MESSAGES = [
    RolloutTask(batch="b", task_index=3, rollout_index=1, agent="a", row={"x": [1, 2]}, policy_version=7),
    RolloutResult(batch="b", task_index=3, rollout_index=1, agent="a", row={"reward": 1.0}),
    RolloutResult(
        batch="b", task_index=0, rollout_index=0, agent="a", error=ErrorInfo(error_class="tool_error", message="m")
    ),
    ModelRequest(params=create_params({"input": [{"role": "user", "content": "hi"}]}), rollout_key="b:3:1"),
    SeedRequest(row={"expected_answer": "4"}, then=ToolCall(session="", name="t", arguments="{}")),
    ToolCall(session="s", name="get_weather", arguments='{"city": "SF"}'),
    ToolReply(output="cold", done=True),
    VerifyReply(reward=0.5, fields={"extra": 1}),
    CloseSession(session="s"),
    ErrorReply(error=ErrorInfo(error_class="worker_lost", message="gone", retryable=True)),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("as_json", [False, True], ids=["msgpack", "json"])
def test_every_envelope_round_trips(msg: msgspec.Struct, as_json: bool) -> None:
    codec = Codec()
    data = codec.encode(msg, json=as_json)
    headers = {CONTENT_TYPE: JSON} if as_json else None
    assert codec.decode(data, headers) == msg


def test_msgpack_is_the_default_and_json_needs_its_header() -> None:
    codec = Codec()
    msg = ToolReply(output="x")
    assert codec.encode(msg) == msgspec.msgpack.encode(msg)
    with pytest.raises(msgspec.DecodeError):  # JSON bytes without the header are read as msgpack
        codec.decode(codec.encode(msg, json=True), None)


def test_unknown_fields_from_a_newer_sender_are_ignored() -> None:
    body = b'{"kind": "tool.reply.v1", "output": "x", "added_in_v2": {"a": 1}}'
    assert Codec().decode(body, {CONTENT_TYPE: JSON}) == ToolReply(output="x")


@pytest.mark.parametrize(
    "body",
    [b'{"kind": "tool.reply.v9", "output": "x"}', b'{"output": "x"}', b"[1, 2]", b'{"kind": "tool.v1"}'],
    ids=["unknown-kind", "no-kind", "not-an-object", "missing-fields"],
)
def test_what_is_not_a_message_is_refused(body: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        Codec().decode(body, {CONTENT_TYPE: JSON})


TRAINING = {
    "prompt_token_ids": [1, 2],
    "generation_token_ids": [3],
    "generation_log_probs": [-0.5],
    "policy_version": 4,
    "policy_version_ranges": [[0, 1, 4]],
}


@pytest.mark.parametrize(
    ("item", "own"),
    [
        (Message(role="assistant", content="hi", **TRAINING), ["role", "content", "id", "status"]),
        (
            FunctionCall(arguments="{}", call_id="c", name="f", **TRAINING),
            ["arguments", "call_id", "name", "id", "status"],
        ),
        (Reasoning(**TRAINING), ["id", "summary", "content", "encrypted_content", "status"]),
    ],
)
def test_an_items_training_fields_follow_its_own_fields_as_nemo_gym_writes_them(
    item: msgspec.Struct, own: list[str]
) -> None:
    assert list(msgspec.json.decode(msgspec.json.encode(item))) == ["type", *own, *TRAINING]
