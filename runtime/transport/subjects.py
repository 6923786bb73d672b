"""Every name the runtime gives NATS, built here and nowhere else: subjects, streams, durable consumers,
KV buckets and keys, queue groups, inboxes and reply lanes.

Workers, the collector, the client and the commands publish and subscribe with these functions, and
``gym_runtime.ops.permissions`` derives each role's allow-lists from the same ones, so what a role's
code does and what its credential may do cannot drift (``tests/test_subjects.py`` checks every
function against every role). A name argument may be a NATS wildcard where a permission needs one
(``"*"``; ``">"`` in the last token).

**Reply lanes.** A reply subject is ``{inbox}.{lane}.{n}``: the caller's inbox
(``_INBOX.{role}.{pool or _}.{nuid}`` on a secured bus) and a lane naming who answers
(``res.{resource}``, ``model.{model}``, ``agent.{agent}``). A responder may publish only into its own
lane (``lane_replies``), so the server refuses an answer from anyone else, and no role may publish
into another's whole inbox. An answer to a request many workers receive (``status``) goes to
``answer(reply, lane)``: the request's reply root with the responder's own lane appended.

It imports nothing of the runtime: every layer may use it (plain strings).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import NamedTuple

__all__ = [
    "ANY_ROLE",
    "APP_ACCOUNT",
    "BLOB_ROLES",
    "INBOX",
    "JS_ACCOUNT",
    "JS_ACK_PREFIX",
    "LOST",
    "SERVER_LANE",
    "AckFields",
    "Subjects",
    "ack_fields",
    "ack_reply",
    "acks",
    "advisory",
    "answer",
    "answers",
    "blob_role",
    "blob_space",
    "caller_of",
    "consumer_create",
    "consumer_delete",
    "consumer_info",
    "consumer_list",
    "direct_get",
    "inbox",
    "inbox_prefix",
    "jetstream_api",
    "js_info",
    "every_namespace_tasks",
    "kv_key",
    "kv_parts",
    "kv_stream",
    "lane",
    "lane_replies",
    "namespace_of",
    "msg_get",
    "pull_next",
    "reply",
    "stream_info",
    "stream_names",
]

INBOX = "_INBOX"
LOST = "_lost"  # a result subject's agent token for the failure rows of tasks that left the queue without a result
JS_ACK_PREFIX = "$JS.ACK."  # the reply subject of a message a JetStream consumer delivered
_JS_API = "$JS.API"

# the token a role's answers carry in their lane (``res`` predates the others: reply subjects of resource calls)
_LANE_KINDS = {"agent": "agent", "resource": "res", "model": "model", "sandbox": "sbx"}
SERVER_LANE = "js.ack"  # the lane of what the server itself answers (a stream's ack of a stored message)

# the two accounts of a secured server (``gym_runtime.ops.permissions``): JetStream lives in JS, every user in APP
JS_ACCOUNT = "JS"
APP_ACCOUNT = "APP"

_KV_KEY = re.compile(r"[-_A-Za-z0-9]+")


def _kv_batch(batch: str) -> str:
    """A batch id as a KV key's token: one a key cannot hold is hashed (a wildcard stays one)."""
    if batch not in ("*", ">") and not _KV_KEY.fullmatch(batch):
        return hashlib.sha256(batch.encode()).hexdigest()[:24]
    return batch


_NOT_NAME = re.compile(r"[^A-Za-z0-9_-]")


# ------------------------------------------------------------------------------- large bodies' key spaces

# the roles that send large bodies, each with a blob stream of its own (a secured server provisions each)
BLOB_ROLES = ("publisher", "agent", "model", "sandbox", "resource")
ANY_ROLE = "any"  # the blob key spaces of an unsecured connection that names no role


def blob_space(role: str | None, pool: str | None) -> str:
    """The key space a connection writes its large bodies into: its role's stream, its pool's keys."""
    return f"{role if role in BLOB_ROLES else ANY_ROLE}.{pool or '_'}"


def blob_role(space: str) -> str:
    """The role whose blob stream holds a key space (``blob_space``)."""
    return space.partition(".")[0]


# ------------------------------------------------------------------------------- inboxes and reply lanes


