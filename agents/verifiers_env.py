"""``agents.verifiers_env``: a verifiers environment (``vf.load_environment``) run as our tasks.

The environment is loaded by id with its arguments, as verifiers' own runner does
(``vf.load_environment(env_id, **env_args)``, the classic 0.3.x API), once per agent
process and configuration. Each task runs the environment's own rollout loop
(``setup_state``, ``env_response``, stop conditions, tools) and its own rubric,
unchanged. The only part we supply is the model client: a real ``openai.AsyncOpenAI``
whose HTTP transport answers ``POST /chat/completions`` by calling the agent's model
over the bus (``AgentContext.generate``), so sampling arguments, tools, token ids and
log-probs travel per turn exactly as verifiers sends and reads them.

Config (``agents.NAME``)::

    agent: agents.verifiers_env
    model: policy
    options: {env_id: my_env, env_args: {...}, sampling_args: {temperature: 1.0}}

Tasks: a row's ``responses_create_params.input`` is the prompt (chat messages) and
``verifiers`` holds the rest of the verifiers input (``answer``, ``info``,
``example_id``, ``task`` and every other column of the dataset, which verifiers passes to a
reward function by name); ``rows_from_dataset`` writes the environment's own dataset in that
shape (what ``prepare`` writes).

Groups: when the rubric scores groups (a reward function over ``states``/
``completions``), the batch's K repeats of one task arrive as one group task
(``AgentConfig.group_repeats``) and run as one verifiers group, scored together; each
repeat still gives its own row.

Isolation: the environment's code (its rollout loop, tools and rubric) runs in a guest process of the worker
(``isolation = "process"`` below; ``agents.NAME.isolation: none`` runs it in the worker's own process), so a
rubric that holds the GIL cannot stop the worker's bus: past ``call_timeout_s`` without a model call the guest
is killed, that rollout is a ``timeout`` row and the others it held run again (docs/security.md).

Failures: verifiers turns an exception in a reward function into reward 0 and a log
line; here it is a ``verify_error`` failure row (so is a reward that is not a number), inside an
``EnvGroup``'s children too. An ``EnvGroup`` row carries its own child's metrics only, not the
0.0 that verifiers' ``EnvGroupRubric`` pads in for the other children's reward functions.
An exception from the environment's setup or step (not a verifiers error) is a
``tool_error`` row. Errors verifiers records itself (``state["error"]``) stay in the
row as ``vf_error``. A model call that fails on our side fails the rollout with its own
class (``model_error``, retried when retryable) instead of becoming verifiers' error.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import logging
import numbers
import time
import uuid
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

import msgspec

from gym_runtime.agent import AgentContext, Outcome, in_repeat
from gym_runtime.chat import chat_body_to_params, chat_to_items, response_to_chat
from gym_runtime.config import AgentConfig
from gym_runtime.errors import Failure, UserError
from gym_runtime.messages import (
    ErrorClass,
    FunctionCall,
    Item,
    Message,
    Reasoning,
    Response,
    Usage,
    VerifyReply,
)

__all__ = ["Options", "check_options", "dataset_rows", "rows_from_dataset", "run", "run_group", "setup"]

# Where the worker runs this module's code unless agents.NAME.isolation says: a guest process (workers.guest_agent)
isolation = "process"

# Fields of a row the rubric's metrics must not overwrite.
_RESERVED = frozenset({"reward", "response", "responses_create_params", "agent_ref", "policy_versions"})

# Input fields verifiers reads with a default (``state.get("answer", "")``): a null column is left out.
_OPTIONAL_INPUTS = frozenset({"answer", "info", "task"})


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``agents.NAME.options`` of a verifiers agent."""

    env_id: str  # the installed environment's id (its package / module name)
    env_args: dict[str, Any] = msgspec.field(default_factory=dict)
    sampling_args: dict[str, Any] = msgspec.field(default_factory=dict)
    model_name: str | None = None  # the model name verifiers sees (default: the agent's model entry)


def check_options(options: dict[str, Any]) -> Options:
    try:
        return msgspec.convert(options, Options)
    except msgspec.ValidationError as e:
        raise ValueError(f"options: {e}") from None


# --------------------------------------------------------------------------- loading


def _said_again(record: logging.LogRecord) -> bool:
    """verifiers' own line for an environment it cannot import: dropped, as the one line we raise says it (a
    user's mistyped ``env_id`` is one line, not two)."""
    return not str(record.msg).startswith("Failed to import environment module")


