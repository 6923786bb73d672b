"""The multi-turn agent: a conversation of policy turns and user turns, verified at the end.

A *policy turn* is what the simple agent does for one prompt: model call → run its
tool calls (``function_call_output`` items) → model call ... until the model
answers without tool calls, hits ``max_output_tokens``, or ``max_steps`` model
calls were made in this turn. After each policy turn the next *user turn* comes
from one of (``options.user``):

* ``follow_ups``: the task's scripted list (``row["follow_ups"]``, or
  ``row["verifier_metadata"]["follow_ups"]``), one per turn; the conversation ends
  when the list is used up.
* ``env``: a gymnasium-style resource (``gym_runtime.gymnasium.GymResource``): ``reset``
  once (a non-empty observation joins the prompt, as in NeMo Gym's
  ``gymnasium_agent``), ``step(action)`` after every policy turn; the observation
  is the next user turn; ``terminated``/``truncated`` end the episode. The reward
  is the sum of step rewards (the resource's ``verify``).
* ``model``: an LLM user simulator, ``options.user_model`` (a model of the config,
  with its own workers), prompted with the task's persona/goal and the
  conversation seen from the user's side (``gym_runtime.user_sim``). It ends the
  conversation by saying ``stop_token``, calling ``stop_tool``, or saying nothing.
  If the task's input has no user message, the simulator opens the conversation.
* ``none``: one policy turn (the simple agent with this agent's row shape).
* ``auto`` (default): ``model`` if ``user_model`` is set, else ``follow_ups`` if
  the task has them, else ``none``.

Stop conditions: the user (simulator stop, no follow-ups left), the environment
(terminated/truncated), ``max_turns`` policy turns, an incomplete policy turn, or
the deadline: before starting another round the agent checks that the slowest
round so far still fits in the time left (``ctx.remaining()``) minus a reserve for
verification, and otherwise ends the conversation. A conversation cut by
``max_turns``, an incomplete turn or the deadline is a valid rollout marked
``truncated: true`` in the row (every row of this agent carries ``truncated``);
it is verified like any other. To mark the cut exactly, the user source is asked
for the next turn after the last allowed policy turn as well (for ``model``, one
extra simulator call per truncated conversation): a user who would have stopped
there ends the conversation naturally.

The trajectory in ``response.output`` is NeMo Gym's: every policy item as the
model returned it (training fields such as ``prompt_token_ids`` untouched, so token
ids stay contiguous across turns), tool outputs, and each user turn as
``{"type": "message", "role": "user", "content": "..."}`` in order. ``usage`` sums
the policy's calls (the user simulator's are not included).

Options (``agents.<name>.options``):
  user: auto|follow_ups|env|model|none     max_turns: policy turns (default 8)
  user_model: model name                   stop_token: default "###STOP###" (null: none)
  stop_tool: tool name offered to the user simulator to end the conversation
  min_turns: the user simulator is offered the stop token/tool only after this many policy turns
  user_instructions: the simulator's system prompt ({persona}, {goal}, {stop_token} are filled in)
  persona_field / goal_field: task fields with the persona and goal (default persona / goal)
  follow_ups_field: default follow_ups     user_params: extra create params for the simulator
  deadline_reserve_s: time kept for verification (default min(30, timeout_s / 10))
``max_steps`` (the agent's config) bounds model calls per policy turn.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from gym_runtime.agent import AgentContext, Outcome, Session
from gym_runtime.errors import Failure
from gym_runtime.gymnasium import Action, EnvError, env_reset, env_step
from gym_runtime.messages import (
    CreateParams,
    FunctionCall,
    FunctionCallOutput,
    Item,
    ItemError,
    Message,
    Response,
    Usage,
    create_params,
    message_text,
    output_text,
)
from gym_runtime.user_sim import DEFAULT_STOP_TOKEN, UserTurn, read_user_turn, user_message, user_sim_params

UserSource = Literal["auto", "follow_ups", "env", "model", "none"]


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    user: UserSource = "auto"
    max_turns: int = 8
    user_model: str | None = None
    stop_token: str | None = DEFAULT_STOP_TOKEN
    stop_tool: str | None = None
    min_turns: int = 1
    user_instructions: str | None = None
    persona_field: str | None = "persona"
    goal_field: str | None = "goal"
    follow_ups_field: str = "follow_ups"
    user_params: dict[str, Any] = msgspec.field(default_factory=dict)
    deadline_reserve_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        if self.user == "model" and not self.user_model:
            raise ValueError("user: model needs user_model (a model of the config)")
        if self.user_model is not None and self.user not in ("auto", "model"):
            raise ValueError(f"user_model is set but user is {self.user!r}")


def check_options(options: dict[str, Any]) -> Options:
    """Parse ``agents.<name>.options``; raises ``ValueError`` naming the bad key."""
    try:
        return msgspec.convert(options, Options)
    except msgspec.ValidationError as e:
        raise ValueError(f"options: {e}") from None


def _follow_ups(row: dict[str, Any], field: str) -> list[str] | None:
    raw = row.get(field)
    if raw is None and isinstance(row.get("verifier_metadata"), dict):
        raw = row["verifier_metadata"].get(field)
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise Failure("invalid_task", f"{field} must be a list of user messages")
    texts: list[str] = []
    for i, f in enumerate(raw):
        if isinstance(f, str):
            texts.append(f)
        elif isinstance(f, dict) and isinstance(f.get("content"), (str, list)):
            texts.append(message_text(Message(role="user", content=f["content"])))
        else:
            raise Failure("invalid_task", f"{field}[{i}] must be a string or a message")
    return texts


class _Conversation:
    """The rollout's growing trajectory and the policy's summed usage."""

    def __init__(self, ctx: AgentContext, session: Session, params: CreateParams, max_steps: int | None) -> None:
        self.ctx = ctx
        self.session = session
        self.params = params
        self.base_input: list[Item] = list(params.input)
        self.max_steps = max_steps
        self.outputs: list[Item] = []
        self.usage = Usage()
        self.last: Response | None = None

    async def policy_turn(self) -> tuple[list[Item], bool]:
        """One policy turn; returns its items and whether it ended with an answer."""
        start = len(self.outputs)
        steps = 0
        while True:
            steps += 1
            self.params.input = self.base_input + self.outputs
            resp = await self.ctx.generate(self.params)
            self.usage.add(resp.usage)
            self.outputs.extend(resp.output)
            self.last = resp
            details = resp.incomplete_details
            if details and details.get("reason") == "max_output_tokens":
                return self.outputs[start:], False
            calls = [o for o in resp.output if isinstance(o, FunctionCall)]
            for call in calls:  # a call named gym.step is an unknown tool: the policy cannot drive the episode
                output = (await self.session.call(call.name, call.arguments)).output
                self.outputs.append(FunctionCallOutput(call_id=call.call_id, output=output))
            if not calls and any(isinstance(o, Message) and o.role == "assistant" for o in resp.output):
                return self.outputs[start:], True
            if self.max_steps and steps >= self.max_steps:
                return self.outputs[start:], False

    def add_user_turn(self, text: str) -> None:
        self.outputs.append(user_message(text))


async def _ask_user(ctx: AgentContext, opts: Options, conversation: list[Item], *, may_stop: bool) -> UserTurn:
    params = user_sim_params(
        ctx.row,
        conversation,
        instructions=opts.user_instructions,
        persona_field=opts.persona_field,
        goal_field=opts.goal_field,
        stop_token=opts.stop_token,
        stop_tool=opts.stop_tool,
        may_stop=may_stop,
        extra=opts.user_params,
    )
    resp = await ctx.generate(params, model=opts.user_model)
    return read_user_turn(resp.output, stop_token=opts.stop_token, stop_tool=opts.stop_tool)


def _resolve_source(opts: Options, follow_ups: list[str] | None) -> str:
    if opts.user != "auto":
        return opts.user
    if opts.user_model:
        return "model"
    return "follow_ups" if follow_ups is not None else "none"


def _params_with_opening(raw: dict[str, Any], opening: str) -> dict[str, Any]:
    """``responses_create_params`` as the policy saw it: the opening user turn appended."""
    inp = raw.get("input")
    items = [{"role": "user", "content": inp}] if isinstance(inp, str) else list(inp or [])
    return {**raw, "input": [*items, {"role": "user", "content": opening}]}


async def run(ctx: AgentContext) -> Outcome:
    try:
        opts = check_options(ctx.config.options)
    except ValueError as e:
        raise Failure("invalid_task", f"agent {ctx.task.agent}: {e}") from None
    raw_params = ctx.row.get("responses_create_params")
    try:
        params = create_params(raw_params)
    except ItemError as e:
        raise Failure("invalid_task", str(e)) from None
    follow_ups = _follow_ups(ctx.row, opts.follow_ups_field) if opts.user in ("auto", "follow_ups") else None
    source = _resolve_source(opts, follow_ups)
    if source == "follow_ups" and follow_ups is None:
        raise Failure("invalid_task", f"user: follow_ups, but the task has no {opts.follow_ups_field!r}")
    reserve = opts.deadline_reserve_s
    if reserve is None:
        reserve = min(30.0, ctx.config.timeout_s / 10)

    truncated = False
    opening: str | None = None
    async with await ctx.open_session() as session:
        conv = _Conversation(ctx, session, params, ctx.config.max_steps)
        try:
            if source == "env":
                reset = await env_reset(session)
                opening = reset.observation or None
            elif source == "model" and not any(isinstance(i, Message) and i.role == "user" for i in conv.base_input):
                first = await _ask_user(ctx, opts, conv.base_input, may_stop=False)
                if first.stop or not first.text:
                    raise Failure("model_error", "the user simulator did not open the conversation")
                opening = first.text
            if opening:
                conv.base_input.append(user_message(opening))

            turns = 0
            slowest_round = 0.0
            while True:
                t0 = time.monotonic()
                turns += 1
                items, complete = await conv.policy_turn()
                next_text: str | None = None
                if source == "env":
                    step = await env_step(
                        session,
                        Action(
                            text=output_text(items),
                            output=items,
                            turn=turns,
                            incomplete=not complete,
                        ),
                    )
                    if step.terminated or step.truncated:
                        truncated = truncated or step.truncated
                        break
                    if not complete:
                        truncated = True
                        break
                    next_text = step.observation or None
                elif source == "follow_ups":
                    assert follow_ups is not None
                    if not complete:
                        truncated = True
                        break
                    if turns > len(follow_ups):
                        break
                    next_text = follow_ups[turns - 1]
                elif source == "model":
                    if not complete:
                        truncated = True
                        break
                    said = await _ask_user(ctx, opts, conv.base_input + conv.outputs, may_stop=turns >= opts.min_turns)
                    if said.stop:
                        break
                    next_text = said.text
                else:
                    truncated = not complete
                    break
                if turns >= opts.max_turns:
                    truncated = True
                    break
                slowest_round = max(slowest_round, time.monotonic() - t0)
                if ctx.remaining() - reserve < slowest_round:
                    truncated = True  # another round would not finish before the deadline
                    break
                if next_text:
                    conv.add_user_turn(next_text)
        except EnvError as e:
            raise Failure("tool_error", f"environment: {e}") from None

        assert conv.last is not None
        response = msgspec.structs.replace(conv.last, output=conv.outputs, usage=conv.usage)
        verdict = await session.verify(ctx.row, response)

    fields: dict[str, Any] = {"truncated": truncated or bool(verdict.fields.get("truncated"))}
    if opening and isinstance(raw_params, dict):
        fields["responses_create_params"] = _params_with_opening(raw_params, opening)
    return Outcome(response=response, verdict=verdict, fields=fields)