def inbox_prefix(role: str, pool: str | None = None) -> str:
    """A connection's inbox prefix on a secured bus: its role's, narrowed to its pool when it holds one."""
    return f"{INBOX}.{role}.{pool or '_'}"


def inbox(role: str, pool: str | None = None) -> str:
    """Every subject a connection of ``role`` (or of one ``pool``) receives replies on."""
    return f"{inbox_prefix(role, pool)}.>" if pool else f"{INBOX}.{role}.>"


def caller(reply_subject: str) -> str:
    """Whose inbox a reply subject is: ``{role}.{pool}`` of ``_INBOX.{role}.{pool}...`` ('' for another form)."""
    parts = reply_subject.split(".", 3)
    return f"{parts[1]}.{parts[2]}" if len(parts) == 4 and parts[0] == INBOX else ""


def caller_of(role: str | None, pool: str | None) -> str:
    """Who a connection calls as: ``{role}.{pool}`` (``_`` for a role-wide credential, or no role on an unsecured
    bus); the two tokens a seed request's subject ends with (``Subjects.seed``)."""
    return f"{role or '_'}.{pool or '_'}"


def lane(role: str, name: str) -> str:
    """The lane of the answers a worker of ``role`` serving entry ``name`` gives: ``res.weather``, ..."""
    return f"{_LANE_KINDS[role]}.{name}"


def reply(prefix: str, lane: str, n: int | str) -> str:
    """A call's reply subject: the caller's ``prefix`` (its inbox and connection), the callee's lane, a number."""
    return f"{prefix}.{lane}.{n}"


def answer(root: str, lane: str) -> str:
    """Where a worker answers a request sent to many (``status``): the request's reply root, its own lane."""
    return f"{root}.{lane}.0"


def answers(root: str) -> str:
    """Every reply under ``root`` (a connection's reply prefix, or the reply root of a request sent to many)."""
    return f"{root}.>"


def lane_replies(lane: str) -> str:
    """Every reply subject in ``lane``, whoever the caller: what a responder may publish into."""
    return f"{INBOX}.*.*.*.{lane}.*"


# ------------------------------------------------------------------------------- NATS's own API subjects


def js_info() -> str:
    """JetStream's account info (nats-py asks it on connect; ``health`` asks it)."""
    return f"{_JS_API}.INFO"


def stream_names() -> str:
    """Which stream holds a subject (nats-py's ``find_stream_name_by_subject``)."""
    return f"{_JS_API}.STREAM.NAMES"


def stream_info(stream: str) -> str:
    return f"{_JS_API}.STREAM.INFO.{stream}"


def consumer_create(stream: str, name: str, filter_subject: str) -> str:
    """A named consumer's creation, its filter in the subject (as nats-py sends it), so a permission can
    allow one queue and no other (the legacy DURABLE.CREATE carries the filter in the body)."""
    return f"{_JS_API}.CONSUMER.CREATE.{stream}.{name}.{filter_subject}"


def consumer_info(stream: str, name: str) -> str:
    return f"{_JS_API}.CONSUMER.INFO.{stream}.{name}"


def consumer_delete(stream: str, name: str) -> str:
    return f"{_JS_API}.CONSUMER.DELETE.{stream}.{name}"


def consumer_list(stream: str) -> str:
    return f"{_JS_API}.CONSUMER.LIST.{stream}"


def pull_next(stream: str, consumer: str) -> str:
    """A pull request: up to N messages of a consumer, delivered to the request's reply subject."""
    return f"{_JS_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def acks(stream: str, consumer: str) -> str:
    """The ack (nak, term, in-progress) subjects of a consumer's deliveries."""
    return f"{JS_ACK_PREFIX}{stream}.{consumer}.>"


class AckFields(NamedTuple):
    """What a JetStream delivery's reply subject says of the message (``ack_fields``)."""

    delivered: int  # which delivery this is (1 the first time)
    stream_seq: int  # its sequence in its stream
    stored_ns: int  # when the stream stored it, in ns since the epoch


def ack_reply(stream: str, consumer: str, fields: AckFields) -> str:
    """A delivery's reply subject in the server's first form, with no pending count (the in-memory double's)."""
    return f"{JS_ACK_PREFIX}{stream}.{consumer}.{fields.delivered}.{fields.stream_seq}.0.{fields.stored_ns}.0"


