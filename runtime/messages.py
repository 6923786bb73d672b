"""Every message that crosses the bus, as msgspec Structs.

Two families live here:

* Responses-API items (``message``, ``function_call``, ``function_call_output``,
  ``reasoning``) and the ``Response`` envelope. Field names and defaults follow
  NeMo Gym's rollout rows so a row we write is a row NeMo Gym would write. Content
  parts stay plain dicts: they are passed through untouched, never interpreted.
* Runtime envelopes (tasks, results, model calls, tool calls, verify, errors).
  Their tags carry a version (``task.v1``) so a mixed-version cluster fails loudly.

Structs are ``kw_only`` and ``omit_defaults`` (small frames); unknown fields on the
wire are ignored so newer senders do not break older receivers.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType, field

# --------------------------------------------------------------------------- items


class _Item(Struct, kw_only=True, tag_field="type"):
    """Base for Responses items; ``type`` is the tag, as in the OpenAI schema.

    Defaults are written out (``"id": null``) as NeMo Gym's rows do; the training
    fields are ``UNSET`` when absent and then left out entirely ("all three or none").
    """


class _Trained(_Item, kw_only=True):
    """An item a model call can end on: the training fields ride on the last output item of a call (NeMo Gym
    contract). Keyword-only, so on the wire they follow each item's own fields, as NeMo Gym writes them."""

    prompt_token_ids: list[int] | UnsetType = UNSET
    generation_token_ids: list[int] | UnsetType = UNSET
    generation_log_probs: list[float] | UnsetType = UNSET
    policy_version: int | UnsetType = UNSET  # the trainer's policy version that generated these ids
    # [[start, end, version], ...] over generation_token_ids: which policy sampled which tokens (a call
    # interrupted by a weight update and continued under the next version has more than one range)
    policy_version_ranges: list[list[int]] | UnsetType = UNSET


class Message(_Trained, tag="message"):
    """An input or output message. ``content`` is a string or a list of content parts."""

    role: str
    content: str | list[dict[str, Any]] = ""
    id: str | None = None
    status: str | None = None


class FunctionCall(_Trained, tag="function_call"):
    arguments: str
    call_id: str
    name: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(_Item, tag="function_call_output"):
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class Reasoning(_Trained, tag="reasoning"):
    id: str | None = None
    summary: list[dict[str, Any]] = field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


Item = Message | FunctionCall | FunctionCallOutput | Reasoning
KNOWN_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})
TRAINING_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def message_text(item: Message) -> str:
    """The plain text of a message, whatever shape its content has."""
    if isinstance(item.content, str):
        return item.content
    return "".join(p.get("text", "") for p in item.content if isinstance(p, dict))


def output_text(items: list[Any]) -> str:
    """The text graders read from a response's ``output`` (the OpenAI SDK's ``Response.output_text``).

    Reads every ``Message`` item in order, whatever its role; skips every other item
    (function calls and their outputs, reasoning). Of a message it takes a string
    ``content`` whole, else the ``text`` of each content part whose ``type`` is
    ``output_text`` (``refusal`` and any other part type are skipped, as is a
    ``text`` that is not a string). Joined with nothing in between.
    """
    texts: list[str] = []
    for item in items:
        if not isinstance(item, Message):
            continue
        if isinstance(item.content, str):
            texts.append(item.content)
            continue
        for part in item.content:
            if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
    return "".join(texts)


def last_item_text(items: list[Any]) -> str:
    """The text NeMo Gym's calendar and instruction-following graders read: the first content
    part of the last item only.

    The last item must be a ``Message`` or a ``Reasoning`` item (a function call or its
    output as the last item gives ``""``: the model did not finish with text). A string
    ``content`` counts whole; otherwise the first part's ``text`` whatever the part's type
    (``output_text``, ``reasoning_text``, ...), ``""`` when it has none or it is not a string.
    """
    if not items or not isinstance(items[-1], (Message, Reasoning)):
        return ""
    content = items[-1].content
    if not content:
        return ""
    if isinstance(content, str):
        return content
    first = content[0]
    text = first.get("text") if isinstance(first, dict) else None
    return text if isinstance(text, str) else ""


# Every field of NeMo Gym's pydantic create-params model, with its default.
_NEMO_PARAMS_FIELDS: dict[str, Any] = {
    "background": None,
    "include": None,
    "input": [],
    "instructions": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "metadata": None,
    "model": None,
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "prompt": None,
    "reasoning": None,
    "service_tier": None,
    "store": None,
    "temperature": None,
    "text": None,
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": None,
    "top_p": None,
    "truncation": None,
    "user": None,
    "stream": None,
}


