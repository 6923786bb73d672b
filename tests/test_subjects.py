"""Every subject the runtime uses, against every role and a pool of each (issue 33, item 1).

The table below says, for each function of the subjects module, who publishes and who subscribes what it
builds; the permissions the secured server is given (``ops.permissions``, derived from the same module)
must allow exactly that: each use by whoever the code has do it, and nothing else. A function the table
does not classify fails the test, so a new subject cannot be added without deciding who may use it. The
end-to-end side (the same rules on a real server, attacked) is ``tests/e2e/test_borrowed_replies.py``.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path
from typing import NamedTuple

import pytest

from gym_runtime.ops.permissions import Reach, permissions, server_config
from gym_runtime.ops.security import ensure_auth_dir
from gym_runtime.transport import subjects as sj
from gym_runtime.transport.subjects import Subjects

s = Subjects("gym")
REACH = Reach(
    agents={"a": ("env_a",), "b": ("env_b",)},
    resources={"caller": ("env_a",)},
    agent_sandboxes={"a": ("box",), "b": ()},
    resource_sandboxes={"caller": ("box",)},
)
CREDS = [
    "publisher",
    "agent",
    "agent.a",
    "agent.b",
    "resource",
    "resource.env_a",
    "resource.env_b",
    "resource.caller",
    "model",
    "model.m",
    "model.n",
    "sandbox",
    "sandbox.box",
    "sandbox.other",
]
WORKERS = {"agent", "agent.a", "agent.b", "resource", "resource.env_a", "resource.env_b", "resource.caller"}
WORKERS |= {"model", "model.m", "model.n", "sandbox", "sandbox.box", "sandbox.other"}
EVERYONE = {"publisher", *WORKERS}
AGENTS = {c for c in CREDS if c.startswith("agent")}
MODELS = {c for c in CREDS if c.startswith("model")}
RESOURCES = {c for c in CREDS if c.startswith("resource")}
BOX_USERS = {"agent", "agent.a", "resource", "resource.caller"}  # the config's users of sandbox pool "box"
BOX = {"sandbox", "sandbox.box"}  # the workers of sandbox pool "box"


def of(role: str, *pools: str) -> set[str]:
    """A role's credentials that may do what ``pools`` do: those pools', and the role-wide one."""
    return {role, *(f"{role}.{p}" for p in pools)}


class Use(NamedTuple):
    fn: str  # the subjects-module function that builds it
    subject: str
    pub: set[str]
    sub: set[str]


PUB = "_INBOX.publisher._.nuid"  # a publisher connection's reply prefix (its inbox, its connection)
AGENT_A = "_INBOX.agent.a.nuid"
RES_ENV_A = "_INBOX.resource.env_a.nuid"
ACK = "1.2.3.1700000000000000000.0"  # the tail of a delivered message's ack subject

USES = [
    # rollout tasks: the publisher queues them, each agent's pool pulls its own through its durable
    Use("task", s.task("a", "b1"), {"publisher"}, set()),
    Use("agent_tasks", sj.consumer_create(s.tasks_stream, "agent_a", s.agent_tasks("a")), of("agent", "a"), set()),
    Use("agent_tasks", sj.consumer_create(s.tasks_stream, "agent_a", s.agent_tasks("b")), {"agent"}, set()),
    Use("consumer_info", sj.consumer_info(s.tasks_stream, "agent_a"), of("agent", "a"), set()),
    Use("pull_next", sj.pull_next(s.tasks_stream, "agent_a"), of("agent", "a"), set()),
    Use("acks", f"$JS.ACK.{s.tasks_stream}.agent_a.{ACK}", of("agent", "a"), set()),
    Use("live", s.live("task", "a"), of("agent", "a"), of("agent", "a")),
    Use("live", s.live("task", "b"), of("agent", "b"), of("agent", "b")),
    # results: each agent's pool stores its own; the collector's readers, and its failure rows of lost tasks
    Use("result", s.result("a", "b1"), of("agent", "a"), set()),
    Use("result", s.result("b", "b1"), of("agent", "b"), set()),
    Use("lost", s.lost("b1"), {"publisher"}, set()),  # a reader's records of lost slots: never an agent's
    # every reader of a batch (collect, the client, status): a durable of its own on each agent's results stream
    *(
        Use(
            "reader",
            sj.consumer_create(s.results_stream(a), s.reader(who, "b1"), s.result(a, "b1")),
            {"publisher"},
            set(),
        )
        for who in ("collect", "client", "status")
        for a in ("a", "b", sj.LOST)
    ),
    *(
        Use("reader", f"$JS.ACK.{s.results_stream('a')}.{s.reader(who, 'b1')}.{ACK}", {"publisher"}, set())
        for who in ("collect", "client")
    ),
    # ... never one that takes another agent's results out of an agent's stream (nor a stream nobody has)
    Use("results_stream", sj.consumer_create(s.results_stream("a"), "x", s.result("b", "b1")), set(), set()),
    Use("results_stream", sj.consumer_create(s.results_stream("zz"), "x", s.result("zz", "b1")), set(), set()),
    Use("shared_results_stream", sj.stream_info(s.shared_results_stream), set(), set()),
    Use(
        "batch_results",
        sj.consumer_create(s.results_stream("a"), "collect_b1_x", s.batch_results("b1")),
        set(),
        set(),
    ),
    Use("consumer_info", sj.consumer_info(s.results_stream("a"), "collect_b1_x"), {"publisher"}, set()),
    Use("pull_next", sj.pull_next(s.results_stream("b"), "collect_b1_x"), {"publisher"}, set()),
    # ... which ack what they handled (so the server can say when nothing more is on its way to them)
    Use("acks", f"$JS.ACK.{s.results_stream('a')}.collect_b1_x.{ACK}", {"publisher"}, set()),
    Use("consumer_delete", sj.consumer_delete(s.results_stream("a"), "collect_b1_x"), {"publisher"}, set()),
    # ... and how full each is (a full one's empty slots are storage_full rows)
    Use("stream_info", sj.stream_info(s.results_stream("a")), {"publisher"}, set()),
    Use("consumer_delete", sj.consumer_delete(s.tasks_stream, "agent_a"), set(), set()),
    Use("advisory", sj.advisory("MSG_TERMINATED", s.tasks_stream), set(), {"publisher"}),
    Use("advisory", sj.advisory("MAX_DELIVERIES", s.tasks_stream), set(), {"publisher"}),
    # model calls: direct to a replica with a free slot, else queued; each model's pool serves its own
    Use("model_queue", s.model_queue("m"), AGENTS | RESOURCES, set()),
    Use("model_direct", s.model_direct("m"), AGENTS | RESOURCES, of("model", "m")),
    Use("model_direct", s.model_direct("n"), AGENTS | RESOURCES, of("model", "n")),
    # ... and to one replica by name (a rollout's next turn, to the replica that holds its prefix)
    Use("model_replica", s.model_replica("m", "w1"), AGENTS | RESOURCES, of("model", "m")),
    Use("model_replica", s.model_replica("n", "w1"), AGENTS | RESOURCES, of("model", "n")),
    Use("consumer_create", sj.consumer_create(s.model_stream, "model_m", s.model_queue("m")), of("model", "m"), set()),
    Use("pull_next", sj.pull_next(s.model_stream, "model_m"), of("model", "m"), set()),
    Use("acks", f"$JS.ACK.{s.model_stream}.model_m.{ACK}", of("model", "m"), set()),
    Use("live", s.live("model", "m"), of("model", "m"), of("model", "m")),
    # environments: an agent calls its own; an environment those its calls names; reverify the stateless verify
    # a seed names its caller in the subject (the server checks it): each pool only its own, a role-wide any of its role
    Use("seed", s.seed("env_a", "agent.a"), of("agent", "a"), of("resource", "env_a")),
    Use("seed", s.seed("env_a", "agent._"), {"agent"}, of("resource", "env_a")),
    Use("seed", s.seed("env_a", "agent.b"), {"agent"}, of("resource", "env_a")),  # b's pool: not its environment
    Use("seed", s.seed("env_a", "resource.caller"), of("resource", "caller"), of("resource", "env_a")),
    Use("seed", s.seed("env_a", "resource.env_b"), {"resource"}, of("resource", "env_a")),
    Use("seed", s.seed("env_b", "agent.b"), of("agent", "b"), of("resource", "env_b")),
    Use("seed", s.seed("env_b", "agent.a"), {"agent"}, of("resource", "env_b")),
    Use(
        "stateless_verify",
        s.stateless_verify("env_a"),
        of("agent", "a") | of("resource", "caller") | {"publisher"},
        of("resource", "env_a"),
    ),
    # a session's operations name their caller in the subject, as seeds do: each pool only its own (the worker
    # answers a session only for the caller that seeded it), a role-wide credential any of its role
    Use(
        "session",
        s.session_call(s.session("env_a", "w1"), "tool", "agent.a"),
        of("agent", "a"),
        of("resource", "env_a"),
    ),
    Use(
        "session_call",
        s.session_call(s.session("env_a", "w1"), "verify", "agent._"),
        {"agent"},
        of("resource", "env_a"),
    ),
    Use(
        "session_call", s.session_call(s.session("env_a", "w1"), "tool", "agent.b"), {"agent"}, of("resource", "env_a")
    ),
    Use(
        "session_call",
        s.session_call(s.session("env_a", "w1"), "tool", "resource.caller"),
        of("resource", "caller"),
        of("resource", "env_a"),
    ),
    Use(
        "session_call",
        s.session_call(s.session("env_b", "w1"), "close", "agent.b"),
        of("agent", "b"),
        of("resource", "env_b"),
    ),
    Use(
        "session_call", s.session_call(s.session("env_b", "w1"), "close", "agent.a"), {"agent"}, of("resource", "env_b")
    ),
    Use("resource", s.resource("env_a"), set(), of("resource", "env_a")),
    # sandboxes: the agents and environments whose entry names pool "box" create there and drive what they hold
    # ... each only as itself (the caller in the subject: a sandbox serves only the caller that created it), so no
    # pool drives another's sandbox even with its id and lease (a role-wide credential may act as any of its pools)
    Use("sandbox_create", s.sandbox_create("box", "agent.a"), of("agent", "a"), of("sandbox", "box")),
    Use("sandbox_create", s.sandbox_create("box", "agent.b"), {"agent"}, of("sandbox", "box")),
    Use("sandbox_create", s.sandbox_create("box", "resource.caller"), of("resource", "caller"), of("sandbox", "box")),
    Use("sandbox_create", s.sandbox_create("box", "resource.env_a"), {"resource"}, of("sandbox", "box")),
    Use("sandbox_create", s.sandbox_create("other", "agent.a"), set(), of("sandbox", "other")),
    Use("sandbox_create", s.sandbox_create("box", "*.*"), set(), of("sandbox", "box")),
    Use("sandbox_present", s.sandbox_present("box"), BOX_USERS, of("sandbox", "box")),
    Use("sandbox_present", s.sandbox_present("other"), set(), of("sandbox", "other")),
    *(
        Use("sandbox_op", s.sandbox_op(s.sandbox_worker("box", "w1"), op, "agent.a"), of("agent", "a"), BOX)
        for op in ("exec", "close", "attach", "renew")
    ),
    Use("sandbox_op", s.sandbox_op(s.sandbox_worker("box", "w1"), "exec", "agent.b"), {"agent"}, BOX),
    Use(
        "sandbox_op",
        s.sandbox_op(s.sandbox_worker("box", "w1"), "read", "resource.caller"),
        of("resource", "caller"),
        BOX,
    ),
    Use("sandbox_op", s.sandbox_op(s.sandbox_worker("box", "w1"), "read", "_._"), set(), BOX),
    Use("sandbox_op", s.sandbox_op(s.sandbox_worker("other", "w1"), "exec", "agent.a"), set(), of("sandbox", "other")),
    Use("sandbox_worker", s.sandbox_op(s.sandbox_worker("box", "w1"), "*", "*.*"), set(), BOX),
    Use("sandboxes", s.sandboxes("box"), set(), of("sandbox", "box")),
    Use("live", s.live("sandbox", "box"), of("sandbox", "box"), of("sandbox", "box")),
    Use("reply", sj.reply(AGENT_A, sj.lane("sandbox", "box"), 5), of("sandbox", "box"), of("agent", "a")),
    Use("answer", sj.answer(PUB, sj.lane("sandbox", "box")), of("sandbox", "box"), {"publisher"}),
    # large bodies: each credential writes chunks into its own key space of its role's stream, and every role
    # reads them by key; nobody lists them
    Use("blob", s.blob(sj.blob_space("publisher", None), "k1", 0), {"publisher"}, set()),
    Use("blob", s.blob(sj.blob_space("agent", "a"), "k1", 0), of("agent", "a"), set()),
    Use("blob", s.blob(sj.blob_space("agent", None), "k1", 0), {"agent"}, set()),
    Use("blob", s.blob(sj.blob_space("model", "m"), "k1", 0), of("model", "m"), set()),
    Use("blob", s.blob(sj.blob_space("resource", "env_a"), "k1", 0), of("resource", "env_a"), set()),
    Use("blob", s.blob(sj.blob_space(None, None), "k1", 0), set(), set()),  # an unsecured bus's
    Use("blob_get", s.blob_get(sj.blob_space("agent", "a"), "k1", 0), EVERYONE, set()),
    Use("blob_get", s.blob_get(sj.blob_space("model", "m"), "k1", 0), EVERYONE, set()),
    Use("direct_get", sj.direct_get(s.blob_stream("agent")), set(), set()),
    Use("pool_blobs", s.pool_blobs("agent", "a"), set(), set()),
    Use("blob", s.blob(sj.blob_space("sandbox", "box"), "k1", 0), of("sandbox", "box"), set()),
    # the bodies a batch keeps: the publisher writes them with its tasks and reads one back by its subject alone
    Use("kept", s.kept("b1", 3), {"publisher"}, set()),
    Use("kept_get", s.kept_get("b1", 3), {"publisher"}, set()),
    Use("direct_get", sj.direct_get(s.kept_stream), set(), set()),
    Use("stream_info", sj.stream_info(s.kept_stream), set(), set()),
    Use("stream_info", sj.stream_info(s.blob_stream("model")), set(), set()),
    # each attempt's record of itself: written by its own agent pool only, read by the publisher (explain) with a
    # no-ack reader of its own; nobody subscribes to them, nor reads them by direct get
    Use("attempt", s.attempt("a", "b1"), of("agent", "a"), set()),
    Use("attempt", s.attempt("b", "b1"), of("agent", "b"), set()),
    Use("agent_attempts", s.agent_attempts("a"), set(), set()),
    Use("consumer_create", sj.consumer_create(s.attempts_stream, "x", s.attempt("*", "b1")), {"publisher"}, set()),
    Use("pull_next", sj.pull_next(s.attempts_stream, "x"), {"publisher"}, set()),
    Use("consumer_delete", sj.consumer_delete(s.attempts_stream, "x"), {"publisher"}, set()),
    Use("direct_get", sj.direct_get(s.attempts_stream), set(), set()),
    Use("stream_info", sj.stream_info(s.attempts_stream), {"publisher"}, set()),
    # trainer control: the publisher announces, workers hear (the ControlView's subscriptions)
    Use("policy_version", s.policy_version("m"), {"publisher"}, AGENTS | MODELS),
    Use("policy_version", s.policy_version("*"), set(), AGENTS | MODELS),
    Use("cancel", s.cancel("b1"), {"publisher"}, AGENTS | MODELS),
    Use("cancel", s.cancel("*"), set(), AGENTS | MODELS),
    # a purge (the admin's) said to every sandbox worker: the copies kept for branching the batch go with it
    Use("purged", s.purged("b1"), set(), {"sandbox", "sandbox.box", "sandbox.other"}),
    Use("pause", s.pause("m"), {"publisher"}, of("model", "m")),
    Use("resume", s.resume("m"), {"publisher"}, of("model", "m")),
    Use("status", s.status, {"publisher"}, WORKERS),
    # KV: the control bucket (agents count their own failed attempts), the manifests (the publisher's)
    Use("failed_key", sj.kv_key(s.control_bucket, s.failed_key("a", "b1", 0, 0)), of("agent", "a"), set()),
    Use("version_key", sj.kv_key(s.control_bucket, s.version_key("m")), {"publisher"}, set()),
    Use("paused_key", sj.kv_key(s.control_bucket, s.paused_key("m")), {"publisher"}, set()),
    Use("cancelled_key", sj.kv_key(s.control_bucket, s.cancelled_key("b1")), {"publisher"}, set()),
    Use("manifest_key", sj.kv_key(s.batches_bucket, s.manifest_key("b1")), {"publisher"}, set()),
    Use("kv_key", sj.kv_key(s.control_bucket, "anything.else"), set(), set()),
    # the task sampler's statistics: the trainer's (the publisher) to read and write, no worker's
    Use("sampler_key", sj.kv_key(s.sampler_bucket, s.sampler_key("run1", "abc")), {"publisher"}, set()),
    Use("msg_get", sj.msg_get(sj.kv_stream(s.sampler_bucket)), {"publisher"}, set()),
    # a rollout's checkpoint: its agent pool's own to write; only agents read the bucket (a forged one steers)
    Use("checkpoint_key", sj.kv_key(s.checkpoints_bucket, s.checkpoint_key("a", "b1", 0, 0)), of("agent", "a"), set()),
    # ... and to read back, by a last-by-subject direct get of its own keys only: no pool lists or reads another's
    Use(
        "direct_get",
        sj.direct_get(
            sj.kv_stream(s.checkpoints_bucket), sj.kv_key(s.checkpoints_bucket, s.checkpoint_key("a", "b1", 0, 0))
        ),
        of("agent", "a"),
        set(),
    ),
    Use(
        "direct_get",
        sj.direct_get(
            sj.kv_stream(s.checkpoints_bucket), sj.kv_key(s.checkpoints_bucket, s.checkpoint_key("b", "b1", 0, 0))
        ),
        of("agent", "b"),
        set(),
    ),
    Use("direct_get", sj.direct_get(sj.kv_stream(s.checkpoints_bucket)), set(), set()),
    Use("msg_get", sj.msg_get(sj.kv_stream(s.checkpoints_bucket)), set(), set()),
    Use("stream_info", sj.stream_info(sj.kv_stream(s.checkpoints_bucket)), set(), set()),
    Use(
        "kv_stream",
        sj.direct_get(sj.kv_stream(s.control_bucket), f"$KV.{s.control_bucket}.x"),
        AGENTS | MODELS | {"publisher"},
        set(),
    ),
    Use("msg_get", sj.msg_get(sj.kv_stream(s.control_bucket)), AGENTS | MODELS | {"publisher"}, set()),
    Use("msg_get", sj.msg_get(sj.kv_stream(s.batches_bucket)), {"publisher"}, set()),
    Use("stream_info", sj.stream_info(sj.kv_stream(s.batches_bucket)), {"publisher"}, set()),
    # what every process asks JetStream before it starts
    Use("js_info", sj.js_info(), EVERYONE, set()),
    Use("stream_names", sj.stream_names(), EVERYONE, set()),
    # the tasks stream's info (its subject counts list every queued batch id): the publisher's only; the others
    # check the streams are there by name (stream_names)
    Use("stream_info", sj.stream_info(s.tasks_stream), {"publisher"}, set()),
    Use("stream_info", sj.stream_info(s.model_stream), {"publisher"}, set()),
    Use("consumer_list", sj.consumer_list(s.tasks_stream), {"publisher"}, set()),
    # replies: each caller reads its own inbox; each answer comes into the lane of who gives it
    Use("inbox", sj.inbox("agent", "a"), set(), of("agent", "a")),
    Use("inbox_prefix", sj.inbox_prefix("publisher") + ".>", set(), {"publisher"}),
    Use("answers", sj.answers(AGENT_A), set(), of("agent", "a")),
    Use("reply", sj.reply(AGENT_A, sj.lane("resource", "env_a"), 7), of("resource", "env_a"), of("agent", "a")),
    Use("reply", sj.reply(AGENT_A, sj.lane("model", "m"), 8), of("model", "m"), of("agent", "a")),
    Use("reply", sj.reply(RES_ENV_A, sj.lane("model", "m"), 9), of("model", "m"), of("resource", "env_a")),
    Use("reply", sj.reply(AGENT_A, sj.SERVER_LANE, 3), set(), of("agent", "a")),  # the server's own acks
    Use("reply", sj.reply(PUB, sj.lane("model", "m"), 0), of("model", "m"), {"publisher"}),  # pause acks
    Use("answer", sj.answer(PUB, sj.lane("agent", "a")), of("agent", "a"), {"publisher"}),  # status
    Use("answer", sj.answer(PUB, sj.lane("resource", "env_b")), of("resource", "env_b"), {"publisher"}),
    Use("answer", sj.answer(PUB, sj.lane("model", "n")), of("model", "n"), {"publisher"}),
    Use("lane_replies", sj.lane_replies(sj.lane("agent", "b")), of("agent", "b"), set()),
]

# functions whose value is a name inside subjects, not a subject (covered by the uses above), or a reading of one
NAMES_ONLY = {
    "tasks_stream", "model_stream", "blob_stream", "kept_stream", "attempts_stream", "batches_bucket", "control_bucket",
    "checkpoints_bucket", "sampler_bucket", "checkpoint_keys", "kv_parts", "checkpoint_part", "batch_checkpoints",
    "role_blobs", "blob_probe", "blob_space", "blob_role", "legacy_blob_stream",
    "stream", "stream_subjects", "all_tasks", "all_results", "all_model_queues", "all_blobs", "all_kept",
    "all_attempts",
    "all_resources", "all_sandboxes", "sandbox_group", "purged_batch",
    "batch_tasks",  # a filter of stream info (how many of a batch's tasks are queued)
    "agent_results",  # a pattern of the permissions: the result rows check it
    "durable", "queue_filter", "model_group", "resource_group", "failed_keys", "lane",
    "result_parts", "kind", "callee_lane",
    "stored", "jetstream_api",  # what the JS account exports to the users' account (ops.permissions.accounts)
    "caller_of", "seed_caller", "session_caller", "sandbox_caller",
    "sandbox_calls",  # a pattern of the permissions: the sandbox rows check it
    "ack_fields", "ack_reply",  # a delivery's count, sequence and time in its ack subject (and the in-memory double's)
    "every_namespace_tasks", "namespace_of",  # which namespaces a server holds (a hint naming --namespace)
    "everything",  # a filter of stream names (which streams a namespace's default limit may take room from)
}  # fmt: skip


def _covers(pattern: str, subject: str) -> bool:
    """Whether a NATS permission ``pattern`` covers ``subject`` (itself a wildcard subscription, maybe)."""
    p, t = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(t) > i
        if i >= len(t) or t[i] == ">" or (tok != "*" and tok != t[i]):
            return False
    return len(p) == len(t)


def _perms(cred: str) -> dict[str, list[str]]:
    role, _, pool = cred.partition(".")
    got = permissions(role, ["gym"], pool or None, REACH)
    assert set(got["subscribe"]) == {"allow"}
    return {"pub": got["publish"]["allow"], "deny": got["publish"].get("deny", []), "sub": got["subscribe"]["allow"]}


def _allowed(perms: dict[str, list[str]], side: str, subject: str) -> bool:
    """What the server decides: an allow covers it, and (publishing) no deny does."""
    denied = side == "pub" and any(_covers(p, subject) for p in perms["deny"])
    return not denied and any(_covers(p, subject) for p in perms[side])


@pytest.mark.parametrize("cred", CREDS)
def test_each_credential_is_allowed_exactly_what_its_code_does(cred: str) -> None:
    perms = _perms(cred)
    wrong = []
    for use in USES:
        for side in ("pub", "sub"):
            if side == "pub" and any(t in ("*", ">") for t in use.subject.split(".")):
                continue  # a subscription's pattern: nobody publishes to a wildcard
            allowed = _allowed(perms, side, use.subject)
            if allowed != (cred in getattr(use, side)):
                wrong.append(f"{side} {use.subject} ({use.fn}): {'allowed' if allowed else 'refused'}")
    assert not wrong, "\n".join(wrong)


def test_every_function_of_the_subjects_module_is_classified() -> None:
    functions = {
        n
        for n, v in vars(Subjects).items()
        if not n.startswith("_") and (isinstance(v, staticmethod | property) or inspect.isfunction(v))
    }
    functions |= {n for n in sj.__all__ if inspect.isfunction(getattr(sj, n))}
    assert functions - {u.fn for u in USES} - NAMES_ONLY == set()


def test_no_credential_may_both_publish_and_subscribe_where_a_reply_could_be_borrowed(tmp_path: Path) -> None:
    """No credential has ``allow_responses`` (the server's one publish to any reply subject it was sent), so a
    subject a credential may both publish and subscribe lends it nothing; the only such subjects are its pool's
    liveness lane and its own lanes (a pool calling itself), and they stay so."""
    auth = ensure_auth_dir(tmp_path / "auth", pools=[("agent", "a"), ("resource", "env_a"), ("model", "m")])
    config = server_config(auth, ["gym"], REACH)
    users = json.loads(config.split("accounts: ", 1)[1].split("\n", 1)[0])[sj.APP_ACCOUNT]["users"]
    assert len(users) == 9 and all("allow_responses" not in u["permissions"] for u in users)
    for cred in CREDS:
        perms = _perms(cred)
        role, _, pool = cred.partition(".")
        both = {u.subject for u in USES if _allowed(perms, "pub", u.subject) and _allowed(perms, "sub", u.subject)}
        for subject in both:
            assert (
                subject.startswith(f"{s.ns}.live.")  # its pool's beacons
                or subject.startswith(f"_INBOX.{role}.")  # a call to itself (its own inbox, its own lane)
                or (cred == "resource" and subject.startswith(f"{s.ns}.res."))  # serves all, calls some
            ), (cred, subject)


def test_an_agent_pool_reaches_only_its_own_environment_and_needs_the_config_to_know_it(tmp_path: Path) -> None:
    reach = Reach.of(None)
    role_wide = permissions("agent", ["gym"], None, reach)["publish"]["allow"]
    assert any(
        _covers(p, s.seed("anything", "agent._")) for p in role_wide
    )  # no config: the role-wide credential, as before
    auth = ensure_auth_dir(tmp_path / "auth", pools=[("agent", "a")])
    with pytest.raises(ValueError, match=r"agent\.a\.creds: an agent pool may call only its own environment.*--config"):
        server_config(auth, ["gym"], reach)
    with pytest.raises(ValueError, match=r"agent\.a\.creds: the config has no agents\.a"):
        server_config(auth, ["gym"], Reach(agents={"b": ("env_b",)}))


REPO = Path(__file__).resolve().parents[1]
CODE = [REPO / d for d in ("runtime", "agents", "models", "resources")]  # the package and its plugins
# a subject's spelling: a namespace-relative f-string, NATS's own prefixes, an inbox
SPELLED = re.compile(
    r"\{(?:[\w.]*\.)?ns\}\.|\$JS\.|\$KV\.|\$SRV|_INBOX|_TASKS|_RESULTS|_BATCHES|_CONTROL|_BLOBS|\.live\.|\.ctl\."
)


def test_no_subject_is_spelled_outside_the_subjects_module() -> None:
    """Docstrings and comments may name subjects; code builds every one with the subjects module."""
    found = []
    for path in (p for root in CODE for p in root.rglob("*.py")):
        if path == REPO / "runtime/transport/subjects.py" or "tests" in path.relative_to(REPO).parts:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                text = node.value
            elif isinstance(node, ast.JoinedStr):
                text = ast.unparse(node)
            else:
                continue
            if SPELLED.search(text):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text[:80]}")
    assert found == []