@functools.lru_cache(maxsize=16)
def _load(env_id: str, args_json: str) -> Any:
    """One environment per (id, args) in this process, loaded as verifiers loads it; its rubric watched."""
    import verifiers as vf

    loader = logging.getLogger("verifiers.legacy.utils.env_utils")
    if _said_again not in loader.filters:
        loader.addFilter(_said_again)
    env = vf.load_environment(env_id, **json.loads(args_json))
    _watch_rubric(env.rubric)
    return env


def load_environment(options: Options) -> Any:
    try:
        return _load(options.env_id, json.dumps(options.env_args, sort_keys=True))
    except (ImportError, ValueError) as e:  # verifiers says ValueError for an env it cannot import
        raise Failure("invalid_task", f"cannot load verifiers environment {options.env_id!r}: {e}") from None


# Failures noted while one task's rollouts run (reward functions that raised or returned no
# number): a list per task, shared by the rollouts of a group (asyncio tasks copy the context).
_NOTES: contextvars.ContextVar[list[tuple[ErrorClass, str]] | None] = contextvars.ContextVar(
    "gym_vf_notes", default=None
)


def _note(error_class: ErrorClass, message: str) -> None:
    notes = _NOTES.get()
    if notes is not None:
        notes.append((error_class, message))


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real)


def _check_reward(name: str, value: Any) -> None:
    ok = all(_is_number(v) for v in value) if isinstance(value, list) else _is_number(value)
    if not ok:
        _note("verify_error", f"reward function {name} returned {value!r}, not a number")


def _watch(func: Any) -> Any:
    """The reward function, unchanged for verifiers (same signature, name and result), that also notes
    when it raises or returns something that is not a number (verifiers scores both as 0 silently)."""
    if getattr(func, "__gym_watched__", False):
        return func
    name = getattr(func, "__name__", repr(func))

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def watched_async(*args: Any, **kwargs: Any) -> Any:
            try:
                out = await func(*args, **kwargs)
            except Exception as e:
                _note("verify_error", f"reward function {name} raised {type(e).__name__}: {e}")
                raise
            _check_reward(name, out)
            return out

        watched: Any = watched_async
    else:

        @functools.wraps(func)
        def watched_sync(*args: Any, **kwargs: Any) -> Any:
            try:
                out = func(*args, **kwargs)
            except Exception as e:
                _note("verify_error", f"reward function {name} raised {type(e).__name__}: {e}")
                raise
            if inspect.isawaitable(out):
                return _awaited(name, out)
            _check_reward(name, out)
            return out

        watched = watched_sync
    watched.__gym_watched__ = True
    return watched


async def _awaited(name: str, out: Any) -> Any:
    try:
        value = await out
    except Exception as e:
        _note("verify_error", f"reward function {name} raised {type(e).__name__}: {e}")
        raise
    _check_reward(name, value)
    return value


def _watch_rubric(rubric: Any) -> None:
    funcs = getattr(rubric, "funcs", None)
    if isinstance(funcs, list):
        rubric.funcs = [_watch(f) for f in funcs]
    for sub in getattr(rubric, "rubrics", None) or []:
        _watch_rubric(sub)
    for child in _children(rubric).values():  # an EnvGroup's rubric scores a row with its child's own rubric
        _watch_rubric(child.rubric)


def _children(rubric: Any) -> Mapping[str, Any]:
    """The child environments by name of an EnvGroup's rubric (``EnvGroupRubric.env_map``); none otherwise."""
    env_map = getattr(rubric, "env_map", None)
    return env_map if isinstance(env_map, Mapping) else {}


def _route(state: Any) -> tuple[str, ...]:
    """The row's route through nested EnvGroups (``info["env_id"]``: a name or a list of names)."""
    info = state.get("info")
    value = info.get("env_id") if isinstance(info, Mapping) else None
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) else ()


def _others_metrics(rubric: Any, route: tuple[str, ...]) -> set[str]:
    """The metrics an EnvGroup pads with 0.0 for its other children (``EnvGroupRubric`` gives every row
    every child's reward names): not the row's own, so not its fields."""
    children = _children(rubric)
    if children:
        child = children.get(route[0]) if route else None
        if child is None:
            return set()
        mine = set(child.rubric._get_reward_func_names())
        return (set(rubric._get_reward_func_names()) - mine) | _others_metrics(child.rubric, route[1:])
    out: set[str] = set()
    for sub in getattr(rubric, "rubrics", None) or []:
        out |= _others_metrics(sub, route)
    return out


