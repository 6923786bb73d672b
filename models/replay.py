"""``replay``: replays recorded model outputs from a NeMo Gym rollouts JSONL.

Config: ``adapter: replay`` and ``rollouts: PATH`` (relative to the config's
directory). Each row holds ``responses_create_params`` (the task's input) and
``response`` (the whole trajectory). A recorded trajectory is split into model
calls at the items the model did not produce: ``function_call_output`` items and
user (or system/developer) messages, i.e. tool results and user turns of a
multi-turn conversation. Everything between two such items is what one model
call produced.

Multi-turn recordings replay both sides: the policy's calls as above, and the
*user simulator's* (``gym_runtime.user_sim``): a request that matches no recorded
prompt is read as a user-simulator request (the conversation seen from the user's
side, roles swapped); it is answered with the recorded next user turn, or with
the stop signal where the recording ends.

Why: it reproduces a real model's behaviour offline and bit-for-bit, so the
runtime's agent loop, tools and verification can be checked against NeMo Gym's
recorded rewards without a GPU.

Replay is stateless: the request alone (its prompt and the items after it) says
which rollout and which call it is, so concurrent rollouts and repeats are safe.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from gym_runtime.errors import ModelError
from gym_runtime.messages import (
    CreateParams,
    FunctionCall,
    FunctionCallOutput,
    Item,
    ItemError,
    Message,
    Reasoning,
    Response,
    Usage,
    assistant_message,
    message_text,
    parse_items,
)
from gym_runtime.model import AdapterOptions
from gym_runtime.user_sim import DEFAULT_STOP_TOKEN, KICKOFF

__all__ = ["Options", "Recording", "ReplayModel", "create"]


def _prompt_key(item: Item) -> tuple[Any, ...]:
    """How a prompt item is compared: messages by role and text (not ``type`` or ``id``)."""
    if isinstance(item, Message):
        return ("message", item.role, message_text(item), _media(item))
    if isinstance(item, FunctionCall):
        return ("function_call", item.call_id, item.name, item.arguments)
    if isinstance(item, FunctionCallOutput):
        return ("function_call_output", item.call_id, item.output)
    if isinstance(item, Reasoning):
        return ("reasoning", tuple(s.get("text", "") for s in item.summary))
    return (type(item).__name__,)


def _media(item: Message) -> tuple[str, ...]:
    """A message's images and files: prompts of the same text over different images (circle_count's five
    rows) are different prompts."""
    if isinstance(item.content, str):
        return ()
    return tuple(
        str(p.get("image_url") or p.get("file_data") or p.get("file_url") or p.get("file_id") or "")
        for p in item.content
        if isinstance(p, dict) and p.get("type") in ("input_image", "input_file")
    )


def _turn_key(item: Item) -> tuple[Any, ...]:
    """How a conversation item after the prompt is compared with the recording.

    Like ``_prompt_key`` except that tool outputs are compared by ``call_id``
    only: a live resource may legitimately answer differently than the recorded one.
    """
    if isinstance(item, FunctionCallOutput):
        return ("function_call_output", item.call_id)
    return _prompt_key(item)


def _external(item: Item) -> bool:
    """An item the model did not produce: a tool result, or a user/system turn."""
    return isinstance(item, FunctionCallOutput) or (isinstance(item, Message) and item.role != "assistant")


def _dialogue(items: list[Item]) -> list[tuple[str, str]]:
    """(role, text) of the user and assistant messages: the conversation a user simulator sees."""
    return [
        (i.role, message_text(i))
        for i in items
        if isinstance(i, Message) and i.role in ("user", "assistant") and message_text(i)
    ]


def _short(key: tuple[Any, ...], limit: int = 160) -> str:
    text = repr(key)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Recording:
    """One recorded rollout: its prompt and its output split into model calls."""

    source: str  # "file:line", for error messages
    prompt: tuple[tuple[Any, ...], ...]
    output: list[Item]
    turn_keys: list[tuple[Any, ...]]
    usage: Usage | None
    model: str
    response_id: str
    created_at: float
    dialogue: tuple[tuple[str, str], ...] = ()  # user/assistant text of prompt + output, in order


def _load(path: str) -> list[Recording]:
    recordings: list[Recording] = []
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise ModelError(f"replay: cannot open rollouts file {path}: {e.strerror}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = msgspec.json.decode(line)
                params = row["responses_create_params"]
                response = row["response"]
                prompt = parse_items(params["input"])
                output = parse_items(response["output"])
                raw_usage = response.get("usage")
                usage = (
                    msgspec.convert({k: v for k, v in raw_usage.items() if v is not None}, Usage) if raw_usage else None
                )
            except msgspec.DecodeError as e:
                raise ModelError(f"replay: {where}: not valid JSON: {e}") from None
            except (KeyError, TypeError) as e:
                raise ModelError(
                    f"replay: {where}: not a rollout row (needs responses_create_params.input"
                    f" and response.output): missing {e}"
                ) from None
            except (ItemError, msgspec.ValidationError) as e:
                raise ModelError(f"replay: {where}: {e}") from None
            recordings.append(
                Recording(
                    source=where,
                    prompt=tuple(_prompt_key(i) for i in prompt),
                    output=output,
                    turn_keys=[_turn_key(i) for i in output],
                    usage=usage,
                    model=str(response.get("model") or ""),
                    response_id=str(response.get("id") or f"resp_replay_{lineno}"),
                    created_at=float(response.get("created_at") or 0.0),
                    dialogue=tuple(_dialogue(prompt) + _dialogue(output)),
                )
            )
    if not recordings:
        raise ModelError(f"replay: rollouts file {path} holds no rollouts")
    return recordings


class Options(AdapterOptions, kw_only=True, forbid_unknown_fields=True):
    """``adapter: replay`` keys."""

    rollouts: str | None = None  # a NeMo Gym rollouts JSONL (relative to the config's folder)


class ReplayModel:
    """Answers each call with the recorded output items of the matching rollout.

    Matching: a rollout matches when its recorded prompt (``responses_create_params.input``;
    messages compared by role and text) equals the first items of ``params.input``
    and every item after that prompt equals the recording's output at the same
    position (function calls by call_id/name/arguments, messages by role/text;
    tool outputs by ``call_id`` only, since their content may legitimately differ).
    With ``k`` items after the prompt, the reply is ``output[k:]`` up to, not
    including, the next item the model did not produce (a ``function_call_output``
    or a user message). Several matching rows (repeats of one task) resolve to the
    first in file order.

    User-simulator requests (no recorded prompt matches): the request's user and
    assistant messages, roles swapped back (the kickoff message dropped), must be
    the start of a recording's dialogue (its prompt's and output's user/assistant
    messages) and end with an assistant turn. The reply is an assistant message
    with the recording's next user message; where the recording's dialogue ends
    it is the stop signal: a call of the request's first function tool if it
    offers one (a stop tool), else ``gym_runtime.user_sim.DEFAULT_STOP_TOKEN``.

    Usage: the recorded usage is a total for the whole trajectory, so the call
    that ends the trajectory carries all of it and earlier calls carry zero usage;
    summed over the rollout it equals the recording.
    """

    def __init__(self, cfg: Options, *, concurrency: int = 64, base_dir: str | None = None) -> None:
        if not cfg.rollouts:
            raise ModelError("replay adapter needs `rollouts: PATH` (a NeMo Gym rollouts JSONL)")
        path = cfg.rollouts
        if not os.path.isabs(path):
            path = os.path.join(base_dir or os.getcwd(), path)
        self.path = os.path.normpath(path)
        self._recordings = _load(self.path)
        # prompt length → prompt key → recordings (file order)
        self._index: dict[int, dict[tuple[Any, ...], list[Recording]]] = {}
        for rec in self._recordings:
            self._index.setdefault(len(rec.prompt), {}).setdefault(rec.prompt, []).append(rec)
        self._lengths = sorted(self._index)

    def __len__(self) -> int:
        return len(self._recordings)

    def _candidates(self, items: list[Item]) -> list[tuple[int, Recording]]:
        found: list[tuple[int, Recording]] = []
        keys = [_prompt_key(i) for i in items[: self._lengths[-1]]] if self._lengths else []
        for n in self._lengths:
            if n > len(items):
                break
            for rec in self._index[n].get(tuple(keys[:n]), ()):
                found.append((n, rec))
        return found

    def _user_turn(self, params: CreateParams) -> Response | None:
        """Answer a user-simulator request from the recordings, or None if none fits."""
        said = [
            ("assistant" if role == "user" else "user", text)
            for role, text in _dialogue(params.input)
            if not (role == "user" and text == KICKOFF)
        ]
        if not said or said[-1][0] != "assistant":
            return None
        n = len(said)
        for rec in self._recordings:
            if len(rec.dialogue) < n or list(rec.dialogue[:n]) != said:
                continue
            if n < len(rec.dialogue) and rec.dialogue[n][0] != "user":
                continue  # the recorded policy said more in this turn than the live one
            output: list[Item]
            if n < len(rec.dialogue):
                output = [assistant_message(rec.dialogue[n][1], id=f"msg_replay_user_{n}")]
            else:
                stop_tool = next(
                    (t.get("name") for t in params.tools or () if t.get("type", "function") == "function"),
                    None,
                )
                if stop_tool:
                    output = [
                        FunctionCall(
                            name=stop_tool,
                            arguments="{}",
                            call_id=f"call_replay_stop_{n}",
                            id=f"fc_replay_stop_{n}",
                            status="completed",
                        )
                    ]
                else:
                    output = [assistant_message(DEFAULT_STOP_TOKEN, id=f"msg_replay_user_{n}")]
            return Response(
                id=f"{rec.response_id}_user_{n}",
                created_at=time.time(),
                model=rec.model,
                output=output,
                tools=list(params.tools or ()),
                temperature=params.temperature,
                top_p=params.top_p,
                max_output_tokens=params.max_output_tokens,
                usage=Usage(),
            )
        return None

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        items = params.input
        candidates = self._candidates(items)
        if not candidates:
            user_turn = self._user_turn(params)
            if user_turn is not None:
                return user_turn
            first_user = next(
                (message_text(i) for i in items if isinstance(i, Message) and i.role == "user"),
                "",
            )
            raise ModelError(
                f"replay: no recorded rollout in {self.path} has this prompt (first user message: {first_user[:80]!r})"
            )
        diverged: str | None = None
        for n, rec in candidates:
            turn = items[n:]
            k = len(turn)
            if k > len(rec.output):
                diverged = f"{rec.source}: the conversation is longer than the recording"
                continue
            bad = next((j for j, it in enumerate(turn) if _turn_key(it) != rec.turn_keys[j]), None)
            if bad is not None:
                diverged = (
                    f"{rec.source}: conversation item {n + bad} is"
                    f" {_short(_turn_key(turn[bad]))}, the recording has {_short(rec.turn_keys[bad])}"
                )
                continue
            if k == len(rec.output):
                diverged = f"{rec.source}: the recorded trajectory ended, no more model output"
                continue
            end = k
            while end < len(rec.output) and not _external(rec.output[end]):
                end += 1
            if end == k:
                if isinstance(rec.output[k], FunctionCallOutput):
                    expected = f"a tool output (call_id {rec.turn_keys[k][1]!r})"
                else:
                    expected = f"a {rec.turn_keys[k][1]} turn"
                diverged = f"{rec.source}: the recording expects {expected} at item {n + k}, not a model call"
                continue
            last = end == len(rec.output)
            usage = (
                msgspec.structs.replace(
                    rec.usage,
                    input_tokens_details=dict(rec.usage.input_tokens_details),
                    output_tokens_details=dict(rec.usage.output_tokens_details),
                )
                if last and rec.usage is not None
                else Usage()
            )
            return Response(
                id=f"{rec.response_id}_{k}",
                created_at=time.time(),
                model=rec.model,
                output=[msgspec.structs.replace(i) for i in rec.output[k:end]],
                tools=list(params.tools or ()),
                temperature=params.temperature,
                top_p=params.top_p,
                max_output_tokens=params.max_output_tokens,
                usage=usage,
            )
        raise ModelError(f"replay: the conversation diverged from the recording ({diverged})")

    async def aclose(self) -> None:
        return None


create = ReplayModel