def ack_fields(reply: str) -> AckFields | None:
    """A JetStream delivery's fields, read off its reply subject (``$JS.ACK.<stream>.<consumer>.<delivered>.
    <stream seq>.<consumer seq>.<ns>.<pending>``, or the second form's: a domain and an account hash before the
    stream and a token at the end); None for any other reply. nats-py's ``Msg.metadata`` reads the same tokens
    into three objects and a datetime: 2 a weather rollout, ~10 Python calls."""
    if not reply.startswith(JS_ACK_PREFIX):
        return None
    tokens = reply.split(".")
    n = len(tokens)
    at = 4 if n == 9 else 6 if n >= 11 else 0
    if not at:
        return None
    try:
        return AckFields(int(tokens[at]), int(tokens[at + 1]), int(tokens[at + 3]))
    except ValueError:
        return None


def direct_get(stream: str, subject: str | None = None) -> str:
    """A direct get from ``stream``: by sequence or request body, or the last message of ``subject``."""
    return f"{_JS_API}.DIRECT.GET.{stream}" + (f".{subject}" if subject else "")


def msg_get(stream: str) -> str:
    """A stored message by sequence or subject (nats-py's KV get on a stream without direct gets)."""
    return f"{_JS_API}.STREAM.MSG.GET.{stream}"


def jetstream_api() -> list[str]:
    """The JetStream API a secured server's APP account imports from the JS account (answered one message each;
    pulls, answered with a stream of messages, are ``pull_next("*", "*")``): what the roles and the admin use,
    and nothing else (no snapshots, restores, account purges, server or peer removals, leader changes)."""
    return [
        js_info(),
        stream_names(),
        f"{_JS_API}.STREAM.LIST",
        stream_info("*"),
        *(f"{_JS_API}.STREAM.{op}.*" for op in ("CREATE", "UPDATE", "DELETE", "PURGE", "MSG.GET", "MSG.DELETE")),
        direct_get("*"),
        direct_get("*", ">"),
        f"{_JS_API}.CONSUMER.CREATE.>",
        f"{_JS_API}.CONSUMER.DURABLE.CREATE.>",
        consumer_info("*", "*"),
        consumer_delete("*", "*"),
        consumer_list("*"),
        f"{_JS_API}.CONSUMER.NAMES.*",
    ]


def advisory(event: str, stream: str) -> str:
    """JetStream's advisories of one kind about ``stream``'s consumers (``MSG_TERMINATED``, ...)."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.{event}.{stream}.>"


def kv_stream(bucket: str) -> str:
    """The stream behind a KV bucket."""
    return f"KV_{bucket}"


def kv_key(bucket: str, key: str) -> str:
    """The subject a KV bucket's ``key`` is written to."""
    return f"$KV.{bucket}.{key}"


def kv_parts(subject: str) -> tuple[str, str] | None:
    """The bucket and key a ``kv_key`` subject writes (None: not a KV key's)."""
    if not subject.startswith("$KV."):
        return None
    _, bucket, key = subject.split(".", 2)
    return bucket, key


def every_namespace_tasks() -> str:
    """What the tasks streams of every namespace store: which namespaces a server holds (``namespace_of``)."""
    return Subjects("*").all_tasks


def namespace_of(tasks_subject: str) -> str | None:
    """The namespace whose tasks stream stores ``tasks_subject`` (``exp.task.>``: ``exp``); None for another."""
    head, sep, _ = tasks_subject.partition(".task.")
    return head if sep and head else None


# ------------------------------------------------------------------------------- one namespace's names