def recorded_create_params(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` as NeMo Gym records create params (e.g. a judge's in ``judge_evaluations``):
    every field of its model, the unset ones at their defaults."""
    return {**_NEMO_PARAMS_FIELDS, **params}


def assistant_message(text: str, *, id: str | None = None) -> Message:
    """An assistant output message shaped like the OpenAI Responses API's."""
    return Message(
        role="assistant",
        id=id,
        status="completed",
        content=[{"annotations": [], "text": text, "type": "output_text", "logprobs": []}],
    )


# ----------------------------------------------------------------------- responses


class Usage(Struct, kw_only=True, gc=False):
    """Token counts. Not tracked by the cycle collector (``gc=False``): it holds numbers and dicts of
    numbers, so it can be in no reference cycle, and one lives per model response in flight."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: dict[str, Any] = field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, Any] = field(default_factory=lambda: {"reasoning_tokens": 0})

    def add(self, other: Usage | None) -> None:
        if other is None:
            return
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.total_tokens += other.total_tokens
        for mine, theirs in (
            (self.input_tokens_details, other.input_tokens_details),
            (self.output_tokens_details, other.output_tokens_details),
        ):
            for k, v in theirs.items():
                if isinstance(v, (int, float)):
                    mine[k] = mine.get(k, 0) + v


class Response(Struct, kw_only=True):
    """The Responses-API ``Response`` object, with NeMo Gym's field set and order."""

    id: str
    created_at: float
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: Any = None
    metadata: dict[str, Any] | None = field(default_factory=dict)
    model: str = ""
    object: str = "response"
    output: list[Item] = field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = field(default_factory=list)
    top_p: float | None = None
    background: bool | None = False
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    status: str | None = "completed"
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    usage: Usage | None = None
    user: str | None = None


class CreateParams(Struct, kw_only=True, omit_defaults=True):
    """Responses ``create`` parameters as a model worker needs them.

    Anything else the caller set travels in ``extra`` untouched, so adapters can
    forward provider-specific fields without this Struct knowing them.
    """

    input: list[Item]
    tools: list[dict[str, Any]] | None = None
    instructions: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------- envelopes


class _Msg(Struct, kw_only=True, omit_defaults=True, tag_field="kind"):
    """Base for runtime envelopes."""


class RolloutTask(_Msg, tag="task.v1"):
    """One rollout to run: an input row (NeMo Gym format) and its place in the batch."""

    batch: str
    task_index: int
    rollout_index: int
    agent: str
    row: dict[str, Any]
    # Trainer fields (all optional): the policy version the task was made for, how many versions
    # newer the policy may be when it starts (else it is dropped as stale), and the fingerprint of
    # the agent's config entry the publisher expects (a worker of another config refuses it).
    policy_version: int | None = None
    max_staleness: int | None = None
    fingerprint: str | None = None
    # A group task (> 1): this one message carries repeats ``rollout_index .. rollout_index + group - 1``
    # of the task, run together by one agent (a rubric that scores groups sees them all); each repeat
    # still gives its own result, and a redelivery runs the whole group again.
    group: int = 0
    # The publisher could not check the row against its environment (it cannot import it: a hosted
    # environment, or one installed on the worker nodes only): the resource worker checks it when it
    # opens the session, as ``validate`` would (``any_tools``: answer-channel tools were allowed).
    check: RowCheck | None = None
    # Published after its batch was cancelled (admission held it back until then): its worker writes the
    # ``cancelled`` row without running it, however late the cancel message reaches that worker
    cancelled: bool = False
    # A branch (``Client.branch``): this rollout goes on from another rollout's checkpoint at a turn, its session
    # restored from the snapshot kept there, sampling its own turns from it (its row names the parent and turn)
    branch: BranchPoint | None = None
    # Keep this rollout's checkpoint, a part per turn, for this many seconds from each write (not deleted with its
    # row): a later ``Client.branch`` may branch it at any of its turns. 0: deleted with the row.
    keep_checkpoints_s: float = 0.0


class BranchPoint(Struct, kw_only=True, omit_defaults=True):
    """The rollout a branch goes on from and the model turn it branches at (``RolloutTask.branch``). Its
    checkpoint is read under the branch's own agent pool's keys: a rollout of another pool is never found."""

    batch: str
    task_index: int
    rollout_index: int
    turn: int

    def parent(self) -> str:
        """The parent's rollout key (``Rollout.rollout_key``), as a branch's row names it (``branch_of``)."""
        return f"{self.batch}:{self.task_index}:{self.rollout_index}"


class RowCheck(Struct, kw_only=True, omit_defaults=True):
    """What a resource worker checks of a row at seed time (``RolloutTask.check``)."""

    any_tools: bool = False


class SandboxCommand(Struct, kw_only=True, omit_defaults=True, gc=False):
    """One command an attempt ran in its own sandboxes (``RolloutResult.commands``; rows record none): the
    command, its exit code (None: killed past its timeout), its time, its output's size and its first
    ``COMMAND_HEAD`` characters (stdout, then stderr)."""

    command: str
    exit_code: int | None = None
    ms: int = 0
    output_bytes: int = 0
    head: str = ""


COMMAND_HEAD = 2000


class TimeSplit(Struct, kw_only=True, omit_defaults=True, gc=False):
    """Where a failed attempt's time went, in ms (a failure row's ``time_split``): what the failure attribution of a
    ``timeout`` reads (``data.attribution``). The rest of ``total_ms`` is the environment's (its seed and verify, the
    agent's own code); the waits for a sandbox lease are not in it (they stop the rollout's clock)."""

    total_ms: int = 0  # the attempt, start to failure
    generating_ms: int = 0  # its model calls' generation, as the model workers timed it (``ModelCost.call_ms``)
    model_wait_ms: int = 0  # those calls' round trips less their generation: queues, transport, a server that hung
    tools_ms: int = 0  # its tool calls and its own sandboxes' commands: what the policy asked to run


class RolloutResult(_Msg, tag="result.v1"):
    """The collector's input: a finished row, or a failure with its class."""

    batch: str
    task_index: int
    rollout_index: int
    agent: str
    row: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    input_row: dict[str, Any] | None = None
    attempts: int = 1
    answer_field: str | None = None
    cost: Cost | None = None  # a failure's cost (a row's is its ``cost`` key): failed rollouts are paid for too
    # The attempt's own model and tool calls in order (``explain``; kept out of the row): a model call
    # ``[start_ms, ms, input_tokens, output_tokens]``, a tool call ``[start_ms, ms]``, ``start_ms`` from the
    # attempt's start. The entry of the i-th model call is ``provenance.turns[i]``, the i-th tool call's name
    # is the i-th ``function_call`` of the response: neither is repeated here. A group's on its first repeat.
    calls: list[list[int]] | None = None
    commands: list[SandboxCommand] | None = None  # its own sandboxes' commands, in order (run's attempts sidecar)
    # A resumed attempt's: the model and tool calls earlier attempts made before its own ``calls`` (its first
    # model call is ``provenance.turns[calls_from[0]]``, its first tool call the response's
    # ``calls_from[1]``-th function call)
    calls_from: list[int] | None = None
    # a failure's: where its time went (``failure_attribution``), and the policy's trajectory so far (the row's
    # ``response``, status ``incomplete``): on every repeat's row (older readers ignore both)
    time_split: TimeSplit | None = None
    partial: Response | None = None
    policy_versions: list[int] | None = None  # the policy versions of the calls in ``partial`` ([min, max])
    # a branch's failure (``RolloutTask.branch``): its row names the parent and turn as a scored branch's does
    branch: BranchPoint | None = None


# ------------------------------------------------------------------ the ledger (cost, provenance)


class ModelCost(Struct, kw_only=True, omit_defaults=True, gc=False):
    """One model entry's share of a rollout's cost (``cost.models[entry]``): calls, tokens, and the time the
    model workers spent generating (ms; not the time calls waited in a queue)."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # of the input tokens, those the server says it served from its cache
    call_ms: int = 0
    # calls whose model reported no usage and returned no token ids: their tokens are unknown (a token budget
    # refuses to count them, ``admission.used``)
    unmeasured: int = 0


class Cost(Struct, kw_only=True, omit_defaults=True, gc=False):
    """A row's ``cost`` (gym-runtime's addition to NeMo Gym's row): what the rollout used, per model entry
    (the policy, judges, user simulators), tool time, sandbox time (wall and CPU), and, with a ``pricing`` section, an
    *estimate* of what that costs (``estimated_cost``, in ``currency``). Holds numbers and dicts of
    them, so it is in no reference cycle: not tracked by the cycle collector (``gc=False``)."""

    models: dict[str, ModelCost] = {}
    tool_ms: int = 0
    sandbox_ms: int = 0  # wall time of the rollout's sandbox execs (the fleet's: its own and its environment's)
    # CPU time its sandboxes used, where counted: a code sandbox's cgroup (``gym_runtime.jail``) at each run's
    # end, a fleet sandbox's engine stats at its release; ``pricing.cpu_hour`` charges it instead of the wall time
    sandbox_cpu_ms: int = 0
    # the size of its stored result (the ``RolloutResult`` body as stored, a large one's blob; headers and subject
    # not): set by whoever reads it back (``read_result``), from the stored message itself, so it costs the
    # worker no second encode and is exact
    stored_bytes: int = 0
    estimated_cost: float | None = None
    currency: str | None = None  # pricing.currency, beside the estimate it is the unit of

    def add_call(self, entry: str, usage: Usage | None, ms: int, response: Response | None = None) -> None:
        """Count one model call of ``entry``: its usage as the model worker reported it, or, where it reported
        none, the token ids it returned (``response``); neither: an ``unmeasured`` call. A negative or
        non-integer count is none (no count lowers a budget)."""
        m = self.models.get(entry)
        if m is None:
            m = self.models[entry] = ModelCost()
        m.calls += 1
        m.call_ms += _count(ms)
        if usage is not None:
            m.input_tokens += _count(usage.input_tokens)
            m.output_tokens += _count(usage.output_tokens)
            m.cached_tokens += _count(usage.input_tokens_details.get("cached_tokens"))
            return
        ids = _token_ids(response)
        if ids is None:
            m.unmeasured += 1
        else:
            m.input_tokens += ids[0]
            m.output_tokens += ids[1]

    def merge(self, other: Cost | None) -> None:
        """Add ``other``'s counts (a judge's calls that a resource worker reports with its verdict); a
        negative or non-integer count is none."""
        if other is None:
            return
        for entry, o in other.models.items():
            m = self.models.get(entry)
            if m is None:
                m = self.models[entry] = ModelCost()
            m.calls += _count(o.calls)
            m.input_tokens += _count(o.input_tokens)
            m.output_tokens += _count(o.output_tokens)
            m.cached_tokens += _count(o.cached_tokens)
            m.call_ms += _count(o.call_ms)
            m.unmeasured += _count(o.unmeasured)
        self.tool_ms += _count(other.tool_ms)
        self.sandbox_ms += _count(other.sandbox_ms)
        self.stored_bytes += _count(other.stored_bytes)
        self.sandbox_cpu_ms += _count(other.sandbox_cpu_ms)


def _count(n: object) -> int:
    """A reported count as a cost adds it: a negative, non-integer or missing one adds nothing."""
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def counted_ms(seconds: float) -> int:
    """Seconds as a cost's milliseconds: a negative or non-finite amount adds nothing."""
    return round(1000 * seconds) if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0 else 0


def _token_ids(response: Response | None) -> tuple[int, int] | None:
    """A call's (input, output) tokens from the token ids its response returned (the prompt's ids of its last
    item that has them, every item's generated ids); None: it returned none."""
    if response is None:
        return None
    prompt, generated, seen = 0, 0, False
    for item in response.output:
        p, g = getattr(item, "prompt_token_ids", UNSET), getattr(item, "generation_token_ids", UNSET)
        if isinstance(p, list):
            prompt, seen = len(p), True
        if isinstance(g, list):
            generated, seen = generated + len(g), True
    return (prompt, generated) if seen else None


class Served(Struct, kw_only=True, omit_defaults=True, gc=False):
    """What a resource worker says of itself with a verdict: its id, its environment's code identity
    (``plugins.code_identity``), the grader's where it differs, and the model calls the session made (judges)."""

    worker: str = ""
    code: str = ""
    grader: str | None = None
    cost: Cost | None = None
    # the images its session's fleet sandboxes ran (names as ``Provenance.images`` has them) and beside each its
    # content id (the engine's ``sha256:...``): the row's provenance names them with the agent's own
    images: list[str] = []
    image_ids: list[str] = []


class Provenance(Struct, kw_only=True, omit_defaults=True, gc=False):
    """A row's ``provenance`` (gym-runtime's addition to NeMo Gym's row): ids and hashes only; the batch's
    manifest keeps the long values once (``Manifest.models``: each model entry's adapter and model name).
    Strings and lists of them: in no reference cycle (``gc=False``)."""

    runtime: str  # gym-runtime's version on the agent worker
    config: str | None = None  # the agent entry's config fingerprint (``ResolvedConfig.fingerprints``: no pricing)
    # the same, part by part (``fingerprints.agent_parts``: ``agent``, ``model.NAME``, ``resource``): ``diff``
    # tells a changed grader (regrade) from a changed model (rerun)
    parts: dict[str, str] = {}
    env: str | None = None  # the environment's code identity (``plugins.code_identity``), from the verifying worker
    grader: str | None = None  # the grader's identity where it differs from the environment's
    turns: list[str] = []  # the model entry of each model call, in order; ``entry@version`` once a trainer set one
    images: list[str] = []  # the sandbox images the rollout's sandboxes ran, by name
    # beside each name, its content's id as ``docker images`` shows it (the engine's ``sha256:`` Id, its first 12
    # hex digits: ``docker image inspect`` takes it); "" where the backend has no image. Absent: none has one
    image_ids: list[str] = []
    attempt: int = 1
    workers: dict[str, list[str]] = {}  # role -> the ids of the workers that served the rollout


class AttemptStart(_Msg, tag="attempt.start.v1", kw_only=True):
    """What an attempt says of itself when it starts (``Subjects.attempt``, ``explain``): where and when it runs.
    A worker killed mid-rollout leaves this and nothing else."""

    task_index: int
    rollout_index: int
    group: int = 0  # a group task's repeats (``RolloutTask.group``)
    attempt: int  # JetStream's delivery count
    failed: int = 0  # earlier attempts that failed by the rollout's own doing (the rest were lost workers)
    worker: str
    node: str
    pid: int
    at: float  # epoch seconds


class AttemptRetried(_Msg, tag="attempt.nak.v1", kw_only=True):
    """An attempt given back for another (a retryable failure, or its guest lost): why, and the calls it made
    (``RolloutResult.calls``' form)."""

    task_index: int
    rollout_index: int
    group: int = 0
    attempt: int
    worker: str
    error: ErrorInfo
    calls: list[list[int]] = []
    at: float


AttemptRecord = AttemptStart | AttemptRetried


class GenerationProgress(Struct, kw_only=True, omit_defaults=True):
    """A generation's tokens so far: sent to its caller while it runs (``ModelRequest.progress_s``), kept in the
    rollout's checkpoint, and continued by a resumed attempt (``ModelRequest.continue_from``): its prompt ids are
    the prompt, its ids and logprobs kept, its ``[start, end, version]`` ranges carried on."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int] = []
    generation_log_probs: list[float] = []
    policy_version_ranges: list[list[int]] = []
    text: str = ""  # the adapter's text of those ids, where it has it


class ModelRequest(_Msg, tag="model.req.v1"):
    params: CreateParams
    rollout_key: str | None = None  # affinity: later turns may prefer one replica
    fingerprint: str | None = None  # the model config entry the caller expects (isolation)
    # When the caller's rollout ends (epoch seconds, a little before its deadline): an adapter that can stop a
    # generation stops it then and answers what it generated so far (``ModelResponse.cut``); None: never cut.
    # A wire change: a reader before it ignores the field and generates until done (docs/changelog.md)
    cut_at: float | None = None
    # Send the generation's tokens so far to the caller this often (``GenerationProgress`` as output stream 3), so
    # its rollout's checkpoint keeps them; an adapter that cannot stop a generation sends none. A wire change too
    progress_s: float | None = None
    # Continue this generation (a checkpoint's, its agent killed mid-generation) instead of starting one: its
    # prompt ids are the prompt, its tokens kept (an adapter that cannot continue one generates it whole)
    continue_from: GenerationProgress | None = None
    # How the call was routed (``model_calls.ROUTES``): ``affine`` sent to the replica of the rollout's last turn,
    # ``load`` that replica had no free slot, ``moved`` it was gone; None: no earlier turn. The worker counts them
    route: str | None = None


class ModelResponse(_Msg, tag="model.resp.v1"):
    response: Response
    policy_version: int | None = None  # the policy version that served this call (None: never set)
    # the version its last tokens were generated under (a call interrupted and continued after an update)
    policy_version_last: int | None = None
    worker: str | None = None  # the model worker that generated it (provenance)
    took_ms: int = 0  # the generation's time on that worker (cost), not the call's wait in a queue
    # the generation was stopped at the request's ``cut_at``: ``response`` holds its tokens so far (its item
    # ``status: "incomplete"``), not a finished turn; the caller's rollout has run out of time
    cut: bool = False
    # ``response.tools`` are the request's ``params.tools`` as asked (the adapter echoed the very tools it was
    # given): the caller may hold its own list in their place, and a checkpoint need not keep them (``holding``)
    tools_asked: bool = False


class SeedRequest(_Msg, tag="seed.v1"):
    row: dict[str, Any]
    # The session's first operation, run right after seeding: one round trip fewer per rollout.
    then: ToolCall | VerifyRequest | RestoreSession | None = None
    check: RowCheck | None = None  # check the row first (RolloutTask.check); a bad one is invalid_task
    # the rollout the session is for (``batch:task:rollout``): its sandboxes' lease is bound to it and to the caller,
    # so a restore takes up only sandboxes this environment leased to that rollout of that caller
    rollout: str = ""


class SeedReply(_Msg, tag="seed.reply.v1"):
    session: str
    address: str  # subject prefix of the worker that owns the session
    result: ToolReply | VerifyReply | ResumeReply | None = None  # the reply to ``then``
    by: str = ""  # the worker's process (``node/pid``): a session call it leaves unanswered names it (``why``)


class ToolCall(_Msg, tag="tool.v1"):
    session: str
    name: str
    arguments: str
    # One of the runtime's own session operations (``gym.reset``, ``gym.step``, ``nemo_gym.http``), sent by
    # ``Session.operate``; a model's call is never one, whatever its name (``Resource.call_operation``).
    protocol: bool = False
    # The same on every attempt of its turn ("": none): the session answers a repeated id with the reply it gave
    # the first time (a resumed attempt replaying its turn), so no tool call runs twice (docs/changelog.md, 69).
    id: str = ""
    # Ask for the environment's snapshot after this call (the last of a turn that is checkpointed): an
    # environment with ``Resource.snapshot`` answers it in ``ToolReply.snapshot``; any other ignores it.
    snapshot: bool = False
    # With ``snapshot``, in a rollout kept for branching (``RolloutTask.keep_checkpoints_s``): keep a copy of the
    # session's sandboxes as they are now, unused, for this long (``ToolReply.kept``: the turn's branch point)
    keep_s: float = 0.0


class ToolReply(_Msg, tag="tool.reply.v1"):
    output: str
    is_error: bool = False
    done: bool = False
    snapshot: bytes | None = None  # the session's ``Resource.snapshot()`` when the call asked for it
    # with a snapshot: the session's sandboxes and their lease, for a restored session to reattach to by that lease
    held: HeldSandboxes | None = None
    # with a snapshot asked ``keep_s``: the copies of the session's sandboxes kept as they were at it (none: no room)
    kept: HeldSandboxes | None = None


class VerifyRequest(_Msg, tag="verify.v1"):
    session: str | None
    row: dict[str, Any]
    response: Response
    close: bool = False  # close the session after verifying (saves a message)


class VerifyReply(_Msg, tag="verify.reply.v1"):
    reward: float
    fields: dict[str, Any] = field(default_factory=dict)
    answer_field: str | None = None  # the field holding the extracted answer (majority@k)
    served: Served | None = None  # who verified, with which code, and the session's model calls (the ledger)


class CloseSession(_Msg, tag="close.v1"):
    session: str


# ------------------------------------------------------------------ a rollout's checkpoint (resume at its last turn)


class HeldSandboxes(Struct, kw_only=True, omit_defaults=True):
    """An environment session's sandboxes at its last snapshot, and their lease: a fresh session restored from the
    snapshot takes them up by that lease (``RestoreSession``), files and all, while the pool still keeps them
    (its ``lease_grace_s`` after their holder, the dead resource worker, fell silent)."""

    lease: str
    sandboxes: list[SandboxHandle]


class ResumeSession(_Msg, tag="resume.v1"):
    """A resumed rollout asks the worker its checkpoint names whether it still holds the session (its own handler
    on that worker, never a tool call): ``ResumeReply.ok`` it does, and the rollout reattaches to it."""

    session: str


class RestoreSession(_Msg, tag="restore.v1"):
    """A fresh session (this rides its seed) set back to a checkpoint's ``snapshot`` (``Resource.restore``), taking
    up the sandboxes ``held`` at it by their lease where that lease is the restored rollout's own. A branch's
    (``branch_of``: its parent rollout's key) holds forks of the copies ``kept`` at its branch point instead, where
    they were leased to that rollout of the same caller."""

    session: str
    snapshot: bytes
    held: HeldSandboxes | None = None
    kept: HeldSandboxes | None = None
    branch_of: str = ""


class ResumeReply(_Msg, tag="resume.reply.v1"):
    """``ok``: the session is held (``ResumeSession``) or set back (``RestoreSession``); else ``reason`` says why
    not, and the rollout restarts clean."""

    ok: bool
    reason: str = ""


class SessionHandle(Struct, kw_only=True, omit_defaults=True):
    """An environment session a rollout holds: enough to reattach to it (its worker still holds it) or to
    restore a fresh one (``snapshot``: the environment's own bytes after the last turn, where it has them)."""

    resource: str
    session: str
    address: str  # the subject prefix of the worker that holds it
    snapshot: bytes | None = None
    held: HeldSandboxes | None = None  # its sandboxes at that snapshot (a restore reattaches to them)
    kept: HeldSandboxes | None = None  # copies of them kept at that snapshot for branching (a branch forks them)


class SandboxHandle(Struct, kw_only=True, omit_defaults=True):
    """One of a rollout's own sandboxes, as its checkpoint keeps it: enough for a resumed attempt to reattach to
    the same container by its lease (``attach``, at the worker that holds it), and to hand it to the create that
    asks for the same ``spec`` again."""

    pool: str
    sandbox: str
    address: str  # the subject prefix of the sandbox worker that holds it
    spec: SandboxSpec


class Checkpoint(Struct, kw_only=True, omit_defaults=True):
    """A rollout's state at a step of a turn that matters, kept in the checkpoints bucket under its identity
    (``Subjects.checkpoint_key``) and replaced as it goes: after a generation, before its tool calls run
    (``phase`` "generated": a resume replays those calls, never samples new ones), and after their replies
    ("answered"). ``response`` is the trajectory so far in the shape a failure row's partial trajectory has
    (``status: "incomplete"``, its items with their token ids, logprobs and policy versions)."""

    turn: int  # model turns made so far (the rows' ``resumed_from_turn`` when resumed from it)
    phase: Literal["generated", "answered"]
    response: Response
    last_status: str | None = "completed"  # the last generation's own status (``response``'s is "incomplete")
    last_from: int = 0  # where the last generation's items start in ``response.output``
    cost: Cost | None = None  # what the rollout used so far: a resumed attempt starts from it (never twice)
    turns: list[str] = field(default_factory=list)  # provenance.turns so far
    policy_versions: list[int] | None = None
    elapsed_s: float = 0.0  # the rollout's clock so far: a resumed attempt gets the rest of timeout_s
    sessions: list[SessionHandle] = field(default_factory=list)
    attempt: int = 1
    worker: str = ""  # the agent worker that wrote it
    # the agent's own sandboxes (``ctx.sandbox``) open at the checkpoint: a resumed attempt reattaches to them under
    # their lease (the secret each operation proves: only the rollout's agent pool reads its checkpoint)
    sandboxes: list[SandboxHandle] = field(default_factory=list)
    sandbox_lease: str = ""
    # the next turn's generation so far (its tokens streamed while it ran): a resumed attempt continues it
    generating: GenerationProgress | None = None
    # ``response.tools`` were the tools the trajectory offers (its ``params.tools``), left out: a resumed attempt
    # takes them from its own task's (an offered tool list can be most of a checkpoint, written each turn)
    offered_tools: bool = False
    # kept for branching (``keep_checkpoints_s``), an answered turn's: copies of the agent's own sandboxes as the turn
    # ended (``sandboxes.kept``), which a branch at the turn forks its own from (never ``sandboxes``, the live ones)
    kept: HeldSandboxes | None = None


class CheckpointPart(Struct, kw_only=True, omit_defaults=True):
    """One turn's share of a rollout's checkpoint (``rollout.checkpoint``), under the rollout's key and the part's
    number: part 1 holds the trajectory from its start, each next part what its turn added (a turn's later write
    replaces its part), so a late turn's write costs what an early one's does. Read in order, the parts' items and
    turns are the checkpoint's; the last part's ``head`` is the rest of it (a ``Checkpoint`` encoded, its
    ``turns`` left empty and its ``response`` in ``response``, that response's output left empty)."""

    rollout: str  # the rollout's key: a part under another rollout's key is not read
    chain: str  # the parts written after one part 1 share its chain: a part of another chain ends the read
    start: int = 0  # where its items start in the trajectory (the parts before it hold that many)
    items: list[Item] = field(default_factory=list)
    turns_start: int = 0  # where its ``turns`` start in the checkpoint's
    turns: list[str] = field(default_factory=list)
    head: bytes
    # its ``head``'s ``response`` (the last generation, its output left to the parts), encoded apart: the same for
    # each write of a turn, encoded once a turn (an offered tool list can be most of a checkpoint)
    response: bytes = b""


ErrorClass = Literal[
    "timeout",
    "model_error",
    "tool_error",
    "verify_error",
    "worker_lost",
    "invalid_task",
    "internal",
    "config_mismatch",  # the worker serves another config's entry of the same name (isolation)
    "cancelled",  # the batch was cancelled before this task started
    "budget",  # the batch's budget was spent before this task started (never stored: a resume may run it)
    "stale",  # the policy moved on more than the task's max_staleness before it started
    "busy",  # a direct call found no free slot (never in a row: the caller goes to the queue)
    "integrity",  # a stored body or result does not match what its message says (tampered, or missing)
    "lost",  # no result of the slot is stored, and none of its batch's tasks is queued or running any more
    "terminated",  # what "lost" was called before (a row stored by an older version may carry it)
    "storage_full",  # a stream was at its size limit (jetstream.*_max_bytes) when a body or result was stored
    # a sandbox pool released no lease for its ``lease_wait_s`` while the rollout waited for one (a wire change:
    # older readers refuse a row of this class, docs/changelog.md)
    "sandbox_unavailable",
    # the policy's input (a tool call, its answer to verify) killed the environment's guest process twice: on its
    # attempt and on the one retry it cost (a wire change, as sandbox_unavailable was: older readers refuse it)
    "input_crash",
]


class ErrorInfo(Struct, kw_only=True, omit_defaults=True, gc=False):
    """A typed error: what went wrong, and whether trying again may help (strings and a flag: in no
    reference cycle, so not tracked by the cycle collector)."""

    error_class: ErrorClass
    message: str
    retryable: bool = False


class ErrorReply(_Msg, tag="error.v1"):
    error: ErrorInfo


# ------------------------------------------------------------------ trainer control ({ns}.ctl.>)


class PolicyVersion(_Msg, tag="ctl.version.v1"):
    """``{ns}.ctl.model.{model}.version``: the trainer's current policy version for a model."""

    model: str
    version: int


class PauseModel(_Msg, tag="ctl.pause.v1"):
    """``{ns}.ctl.model.{model}.pause``: hold new calls; ack once none is in flight.

    ``mode``: ``drain`` (calls in flight finish), ``interrupt`` (they stop now, keep their tokens and
    continue after the resume) or ``abort`` (they stop now and are made again after the resume)."""

    model: str
    mode: str = "drain"


class ResumeModel(_Msg, tag="ctl.resume.v1"):
    """``{ns}.ctl.model.{model}.resume``: held calls continue."""

    model: str


class PauseAck(_Msg, tag="ctl.pause.ack.v1"):
    worker: str
    held: int = 0  # calls waiting behind the pause when it was acknowledged
    stopped: int = 0  # calls in flight that the pause stopped (interrupt, abort): they continue after the resume


class CancelBatch(_Msg, tag="ctl.cancel.v1"):
    """``{ns}.ctl.batch.{batch}.cancel``: tasks of the batch not yet started are never run."""

    batch: str


# ------------------------------------------------------------------ sandboxes ({ns}.sbx.>)


class SandboxSpec(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One sandbox's image and limits (``gym_runtime.sandboxes.spec``). ``None``: the pool's default.

    ``disk_mb`` caps the writable paths (``/work``, ``/tmp``, ``/root``; the rest is read-only),
    ``timeout_s`` is the longest one exec may run; ``network`` must stay False (docs/sandboxes.md).
    """

    image: str | None = None
    cpu: float | None = None
    memory_mb: int | None = None
    pids: int | None = None
    disk_mb: int | None = None
    timeout_s: float | None = None
    env: dict[str, str] = {}
    network: bool = False
    workdir: str | None = None  # where commands run: None, /work; "": the image's own WORKDIR
    # ``Sandbox.restart`` may be asked of it (a verify in the policy's own sandbox). Its Docker container is made
    # without the engine's auto-removal, which an engine before 23.0 races with a restart and then removes the
    # container (moby#43751): one its worker lost ends by itself all the same, and a reaper removes it.
    restartable: bool = False


class SandboxCall(_Msg, tag="sbx.call.v1"):
    """One operation of the sandbox fleet. ``create`` goes to a pool's queue group and names the lease (a random
    secret: ``sandboxes.leases``) and when it ends; ``exec``/``write``/``read``/``close`` and a background
    ``process``'s ``spawn``/``poll``/``wait``/``kill``, ``restart`` (every process ended, the files kept) and
    ``fork`` (copies of it, one per lease in ``leases``) go to the worker that holds ``sandbox``, each carrying
    that lease: the worker refuses one that does not prove it."""

    op: Literal[
        "create", "exec", "write", "read", "close", "present", "spawn", "poll", "wait", "kill", "restart", "renew",
        "attach", "fork",
    ]  # fmt: skip
    sandbox: str = ""
    spec: SandboxSpec | None = None
    lease: str = ""
    expires: float = 0.0  # unix time the lease ends (the rollout's deadline); 0: the pool's max_lease_s
    argv: list[str] = []
    timeout_s: float | None = None
    path: str = ""
    data: bytes = b""
    stream: bool = False  # exec: send the output to the caller as it comes (``Gym-Output`` messages), then reply
    process: str = ""  # poll/wait/kill: the background process
    # create: the caller's id for this create, the same on each of its tries. A worker that made (or is making) a
    # sandbox for it answers with that one, so a reply lost to a reconnect leaves no second sandbox held
    key: str = ""
    # create: the caller says it is alive every ``SandboxReply.renew_s`` while it holds the sandbox (``renew``), so
    # the pool ends it ``lease_grace_s`` after the caller fell silent (an older caller's: only after ``idle_ttl_s``)
    renews: bool = False
    # exec: the same on every attempt of a rollout's turn (``Trajectory.call_id``): the worker answers an id it ran
    # before with that first reply, and one still running with its reply once it ends (never run twice)
    id: str = ""
    # fork: the leases of the copies to make, one each (random secrets, as a create's ``lease``; never logged)
    leases: list[str] = []
    # fork: the copies are parked (a rollout's sandboxes at a turn, kept for branching): unused and unrenewed until
    # ``expires``, never ended as idle or for a silent holder; they count against the pool's quota
    park: bool = False
    # fork, parked: the batch of the rollout the copies are kept for (``Subjects.purged``: removed when it is purged)
    batch: str = ""


# An exec's outcome: the fields of an author's ``ExecResult`` (``sandboxes.spec``), which a reply carries as they are
EXEC_FIELDS = ("exit_code", "stdout", "stderr", "truncated", "timed_out", "duration_s")


class SandboxReply(_Msg, tag="sbx.reply.v1"):
    sandbox: str = ""
    process: str = ""  # spawn: the background process's id
    address: str = ""  # create: where this sandbox's operations go
    by: str = ""  # create, attach, fork: the worker's process (``node/pid``): a call left silent names it
    exit_code: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    data: bytes = b""
    cpu_s: float | None = None  # close: the CPU seconds the sandbox used, read just before its removal (None: unknown)
    full: bool = False  # create: this worker (or the pool's quota) has no room now; ask again later
    warm: bool = False  # create: served from the warm pool
    image: str = ""  # create: the content id of the image it runs (``Backend.image_id``; "": the backend has none)
    # a full answer (create, present): the worker's count of ended leases, and its pool's ``lease_wait_s`` (a waiter
    # that sees no count change for that long ends its rollout: ``sandbox_unavailable``)
    released: int = 0
    lease_wait_s: float = 0.0
    # create, attach: how often the holder says it is alive (``renew``); a sandbox whose holder falls silent is
    # kept for the pool's ``lease_grace_s``, for a resumed attempt to reattach to, then removed (0: never asked)
    renew_s: float = 0.0
    forked: list[str] = []  # fork: the copies' ids, in the order of the call's ``leases``

    @classmethod
    def of_exec(cls, sandbox: str, r: Any) -> SandboxReply:
        """An exec's reply from its result (a backend's or an author's ``ExecResult``: its ``EXEC_FIELDS``)."""
        return cls(sandbox=sandbox, **{f: getattr(r, f) for f in EXEC_FIELDS})


Envelope = (
    RolloutTask
    | RolloutResult
    | ModelRequest
    | ModelResponse
    | SeedRequest
    | SeedReply
    | ToolCall
    | ToolReply
    | VerifyRequest
    | VerifyReply
    | CloseSession
    | ResumeSession
    | RestoreSession
    | ResumeReply
    | ErrorReply
    | PolicyVersion
    | PauseModel
    | ResumeModel
    | PauseAck
    | CancelBatch
    | SandboxCall
    | SandboxReply
)

__all__ = [
    "AttemptRecord",
    "AttemptRetried",
    "AttemptStart",
    "BranchPoint",
    "Checkpoint",
    "CheckpointPart",
    "CloseSession",
    "Cost",
    "counted_ms",
    "CreateParams",
    "Envelope",
    "ErrorClass",
    "ErrorInfo",
    "ErrorReply",
    "EXEC_FIELDS",
    "FunctionCall",
    "FunctionCallOutput",
    "GenerationProgress",
    "Item",
    "KNOWN_ITEM_TYPES",
    "Message",
    "ModelCost",
    "ModelRequest",
    "ModelResponse",
    "Provenance",
    "Reasoning",
    "Response",
    "RolloutResult",
    "RestoreSession",
    "ResumeReply",
    "ResumeSession",
    "RolloutTask",
    "RowCheck",
    "SeedReply",
    "Served",
    "SessionHandle",
    "SeedRequest",
    "TimeSplit",
    "ToolCall",
    "ToolReply",
    "TRAINING_FIELDS",
    "Usage",
    "VerifyReply",
    "VerifyRequest",
    "ItemError",
    "SandboxCall",
    "SandboxReply",
    "SandboxSpec",
    "assistant_message",
    "parse_items",
    "create_params",
    "message_text",
    "last_item_text",
    "recorded_create_params",
    "output_text",
    "msgspec",
]


# ------------------------------------------------------------------ item parsing

_ITEM_TYPES: dict[str, type] = {
    "message": Message,
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "reasoning": Reasoning,
}


class ItemError(ValueError):
    """An input item we cannot interpret; the message names its index."""


def parse_items(raw: Any) -> list[Item]:
    """Turn a Responses ``input`` (a string, or a list of item dicts) into Structs.

    Easy input messages may omit ``type`` (NeMo Gym's datasets do); they are
    messages. Item types other than the four the runtime acts on are refused with
    a clear error rather than silently dropped.
    """
    if isinstance(raw, str):
        return [Message(role="user", content=raw)]
    if not isinstance(raw, list):
        raise ItemError(f"input must be a string or a list of items, got {type(raw).__name__}")
    items: list[Item] = []
    for i, d in enumerate(raw):
        if isinstance(d, _Item):
            items.append(d)  # type: ignore[arg-type]
            continue
        if not isinstance(d, dict):
            raise ItemError(f"input[{i}] must be an object, got {type(d).__name__}")
        kind = d.get("type") or ("message" if "role" in d else None)
        cls = _ITEM_TYPES.get(kind)  # type: ignore[arg-type]
        if cls is None:
            raise ItemError(f"input[{i}] has unsupported item type {kind!r}")
        if "type" not in d:
            d = {**d, "type": kind}
        try:
            items.append(msgspec.convert(d, cls))
        except msgspec.ValidationError as e:
            raise ItemError(f"input[{i}]: {e}") from None
    return items


_PARAM_FIELDS = frozenset(
    {
        "tools",
        "instructions",
        "temperature",
        "top_p",
        "max_output_tokens",
        "tool_choice",
        "parallel_tool_calls",
        "model",
    }
)


def create_params(raw: Any) -> CreateParams:
    """``responses_create_params`` of an input row → ``CreateParams`` (raises ``ItemError``).

    Unset (null) fields are dropped, as NeMo Gym's recorded rows carry many nulls;
    fields the runtime does not model travel in ``extra`` to the adapter.
    """
    if not isinstance(raw, dict):
        raise ItemError("responses_create_params must be an object")
    if "input" not in raw:
        raise ItemError("responses_create_params.input is missing")
    known: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for k, v in raw.items():
        if v is None or k == "input":
            continue
        (known if k in _PARAM_FIELDS else extra)[k] = v
    known["input"] = parse_items(raw["input"])
    try:
        params = msgspec.convert(known, CreateParams, strict=False, from_attributes=True)
    except msgspec.ValidationError as e:
        raise ItemError(f"responses_create_params: {e}") from None
    params.extra = extra
    return params