# ----------------------------------------------------------------- the model client


class _Calls:
    """What one task's model calls share: its context, and the first failure on our side."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self.error: Failure | None = None

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = await self.ctx.generate(chat_body_to_params(body))
        except Failure as e:
            if self.error is None:
                self.error = e
            raise
        return response_to_chat(resp, str(body.get("model") or ""), reasoning="field")


def _openai_client(calls: _Calls) -> Any:
    """A real ``AsyncOpenAI`` whose requests never leave the process: ``POST .../chat/completions`` goes to
    the agent's model over the bus; anything else is a 404, as from a server without that route."""
    import httpx
    import openai

    class BusTransport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.path.endswith("/chat/completions"):
                body = json.loads(await request.aread())
                return httpx.Response(200, json=await calls.chat(body))
            return httpx.Response(404, json={"error": {"message": f"no route {request.url.path} on gym-runtime"}})

    return openai.AsyncOpenAI(
        api_key="gym-runtime",  # not a secret: nothing leaves the process
        base_url="http://gym-runtime.invalid/v1",
        max_retries=0,  # our model workers retry; a failure is reported once, with its class
        # openai 3.x runs on httpx2 and takes a legacy httpx client too, as verifiers' own clients use
        http_client=httpx.AsyncClient(transport=BusTransport()),  # type: ignore[arg-type]
    )


# ------------------------------------------------------------------------------ rows


def rollout_input(row: dict[str, Any], index: int) -> dict[str, Any]:
    """A verifiers ``RolloutInput`` from our row."""
    extra = row.get("verifiers")
    extra = dict(extra) if isinstance(extra, dict) else {}
    params = row.get("responses_create_params") or {}
    prompt = extra.pop("prompt", None)
    if prompt is None:
        prompt = params.get("input") if isinstance(params, dict) else None
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list):
        raise Failure("invalid_task", "the row has no prompt (responses_create_params.input)")
    prompt = [{"role": m.get("role", "user"), "content": m.get("content", "")} for m in prompt]
    return {"prompt": prompt, "example_id": extra.pop("example_id", index), **extra}


def rows_from_dataset(env: Any, *, n: int = -1, split: str = "train") -> list[dict[str, Any]]:
    """The environment's own dataset as our rows (what ``prepare`` writes for a verifiers environment)."""
    ds = env.get_eval_dataset(n=n) if split == "eval" else env.get_dataset(n=n)
    rows = []
    for i, ex in enumerate(ds):
        # Every column: verifiers hands a reward function each column of its input row by name
        # (``Rubric.task_score_fields``), not only answer/info/task; ``rollout_input`` puts them back.
        vf_fields: dict[str, Any] = {"example_id": i}
        for key, value in ex.items():
            if key != "prompt" and not (value is None and key in _OPTIONAL_INPUTS):
                vf_fields[key] = value
        rows.append({"responses_create_params": {"input": ex["prompt"]}, "verifiers": vf_fields})
    return rows