class Subjects:
    """The names of one namespace (``gym`` by default; experiments that share a cluster each have their own).

    Resolved once per bus (``Bus.subjects``) and carried, never re-derived at a call site.
    """

    __slots__ = ("ns", "_base", "_dot")

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self._base = ns.upper().replace("-", "_")
        self._dot = ns + "."

    def __repr__(self) -> str:
        return f"Subjects({self.ns!r})"

    # -- streams and buckets (names are a contract: KEDA's nats-jetstream scaler and /jsz read them)

    @property
    def tasks_stream(self) -> str:
        """The work queue of rollout tasks (every agent's, every batch's)."""
        return f"{self._base}_TASKS"

    def results_stream(self, agent: str) -> str:
        """The stream of one agent's results (``LOST``: the reader's records of lost slots): a stream per
        writer, so a pool that fills its own is refused there and never evicts or starves another's."""
        return f"{self._base}_RESULTS_{agent}"

    @property
    def shared_results_stream(self) -> str:
        """One stream of every agent's results: what a secured server started without a config (so with no
        agent pools to keep apart) provisions, and what an older version made."""
        return f"{self._base}_RESULTS"

    @property
    def model_stream(self) -> str:
        """The work queue of model calls no replica had a free slot for."""
        return f"{self._base}_MODEL"

    @property
    def legacy_blob_stream(self) -> str:
        """The one blob stream of every role an earlier version made (its subjects overlap every role's)."""
        return f"{self._base}_BLOBS"

    def blob_stream(self, role: str) -> str:
        """Bodies over the max payload that ``role`` sent (one of ``BLOB_ROLES``), as write-once chunks: a
        stream per role, so one role's flood never refuses another's bodies."""
        return f"{self._base}_BLOBS_{role.upper()}"

    @property
    def batches_bucket(self) -> str:
        """The KV bucket of batch manifests."""
        return f"{self._base}_BATCHES"

    @property
    def control_bucket(self) -> str:
        """The KV bucket of the trainer's control state (versions, pauses, cancels) and failed-attempt counts."""
        return f"{self._base}_CONTROL"

    @property
    def checkpoints_bucket(self) -> str:
        """The KV bucket of rollouts' checkpoints (resume at the last turn): one key per rollout, replaced as it
        goes, deleted with its row; only the agent role reads or writes it (``ops/permissions.py``)."""
        return f"{self._base}_CHECKPOINTS"

    @property
    def sampler_bucket(self) -> str:
        """The KV bucket of the task sampler's per-task statistics (``data.sampling``): the publisher's, one key per
        run and task, so a restarted trainer, or another one of the same run, picks up where it was."""
        return f"{self._base}_SAMPLER"

    @property
    def stored(self) -> list[str]:
        """Every subject a stream of this namespace stores (the streams', the KV buckets' and the kept bodies'):
        what a secured server's APP account publishes into the JS account, which holds JetStream."""
        return [
            self.all_tasks,
            self.all_results,
            self.all_model_queues,
            self.all_blobs,
            self.all_kept,
            self.all_attempts,
            kv_key(self.batches_bucket, ">"),
            kv_key(self.control_bucket, ">"),
            kv_key(self.checkpoints_bucket, ">"),
            kv_key(self.sampler_bucket, ">"),
        ]

    def stream(self, kind: str) -> str:
        """The work-queue stream of ``kind``: ``task`` or ``model``."""
        return {"task": self.tasks_stream, "model": self.model_stream}[kind]

    def stream_subjects(self, kind: str) -> str:
        """What the work-queue stream of ``kind`` (``task``, ``model``) stores."""
        return {"task": self.all_tasks, "model": self.all_model_queues}[kind]

    # -- rollout tasks

    def task(self, agent: str, batch: str) -> str:
        """Where a batch's tasks for one agent are queued: per (agent, batch), so the server can say how many
        of a batch's tasks are still queued or held (a task leaves only when acked or terminated)."""
        return f"{self.ns}.task.{agent}.{batch}"

    def agent_tasks(self, agent: str) -> str:
        """An agent's work queue: its tasks of every batch (the filter of its durable)."""
        return f"{self.ns}.task.{agent}.>"

    def batch_tasks(self, batch: str) -> str:
        """Every agent's queued tasks of ``batch``."""
        return f"{self.ns}.task.*.{batch}"

    @property
    def all_tasks(self) -> str:
        """The tasks stream's subjects."""
        return f"{self.ns}.task.>"

    @property
    def everything(self) -> str:
        """Every subject of the namespace: its streams are the ones whose subjects overlap it (not its buckets)."""
        return f"{self.ns}.>"

    # -- results

    def result(self, agent: str, batch: str) -> str:
        """Where an agent pool stores a batch's results: per (agent, batch), so a pool's credential can be
        allowed its own results and no other pool's."""
        return f"{self.ns}.result.{agent}.{batch}"

    def lost(self, batch: str) -> str:
        """Where a collector stores failure rows of a batch's tasks that were removed without a result; a
        message there is only ever read as a failure row, so whoever may write it can forge no reward."""
        return self.result(LOST, batch)

    def batch_results(self, batch: str) -> str:
        """Every agent's results of ``batch`` (the readers' filter)."""
        return f"{self.ns}.result.*.{batch}"

    def agent_results(self, agent: str) -> str:
        """Every result an agent's pool may store."""
        return f"{self.ns}.result.{agent}.>"

    @property
    def all_results(self) -> str:
        """The results stream's subjects."""
        return f"{self.ns}.result.>"

    def result_parts(self, subject: str) -> tuple[str, str] | None:
        """(agent, batch) of a result subject ``{ns}.result.{agent}.{batch}`` (agent ``LOST`` for a reader's
        record of a lost slot); None for any other subject."""
        prefix = f"{self.ns}.result."
        agent, dot, batch = subject.removeprefix(prefix).partition(".")
        if not subject.startswith(prefix) or not dot or not agent or not batch or "." in batch:
            return None
        return agent, batch

    # -- model calls

    def model_queue(self, model: str) -> str:
        """A model's work queue (calls waiting for a free slot)."""
        return f"{self.ns}.model.{model}"

    @property
    def all_model_queues(self) -> str:
        """The model stream's subjects."""
        return f"{self.ns}.model.>"

    def model_direct(self, model: str) -> str:
        """Direct (core) calls to a replica with a free slot: outside the model stream's subjects."""
        return f"{self.ns}.call.model.{model}"

    def model_replica(self, model: str, worker: str) -> str:
        """Direct calls to one replica (``worker``: its id, a rollout's last turn's ``ModelResponse.worker``): a
        rollout's next turn tries the replica that holds its prefix first (``model_calls.call_model``)."""
        return f"{self.ns}.call.model.{model}.{worker}"

    def model_group(self, model: str) -> str:
        """The queue group of a model's replicas on its direct subject."""
        return f"model.{model}"

    # -- environments (resources)

    def seed(self, resource: str, caller: str) -> str:
        """Opening a session (a queue group of the environment's workers; the reply names the session), as
        ``caller`` (``caller_of``: ``agent.NAME``, ``resource.NAME``; ``*.*`` for the workers' subscription, or
        ``agent.*`` for a role-wide credential's permission). The caller is in the subject, which the server
        checks (each pool may publish only its own), not in the reply, which the publisher chooses: a worker
        bounds sessions per caller by it."""
        return f"{self.ns}.res.{resource}.seed.{caller}"

    def seed_caller(self, subject: str) -> str:
        """The caller a seed request's subject names (``Subjects.seed``), '' for another subject."""
        t = subject.split(".")
        if len(t) == 6 and t[0] == self.ns and t[1] == "res" and t[3] == "seed":
            return f"{t[4]}.{t[5]}"
        return ""

    def stateless_verify(self, resource: str) -> str:
        """Verification without a session (``reverify``), a queue group."""
        return f"{self.ns}.res.{resource}.verify"

    def session(self, resource: str, worker: str) -> str:
        """The address of the worker that holds a session (its ops go to ``session_call``)."""
        return f"{self.ns}.res.{resource}.{worker}"

    @staticmethod
    def session_call(address: str, op: str, caller: str) -> str:
        """One operation on an environment's session (``tool``, ``verify`` or ``close``; ``*``: every one) as
        ``caller`` (``caller_of``; ``*.*`` for the worker's subscription, ``agent.*`` for a role-wide credential's
        permission). The caller is in the subject, as a seed's is (``seed``), so a secured server lets each pool
        send only its own: the worker answers a session only for the caller that seeded it."""
        return f"{address}.{op}.{caller}"

    def session_caller(self, subject: str) -> str:
        """The caller a session operation's subject names (``session_call``), '' for another subject."""
        t = subject.split(".")
        if len(t) == 7 and t[0] == self.ns and t[1] == "res":
            return f"{t[5]}.{t[6]}"
        return ""

    def resource(self, resource: str) -> str:
        """Every subject of one environment (what an agent or a calling environment may publish to)."""
        return f"{self.ns}.res.{resource}.>"

    @property
    def all_resources(self) -> str:
        """Every environment's subjects."""
        return f"{self.ns}.res.>"

    def resource_group(self, resource: str) -> str:
        """The queue group of an environment's workers on its seed and stateless-verify subjects."""
        return f"res.{resource}"

    # -- sandboxes (containers the sandbox workers hold for rollouts)

    def sandbox_create(self, pool: str, caller: str) -> str:
        """Creating a sandbox (a queue group of the pool's workers; the reply names the worker that holds it), as
        ``caller`` (``caller_of``; ``*.*`` for the workers' subscription). The caller is in the subject, which the
        server checks (each pool may publish only its own, as a seed's), and the sandbox is bound to it."""
        return f"{self.ns}.sbx.{pool}.create.{caller}"

    def sandbox_present(self, pool: str) -> str:
        """Is any worker of the pool there (a queue group; answered even when full): a create nobody took
        means the pool is full, not gone, when this one is answered."""
        return f"{self.ns}.sbx.{pool}.present"

    def sandbox_worker(self, pool: str, worker: str) -> str:
        """The address of the sandbox worker that holds a sandbox (its ops go to ``sandbox_op``)."""
        return f"{self.ns}.sbx.{pool}.{worker}"

    @staticmethod
    def sandbox_op(address: str, op: str, caller: str) -> str:
        """One operation on a sandbox (``exec``, ``write``, ``read``, ``close``, ...; ``*``: every one) as ``caller``
        (``caller_of``; ``*.*``: any), which must be the one that created it, as its lease must be its lease."""
        return f"{address}.{op}.{caller}"

    def sandbox_caller(self, subject: str) -> str:
        """The caller a create's or an operation's subject names (``sandbox_create``, ``sandbox_op``), '' for
        another subject."""
        t = subject.split(".")
        if len(t) in (6, 7) and t[0] == self.ns and t[1] == "sbx" and (len(t) == 7 or t[3] == "create"):
            return f"{t[-2]}.{t[-1]}"
        return ""

    def sandbox_calls(self, pool: str, caller: str) -> list[str]:
        """What ``caller`` (``caller_of``; ``agent.*`` for a role-wide credential) may publish to use sandbox
        ``pool`` (``*``: every pool): creates and operations as itself, and the pool's presence."""
        ops = self.sandbox_op(self.sandbox_worker(pool, "*"), "*", caller)
        return [self.sandbox_create(pool, caller), self.sandbox_present(pool), ops]

    def sandboxes(self, pool: str) -> str:
        """Every subject of one sandbox pool (what its workers subscribe to)."""
        return f"{self.ns}.sbx.{pool}.>"

    @property
    def all_sandboxes(self) -> str:
        return f"{self.ns}.sbx.>"

    def sandbox_group(self, pool: str) -> str:
        """The queue group of a sandbox pool's workers on its create subject."""
        return f"sbx.{pool}"

    # -- large bodies (``space``: ``{role}.{pool}``, the sender's own key space; ``blob_space``)

    def blob(self, space: str, key: str, chunk: int | str) -> str:
        return f"{self.ns}.blob.{space}.{key}.{chunk}"

    def role_blobs(self, role: str) -> str:
        """What the blob stream of ``role`` stores (every pool's key space of that role)."""
        return f"{self.ns}.blob.{role}.>"

    def pool_blobs(self, role: str, pool: str) -> str:
        """The key space one credential may write (``pool`` ``*``: every pool's, a role-wide credential's)."""
        return f"{self.ns}.blob.{role}.{pool}.>"

    @property
    def all_blobs(self) -> str:
        """Every blob stream's subjects."""
        return f"{self.ns}.blob.>"

    def blob_get(self, space: str, key: str, chunk: int | str) -> str:
        """A chunk read by its key (a last-by-subject direct get): the only way a body is read."""
        return direct_get(self.blob_stream(blob_role(space)), self.blob(space, key, chunk))

    @property
    def blob_probe(self) -> str:
        """A subject of the blob stream provisioned last: once it has a stream, every stream is there."""
        return self.blob(blob_space(BLOB_ROLES[-1], None), "probe", 0)

    # -- the bodies a batch keeps (a task whose stored result the broker lost is published again from its own)

    @property
    def kept_stream(self) -> str:
        return f"{self._base}_KEPT"

    def kept(self, batch: str, task: int | str) -> str:
        """Where ``publish`` keeps a task's body until its batch is purged (``*``: every task of the batch)."""
        return f"{self.ns}.kept.{batch}.{task}"

    @property
    def all_kept(self) -> str:
        """The kept stream's subjects."""
        return f"{self.ns}.kept.>"

    def kept_get(self, batch: str, task: int | str) -> str:
        """A kept body read back (a last-by-subject direct get): no listing, no consumer."""
        return direct_get(self.kept_stream, self.kept(batch, task))

    # -- each attempt's own record (``explain``: where and when it ran, why it was given back)

    @property
    def attempts_stream(self) -> str:
        return f"{self._base}_ATTEMPTS"

    def attempt(self, agent: str, batch: str) -> str:
        """Where an agent pool's workers record their attempts at a batch's tasks (several to a message)."""
        return f"{self.ns}.attempt.{agent}.{batch}"

    def agent_attempts(self, agent: str) -> str:
        """Every attempt record an agent pool may write."""
        return f"{self.ns}.attempt.{agent}.>"

    @property
    def all_attempts(self) -> str:
        """The attempts stream's subjects."""
        return f"{self.ns}.attempt.>"

    # -- work-queue consumers and their pools' liveness

    @staticmethod
    def durable(kind: str, name: str) -> str:
        """The durable consumer of a work queue: ``agent_{name}`` on the tasks, ``model_{name}`` on the model
        queue (a contract: autoscalers read them)."""
        return f"{'agent' if kind == 'task' else kind}_{name}"

    def queue_filter(self, kind: str, name: str) -> str:
        """What the durable of ``kind`` (``task`` or ``model``) for ``name`` takes from its stream."""
        return self.agent_tasks(name) if kind == "task" else self.model_queue(name)

    @staticmethod
    def reader(who: str, batch: str) -> str:
        """A fresh name for a no-ack reader of a batch's results (``collect``, the client, ``status``)."""
        return f"{who}_{_NOT_NAME.sub('_', batch)}_{uuid.uuid4().hex[:8]}"

    def live(self, kind: str, name: str) -> str:
        """Liveness beacons of the workers of one pool (``kind`` ``task`` or ``model``: what each took and
        finished, so peers nak a dead one's at once; ``sandbox``: which workers are alive, so peers reap a
        dead one's containers). Per role, so no role hears or forges another's."""
        return f"{self.ns}.live.{'agent' if kind == 'task' else kind}.{name}"

    # -- trainer control

    def policy_version(self, model: str) -> str:
        return f"{self.ns}.ctl.model.{model}.version"

    def pause(self, model: str) -> str:
        """Every live replica acknowledges into the caller's ``model.{model}`` lane."""
        return f"{self.ns}.ctl.model.{model}.pause"

    def resume(self, model: str) -> str:
        return f"{self.ns}.ctl.model.{model}.resume"

    def cancel(self, batch: str) -> str:
        return f"{self.ns}.ctl.batch.{batch}.cancel"

    def purged(self, batch: str) -> str:
        """Said by ``purge`` (a control message, no body): the sandbox workers remove the copies kept for branching
        the batch's rollouts (``SandboxCall.batch``); ``*``: every batch, as they listen."""
        return f"{self.ns}.ctl.batch.{batch}.purged"

    def purged_batch(self, subject: str) -> str:
        """The batch a ``purged`` subject names ("" for another subject)."""
        head, tail = f"{self.ns}.ctl.batch.", ".purged"
        return subject[len(head) : -len(tail)] if subject.startswith(head) and subject.endswith(tail) else ""

    # keys of the control bucket (a KV key allows fewer characters than a batch id: those are hashed)

    @staticmethod
    def version_key(model: str) -> str:
        return f"model.{model}.version"

    @staticmethod
    def paused_key(model: str) -> str:
        return f"model.{model}.paused"

    @staticmethod
    def cancelled_key(batch: str) -> str:
        return f"batch.{batch}.cancelled"

    @staticmethod
    def failed_key(agent: str, batch: str, task_index: int | str, rollout_index: int | str) -> str:
        """Where an agent pool counts a rollout's failed attempts (its workers may write only their own
        agent's: ``failed_keys``)."""
        return f"failed.{agent}.{_kv_batch(batch)}.{task_index}.{rollout_index}"

    @staticmethod
    def failed_keys(agent: str) -> str:
        return f"failed.{agent}.>"

    @staticmethod
    def checkpoint_key(agent: str, batch: str, task_index: int | str, rollout_index: int | str) -> str:
        """A rollout's checkpoint in the checkpoints bucket (its agent pool's workers may touch only their own
        agent's: ``checkpoint_keys``)."""
        return f"{agent}.{_kv_batch(batch)}.{task_index}.{rollout_index}"

    @staticmethod
    def checkpoint_keys(agent: str) -> str:
        return f"{agent}.>"

    @staticmethod
    def checkpoint_part(key: str, part: int) -> str:
        """Part ``part`` of a rollout's checkpoint (``rollout.checkpoint``: a turn's share), under its key."""
        return f"{key}.{part}"

    @staticmethod
    def batch_checkpoints(batch: str) -> str:
        """Every key of a batch's rollouts' checkpoints, each part and a whole one the previous version wrote."""
        return f"*.{_kv_batch(batch)}.>"

    @staticmethod
    def sampler_key(run: str, task: str) -> str:
        """A task's statistics in the sampler bucket, per run (``SamplerConfig.run``): two runs stay apart."""
        return f"{run}.{task}"

    @staticmethod
    def manifest_key(batch: str) -> str:
        """A batch's manifest in the batches bucket."""
        return batch

    # -- discovery

    @property
    def status(self) -> str:
        """Every live worker answers with what it serves and its counters (``answer``: into its own lane)."""
        return f"{self.ns}.status"

    # -- reading a subject back

    def kind(self, subject: str) -> str:
        """What a subject of this namespace is for: its first token after the namespace (``task``, ``result``,
        ``model``, ``blob``, ``res``, ``sbx``, ...)."""
        return subject[len(self._dot) :].split(".", 1)[0] if subject.startswith(self._dot) else ""

    def callee_lane(self, subject: str) -> str:
        """The lane a call to ``subject`` is answered in (``res.{resource}``, ``model.{model}`` or ``sbx.{pool}``;
        ``x.x``: none):
        on a secured bus only that callee may publish into it."""
        t = subject.split(".", 5)
        if len(t) > 3 and t[0] == self.ns and t[1] in ("call", "ctl"):
            return f"{t[2]}.{t[3]}"  # {ns}.call.model.{m}, {ns}.ctl.model.{m}.pause
        if len(t) > 2 and t[0] == self.ns:
            return f"{t[1]}.{t[2]}"  # {ns}.model.{m}, {ns}.res.{r}.seed, {ns}.res.{r}.{worker}.{op}
        return "x.x"


