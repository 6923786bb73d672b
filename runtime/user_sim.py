"""The user-simulator protocol: how a multi-turn agent asks a model to play the user.

A user simulator is an ordinary model of the config (``models.user_sim``), served
by its own model workers and scaled like any model. This module fixes what such a
model is sent and how its answer is read, so that agents and test doubles (the
``replay`` adapter replays recorded user turns) agree:

* **The request** (``user_sim_params``): a system prompt with the task's persona
  and goal and the stop instruction, then the conversation *seen from the user's
  side*: the policy's messages become ``user`` messages, the user's earlier turns
  (the task's own user messages included) become ``assistant`` messages. System
  and developer messages of the policy, reasoning, tool calls and tool outputs are
  not shown to the user. Content is plain text.
* **The answer** (``read_user_turn``): the text of the assistant messages. The
  conversation ends when that text contains the stop token, when the model calls
  the stop tool (if one is offered), or when it is empty.

``UserMessage`` / ``user_message`` build user turns for ``response.output`` in
NeMo Gym's shape: ``{"type": "message", "role": "user", "content": "..."}`` with no
``id``/``status`` keys (an easy input message, as NeMo Gym's multi-turn agents
write it). It is a ``Message`` (same tag), so every consumer treats it as one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gym_runtime.messages import (
    CreateParams,
    FunctionCall,
    Item,
    Message,
    message_text,
)

__all__ = [
    "DEFAULT_STOP_TOKEN",
    "KICKOFF",
    "UserMessage",
    "UserTurn",
    "flip_conversation",
    "read_user_turn",
    "stop_tool_definition",
    "user_message",
    "user_sim_params",
]

# What a user simulator says to end the conversation (tau-bench's convention).
DEFAULT_STOP_TOKEN = "###STOP###"
# Sent as the only message when the user must open a conversation that has no turns yet.
KICKOFF = "(The assistant is waiting. Write your first message to it.)"

DEFAULT_PROMPT = (
    "You are role-playing a user who is talking to an AI assistant. Stay in character and write "
    "only the user's next message, in the first person, with no narration or quotes."
)


class UserMessage(Message, tag="message", omit_defaults=True):
    """A user turn as NeMo Gym writes it into ``response.output`` (no ``id``/``status`` keys)."""


def user_message(text: str) -> UserMessage:
    return UserMessage(role="user", content=text)


def flip_conversation(items: list[Item]) -> list[Message]:
    """The conversation as the user sees it: roles swapped, only user/assistant text."""
    flipped: list[Message] = []
    for item in items:
        if not isinstance(item, Message) or item.role not in ("user", "assistant"):
            continue
        text = message_text(item)
        if not text:
            continue
        flipped.append(Message(role="assistant" if item.role == "user" else "user", content=text))
    return flipped


def stop_tool_definition(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": "End the conversation: call this when your goal is met or the conversation is over.",
        "parameters": {"type": "object", "properties": {}, "required": [], "additionalProperties": False},
        "strict": True,
    }


def _field(row: dict[str, Any], name: str | None) -> str:
    if not name:
        return ""
    value = row.get(name)
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    import json

    return json.dumps(value, ensure_ascii=False)


def system_prompt(
    row: dict[str, Any],
    *,
    instructions: str | None,
    persona_field: str | None,
    goal_field: str | None,
    stop_token: str | None,
    stop_tool: str | None,
    may_stop: bool,
) -> str:
    """The user simulator's instructions for one task.

    ``instructions`` may use ``{persona}``, ``{goal}`` and ``{stop_token}``
    placeholders (plain replacement, other braces are left alone).
    """
    persona, goal = _field(row, persona_field), _field(row, goal_field)
    if instructions:
        text = (
            instructions.replace("{persona}", persona).replace("{goal}", goal).replace("{stop_token}", stop_token or "")
        )
    else:
        parts = [DEFAULT_PROMPT]
        if persona:
            parts.append(f"Your persona: {persona}")
        if goal:
            parts.append(f"Your goal in this conversation: {goal}")
        text = "\n\n".join(parts)
    if may_stop:
        ways = []
        if stop_token:
            ways.append(f"reply with exactly {stop_token}")
        if stop_tool:
            ways.append(f"call the {stop_tool} tool")
        if ways:
            text += (
                "\n\nWhen your goal has been achieved, or the conversation cannot usefully go on, "
                + " or ".join(ways)
                + " instead of writing a message."
            )
    return text


def user_sim_params(
    row: dict[str, Any],
    conversation: list[Item],
    *,
    instructions: str | None = None,
    persona_field: str | None = "persona",
    goal_field: str | None = "goal",
    stop_token: str | None = DEFAULT_STOP_TOKEN,
    stop_tool: str | None = None,
    may_stop: bool = True,
    extra: dict[str, Any] | None = None,
) -> CreateParams:
    """The request that asks the user simulator for the next user turn."""
    flipped = flip_conversation(conversation)
    if not flipped or flipped[-1].role != "user":
        flipped.append(Message(role="user", content=KICKOFF))
    sys_msg = Message(
        role="system",
        content=system_prompt(
            row,
            instructions=instructions,
            persona_field=persona_field,
            goal_field=goal_field,
            stop_token=stop_token,
            stop_tool=stop_tool,
            may_stop=may_stop,
        ),
    )
    params = CreateParams(input=[sys_msg, *flipped])
    if stop_tool and may_stop:
        params.tools = [stop_tool_definition(stop_tool)]
        params.tool_choice = "auto"
    for k, v in (extra or {}).items():
        if k in CreateParams.__struct_fields__ and k not in ("input", "tools", "extra"):
            setattr(params, k, v)
        else:
            params.extra[k] = v
    return params


@dataclass(frozen=True, slots=True)
class UserTurn:
    """What the user simulator answered: a message, or the end of the conversation."""

    text: str
    stop: bool
    reason: str = ""  # why it stopped: "stop_token", "stop_tool", "empty"


def read_user_turn(output: list[Item], *, stop_token: str | None, stop_tool: str | None) -> UserTurn:
    text = "".join(message_text(i) for i in output if isinstance(i, Message) and i.role == "assistant").strip()
    if stop_tool and any(isinstance(i, FunctionCall) and i.name == stop_tool for i in output):
        return UserTurn(text=text, stop=True, reason="stop_tool")
    if stop_token and stop_token in text:
        return UserTurn(text=text.replace(stop_token, "").strip(), stop=True, reason="stop_token")
    if not text:
        return UserTurn(text="", stop=True, reason="empty")
    return UserTurn(text=text, stop=False)