def dataset_rows(options: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """``gym-runtime prepare -i AGENT=env[:SPLIT]``: the agent's environment's dataset (train or eval) as rows."""
    if split not in ("train", "eval"):
        raise ValueError(f"a verifiers environment has the splits train and eval, not {split!r}")
    env = load_environment(check_options(options))
    return rows_from_dataset(env, split=split)


def get_field(obj: Any, key: str, default: Any = None) -> Any:
    """``key`` of a dict, or the attribute of an object (verifiers hands us both)."""
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _step_usage(state: Any) -> Usage:
    usage = Usage()
    for step in state.get("trajectory") or []:
        u = get_field(step.get("response"), "usage")
        if u is None:
            continue
        inp = int(get_field(u, "prompt_tokens", 0) or 0)
        out = int(get_field(u, "completion_tokens", 0) or 0)
        usage.add(Usage(input_tokens=inp, output_tokens=out, total_tokens=inp + out))
    return usage


def _state_items(state: Any) -> list[Item]:
    """The rollout after its prompt as our items; each model turn's last item carries that turn's token ids."""
    steps = state.get("trajectory") or []
    items: list[Item] = []
    turn = 0
    for m in state.get("completion") or []:
        before = len(items)
        items.extend(chat_to_items([m]))
        if get_field(m, "role") != "assistant":
            continue
        tokens = steps[turn].get("tokens") if turn < len(steps) else None
        turn += 1
        if tokens and len(items) > before:
            last = items[-1]
            if isinstance(last, (Message, FunctionCall, Reasoning)):
                last.prompt_token_ids = list(tokens["prompt_ids"])
                last.generation_token_ids = list(tokens["completion_ids"])
                last.generation_log_probs = [float(x) for x in tokens["completion_logprobs"]]
    return items


def _fields(state: Any, drop: set[str]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for k, v in (state.get("metrics") or {}).items():
        if k not in _RESERVED and k not in drop:
            fields[k] = v
    err = state.get("error")
    if err is not None:
        fields["vf_error"] = f"{type(err).__name__}: {err}"
    fields["vf_is_truncated"] = bool(state.get("is_truncated", False))
    if state.get("stop_condition") is not None:
        fields["vf_stop_condition"] = state.get("stop_condition")
    if state.get("advantage") is not None:
        fields["vf_advantage"] = state.get("advantage")
    return fields


def _outcome(state: Any, model: str, rubric: Any) -> Outcome:
    reward = state.get("reward")
    if not _is_number(reward):
        raise Failure("verify_error", f"the rubric left reward {reward!r}, not a number")
    response = Response(
        id=f"resp_{uuid.uuid4().hex}",
        created_at=time.time(),
        model=model,
        output=_state_items(state),
        usage=_step_usage(state),
        status="incomplete" if state.get("is_truncated") else "completed",
    )
    fields = _fields(state, _others_metrics(rubric, _route(state)))
    return Outcome(response=response, verdict=VerifyReply(reward=float(reward), fields=fields))


# ----------------------------------------------------------------------------- agent


def _by_rollout(client: Any) -> Any:
    """``client`` whose model calls are each the call of one repeat of a group (``AgentContext.repeat``): verifiers
    hands every call its rollout's ``state``, and the group's rollouts are told apart by it (in the order of their
    first call: the repeats of one task are alike), so a failed group's rows each keep their own turns and cost."""
    inner = client.get_response
    repeats: dict[int, int] = {}

    async def get_response(*args: Any, state: Any = None, **kwargs: Any) -> Any:
        repeat = repeats.setdefault(id(state), len(repeats)) if state is not None else None
        with in_repeat(repeat):
            return await inner(*args, state=state, **kwargs)

    client.get_response = get_response
    return client


async def _run(ctx: AgentContext, size: int) -> list[Outcome]:
    options = check_options(ctx.config.options)
    env = load_environment(options)
    first = rollout_input(ctx.row, ctx.task.task_index)
    model = options.model_name or ctx.config.model
    sampling = {**(env.sampling_args or {}), **options.sampling_args}
    calls = _Calls(ctx)
    client_obj = _openai_client(calls)
    from verifiers.legacy.clients import OpenAIChatCompletionsClient

    client = _by_rollout(OpenAIChatCompletionsClient(client_obj))
    notes: list[tuple[ErrorClass, str]] = []
    token = _NOTES.set(notes)
    try:
        # The environment's own rollout + rubric (what run_rollout / run_group do before serializing).
        if size == 1 and not env.requires_group_rollouts:
            states = [await env._run_rollout_state(first, client, model, sampling)]
        else:
            states = await env._run_group_states([deepcopy(first) for _ in range(size)], client, model, sampling)
    except Failure:
        raise
    except Exception as e:  # noqa: BLE001 - any exception of the foreign environment is a tool_error row
        if calls.error is not None:
            raise calls.error from None
        raise Failure("tool_error", f"the verifiers environment raised {type(e).__name__}: {e}") from None
    finally:
        _NOTES.reset(token)
        await client_obj.close()
    if calls.error is not None:  # verifiers recorded it as its own ModelError; ours has the class and retry
        raise calls.error
    if notes:
        raise Failure(*notes[0])
    return [_outcome(s, model, env.rubric) for s in states]


async def setup(config: AgentConfig) -> None:
    """Load the environment when the worker starts: its first task does not pay for the imports, and an
    environment that cannot load stops the worker with one line instead of failing every task."""
    options = check_options(config.options)
    try:
        load_environment(options)
    except Failure as e:
        raise UserError(f"agents.*.options.env_id: {e.info.message}") from None


async def run(ctx: AgentContext) -> Outcome:
    return (await _run(ctx, 1))[0]


async def run_group(ctx: AgentContext, size: int) -> list[Outcome]:
    """K repeats of one task as one verifiers group (scored together when the rubric scores groups)."""
    return await _run(ctx, size)
