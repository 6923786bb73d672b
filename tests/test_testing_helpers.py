"""``gym_runtime.testing``'s response builders give environments' tests the shapes they claim."""

from __future__ import annotations

from gym_runtime.messages import Message, Reasoning
from gym_runtime.testing import text_response


def test_text_response_refusal_opens_the_last_message() -> None:
    response = text_response("a", "b", reasoning="r", refusal="no")
    first, second, last = response.output
    assert isinstance(first, Reasoning) and first.summary == [{"type": "summary_text", "text": "r"}]
    assert isinstance(second, Message) and isinstance(last, Message)
    assert last.content == [{"type": "refusal", "refusal": "no"}, {"type": "output_text", "text": "b"}]
    assert "refusal" not in str(text_response("a", "b").output)  # none unless asked for