def classify(names: Subjects, subject: str) -> tuple[str, str, str]:
    """(stage, what, component) of a call by its subject (``Subjects``' layouts)."""
    t = subject.split(".")
    if len(t) >= 4 and t[1] == "call" and t[2] == "model":
        return "generating", f"generating on model {t[3]}", f"models.{t[3]}"
    if len(t) == 3 and t[1] == "model":
        return "generating", f"generating on model {t[2]}", f"models.{t[2]}"
    if len(t) >= 4 and t[1] == "res":
        env = t[2]
        if t[3] == "seed":
            return "session", f"opening a session of environment {env}", f"resources.{env}"
        if t[3] == "verify":
            return "verify", f"in verify of environment {env}", f"resources.{env}"
        op = t[4] if len(t) > 4 else "?"
        stage = {"tool": "tool", "verify": "verify"}.get(op, "session")
        what = {"tool": "in a tool", "verify": "in verify"}.get(op, op)
        return stage, f"{what} of environment {env} on worker {t[3]}", f"resources.{env}"
    if len(t) >= 4 and t[1] == "sbx":
        pool = t[2]
        if t[3] == "create":
            return "sandbox_wait", f"waiting for a sandbox of pool {pool}", f"sandboxes.{pool}"
        op = t[4] if len(t) > 4 else "?"
        return "sandbox", f"sandbox {op} in pool {pool} on worker {t[3]}", f"sandboxes.{pool}"
    return "call", f"a call to {subject}", subject
