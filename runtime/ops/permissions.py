"""What each role and pool may do on the bus: NATS subject permissions, and the server config that holds them.

Derived from the subjects module (``gym_runtime.transport.subjects``), the one the code publishes and
subscribes with, so a role is allowed exactly what its code does (``tests/test_subjects.py`` checks
every subject against every role). No role has ``allow_responses``: a credential that may both
publish and subscribe a subject could send itself a message whose reply names any subject and then
publish there. Every answer goes into a reply lane that names its responder instead. The rules and why
they are so: ``gym_runtime.ops.security``'s docstring and docs/security.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from gym_runtime.config import Config
from gym_runtime.errors import AuthError
from gym_runtime.ops.security import CA_CERT, ROLES, SERVER_CERT, SERVER_KEY, creds_path, pools_in, public_key
from gym_runtime.transport import subjects as sj
from gym_runtime.transport.subjects import Subjects


class Reach(msgspec.Struct, frozen=True, kw_only=True):
    """Which environments each config entry may call, from the run's config (``Reach.of``).

    ``agents``: an agent's own resource (None: no config was given, and the role-wide agent credential
    may call every environment; an agent pool then has none to be scoped by, which ``server_config``
    refuses). ``resources``: the environments a resources entry's ``calls`` lists (none: it calls none).
    """

    agents: dict[str, tuple[str, ...]] | None = None
    resources: dict[str, tuple[str, ...]] = {}
    # the sandbox pool each agents or resources entry uses (its ``sandbox``); None: no config was given, and
    # the role-wide agent credential may use every pool (a resource none)
    agent_sandboxes: dict[str, tuple[str, ...]] | None = None
    resource_sandboxes: dict[str, tuple[str, ...]] = {}

    @classmethod
    def of(cls, cfg: Config | None) -> Reach:
        if cfg is None:
            return cls()
        return cls(
            agents={name: (a.resource,) if a.resource else () for name, a in cfg.agents.items()},
            resources={name: tuple(r.calls) for name, r in cfg.resources.items() if r.calls},
            agent_sandboxes={name: (a.sandbox,) if a.sandbox else () for name, a in cfg.agents.items()},
            resource_sandboxes={name: (r.sandbox,) for name, r in cfg.resources.items() if r.sandbox},
        )

    def sandbox_pools(self, role: str, pool: str | None) -> list[str] | None:
        """The sandbox pools ``role`` (one ``pool`` of it, or the role-wide credential) may use; None: every one."""
        return _granted(self.agent_sandboxes if role == "agent" else self.resource_sandboxes, pool)

    def environments(self, role: str, pool: str | None) -> list[str] | None:
        """The environments ``role`` (one ``pool`` of it, or the role-wide credential: the union) may call;
        None: every one."""
        return _granted(self.agents if role == "agent" else self.resources, pool)


def _granted(table: dict[str, tuple[str, ...]] | None, pool: str | None) -> list[str] | None:
    """What ``table`` (entry -> names) grants one ``pool``, or the role-wide credential (``pool`` None: the
    union of every entry's); None: no table, every name."""
    if table is None:
        return None
    if pool is not None:
        return list(table.get(pool, ()))
    return sorted({name for names in table.values() for name in names})


def permissions(
    role: str, namespaces: list[str], pool: str | None = None, reach: Reach | None = None
) -> dict[str, Any]:
    """What ``role`` (or one ``pool`` of it) may publish and subscribe to, in every namespace it works in.

    Allow-lists only: anything not listed is refused by the server (so e.g. no role but admin can
    create or delete a stream, and only agents publish results). ``reach``: the environments an agent
    or resource entry may call (``Reach``); none given: no environment calls another, and agents may
    call every environment.
    """
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if role not in ROLES:
        raise AuthError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    reach = reach or Reach()
    # nats-py finds a subject's stream by name; the inbox: the role's, or only the pool's own
    pub: list[str] = [sj.js_info(), sj.stream_names()]
    deny: list[str] = []  # within what ``pub`` allows
    sub: list[str] = [sj.inbox(role, pool)]
    mine = pool or "*"  # the entry this user serves (a role credential: every entry)
    for ns in namespaces:
        s = Subjects(ns)
        # bodies over the max payload: write-once chunks, written only into this credential's own key space of
        # its role's blob stream (``blob_space``), read only by the key their message carries (a last-by-subject
        # direct get); no stream info (its subjects_filter lists keys), consumer or get by sequence on a blob
        # stream, so no role can list or read bodies it was not sent
        pub.append(s.pool_blobs(role, mine))
        pub += [sj.direct_get(s.blob_stream(r), s.role_blobs(r)) for r in sj.BLOB_ROLES]
        more, hears, refused = _ROLE_GRANTS[role](s, reach, pool)
        pub += more
        sub += hears
        deny += refused
    publish: dict[str, list[str]] = {"allow": list(dict.fromkeys(pub))}
    if deny:
        publish["deny"] = deny
    return {"publish": publish, "subscribe": {"allow": list(dict.fromkeys(sub))}}


_Grant = tuple[list[str], list[str], list[str]]  # what a role may publish, subscribe to, and may not publish


def _models(s: Subjects) -> list[str]:
    # queued and direct model calls, and direct to one replica (a rollout's next turn, to its prefix)
    return [s.model_queue("*"), s.model_direct("*"), s.model_replica("*", "*")]


def _control_news(s: Subjects) -> list[str]:
    return [s.policy_version("*"), s.cancel("*")]  # what every worker's ControlView hears


def _publisher(s: Subjects, reach: Reach, pool: str | None) -> _Grant:
    control, batches = s.control_bucket, s.batches_bucket
    pub = [
        # the streams' info: the publisher's only (its counts). Every other role checks they are there
        # by name (``ensure_streams``): the tasks stream's subject counts list every queued batch id
        *(sj.stream_info(x) for x in (s.tasks_stream, s.model_stream)),
        s.task("*", ">"),
        s.policy_version("*"),
        s.pause("*"),
        s.resume("*"),
        s.cancel("*"),
        sj.kv_key(batches, ">"),
        sj.kv_key(s.sampler_bucket, ">"),  # the task sampler's statistics (``data.sampler_store``)
        *(sj.kv_key(control, k("*")) for k in (s.version_key, s.paused_key, s.cancelled_key)),
        *_read_kv(batches, control, s.sampler_bucket),
        *(sj.consumer_list(x) for x in (s.tasks_stream, s.model_stream)),
        *_read_results(s, reach),
        s.status,  # status: every worker answers into its own lane of this user's inbox
        s.stateless_verify("*"),  # reverify
        # collect: failure rows of tasks removed from the queue without a result (read as failures only)
        s.lost(">"),
        # each task's body, kept with its first publish and read back (a last-by-subject direct get only,
        # as for blobs) to publish again a task whose stored result was lost (data.republish)
        s.kept("*", "*"),
        s.kept_get("*", "*"),
        # explain: each attempt's own records, a batch's read by a no-ack reader of its own
        *_readers(s.attempts_stream, s.all_attempts),
    ]
    # ... which JetStream announces: a task terminated, or past its consumer's max deliveries
    sub = [sj.advisory(e, s.tasks_stream) for e in ("MSG_TERMINATED", "MAX_DELIVERIES")]
    return pub, sub, []


def _agent(s: Subjects, reach: Reach, pool: str | None) -> _Grant:
    mine = pool or "*"
    envs = reach.environments("agent", pool)
    calls = [s.all_resources] if envs is None else _calls(s, envs, "agent", pool)
    calls += _sandbox_calls(s, reach, "agent", pool)
    pub = [
        s.agent_results(mine),
        *_models(s),
        *calls,  # its own environment (the role-wide credential: every agent's)
        *_read_kv(s.control_bucket),
        # the count of a rollout's failed attempts (its pool's own keys: worker losses are the rest)
        sj.kv_key(s.control_bucket, s.failed_keys(mine)),
        s.agent_attempts(mine),  # each attempt's record of itself (its pool's own), read by explain
        # its rollouts' checkpoints (its pool's own keys), written, and read back by a redelivered attempt by a
        # last-by-subject direct get of its own keys: no stream info (its subjects filter lists every key), no
        # get by sequence or by a subject in the body, so no other role or pool lists, reads or writes them (a
        # read one hands over a session's id and address, a forged one would steer a rollout)
        sj.kv_key(s.checkpoints_bucket, s.checkpoint_keys(mine)),
        sj.direct_get(sj.kv_stream(s.checkpoints_bucket), sj.kv_key(s.checkpoints_bucket, s.checkpoint_keys(mine))),
        *_pull(s, "task", pool),
        sj.lane_replies(sj.lane("agent", mine)),  # status answers
    ]
    sub = [s.status, *_control_news(s), s.live("task", mine)]
    return pub, sub, [s.lost(">")]  # another agent's results, as far as a role-wide ``*`` goes: never a lost row


def _model(s: Subjects, reach: Reach, pool: str | None) -> _Grant:
    mine = pool or "*"
    pub = [
        *_read_kv(s.control_bucket),
        *_pull(s, "model", pool),
        # replies (and keepalives) only into the reply subjects of calls made to this model; status
        # answers and pause acknowledgements too
        sj.lane_replies(sj.lane("model", mine)),
    ]
    sub = [
        s.status,
        *_control_news(s),
        s.model_direct(mine),  # direct calls (core NATS) while a slot is free
        s.model_replica(mine, "*"),  # ... and those sent to this replica by name (its rollouts' later turns)
        s.pause(mine),
        s.resume(mine),
        s.live("model", mine),
    ]
    return pub, sub, []


def _sandbox(s: Subjects, reach: Reach, pool: str | None) -> _Grant:
    # its pool's subjects only: creates (a queue group) and the operations on what it holds; answers
    # into its own lane; its pool's liveness beacons (peers reap a dead worker's containers)
    mine = pool or "*"
    pub = [sj.lane_replies(sj.lane("sandbox", mine)), s.live("sandbox", mine)]
    # and purges: the copies it keeps for branching a purged batch's rollouts go with it
    return pub, [s.status, s.sandboxes(mine), s.live("sandbox", mine), s.purged("*")], []


def _resource(s: Subjects, reach: Reach, pool: str | None) -> _Grant:
    # models for LLM judges and user simulators; the environments this one calls by name (their replies
    # come into its own inbox, as any call's), and the sandbox pool it uses
    mine = pool or "*"
    pub = [*_models(s), *_calls(s, reach.environments("resource", pool) or (), "resource", pool)]
    pub += _sandbox_calls(s, reach, "resource", pool)
    # replies (and keepalives) only into calls made to this environment, and status answers
    pub.append(sj.lane_replies(sj.lane("resource", mine)))
    return pub, [s.status, s.resource(mine)], []


_ROLE_GRANTS: dict[str, Callable[[Subjects, Reach, str | None], _Grant]] = {
    "publisher": _publisher,
    "agent": _agent,
    "model": _model,
    "sandbox": _sandbox,
    "resource": _resource,
}


def _calls(s: Subjects, envs: Iterable[str], role: str, pool: str | None) -> list[str]:
    """Calling environments ``envs`` as ``role`` (one ``pool`` of it): seeds and session operations only as
    itself (the caller is in the subject: ``Subjects.seed``, ``Subjects.session_call``; a worker bounds sessions
    by it, and answers a session only for the caller that seeded it; a role-wide credential may be any pool of
    its role, as it may do what each does), and stateless verifies."""
    me = sj.caller_of(role, pool or "*")
    out = []
    for env in envs:
        out += [s.seed(env, me), s.session_call(s.session(env, "*"), "*", me), s.stateless_verify(env)]
    return out


def _sandbox_calls(s: Subjects, reach: Reach, role: str, pool: str | None) -> list[str]:
    """Using the sandbox pools ``role``'s entry names (none given for agents: every pool) only as itself: the
    caller is in each create's and operation's subject, and a sandbox serves only the caller that created it
    (with its lease), so a pool that read another's sandbox id and lease still cannot drive it."""
    me = sj.caller_of(role, pool or "*")
    boxes = reach.sandbox_pools(role, pool)
    if boxes is None and role != "agent":
        boxes = []
    return [x for p in (["*"] if boxes is None else boxes) for x in s.sandbox_calls(p, me)]


def _read_results(s: Subjects, reach: Reach) -> list[str]:
    """The publisher's readers of the results streams (collect, the client, status): one per agent of a batch
    (a stream per agent, and one of the lost records; a server given no config: one shared stream). They ack
    what they handled: the server then says when it holds nothing more for them (acks on a no-retention
    stream delete nothing); and their removal, and each stream's fill (a full one's slots are ``storage_full``)."""
    if reach.agents is None:
        streams = [(s.shared_results_stream, s.all_results)]
    else:
        streams = [(s.results_stream(a), s.agent_results(a)) for a in [*reach.agents, sj.LOST]]
    out = []
    for stream, subjects in streams:
        out += [*_readers(stream, subjects), sj.acks(stream, "*"), sj.consumer_list(stream)]
    return out


def _readers(stream: str, subjects: str) -> list[str]:
    """Readers of ``stream`` (its info; consumers of its own on ``subjects``: made, asked, pulled, deleted)."""
    return [
        sj.stream_info(stream),
        sj.consumer_create(stream, "*", subjects),
        sj.consumer_info(stream, "*"),
        sj.pull_next(stream, "*"),
        sj.consumer_delete(stream, "*"),
    ]


def _read_kv(*buckets: str) -> list[str]:
    """Reading keys of a bucket (nats-py: the stream's info, then direct gets or message gets)."""
    out = []
    for b in map(sj.kv_stream, buckets):
        out += [sj.stream_info(b), sj.direct_get(b), sj.direct_get(b, ">"), sj.msg_get(b)]
    return out


def _pull(s: Subjects, kind: str, pool: str | None) -> list[str]:
    """Pulling from the work queue of ``kind`` as this user's durable (a role credential: any): named creation
    only, the filter in the API subject, which the server checks against the allow-list (the legacy
    DURABLE.CREATE carries it in the body, where a pool could name any queue); and its pool's liveness
    beacons (a dead peer's work is nak'd at once)."""
    stream = s.stream(kind)
    if pool:
        durable, queue = s.durable(kind, pool), s.queue_filter(kind, pool)
    else:
        durable, queue = "*", s.stream_subjects(kind)
    return [
        sj.consumer_create(stream, durable, queue),
        sj.consumer_info(stream, durable),
        sj.pull_next(stream, durable),
        sj.acks(stream, durable),
        s.live(kind, pool or "*"),
    ]


def server_config(auth_dir: str | Path, namespaces: list[str], reach: Reach | None = None) -> str:
    """The ``tls`` and ``authorization`` blocks of a secured ``nats-server`` config (JSON values);
    ``reach``: which environments each agent and resources entry may call (``permissions``)."""
    d = Path(auth_dir).resolve()
    reach = reach or Reach()
    pools = pools_in(d)
    for role, pool in pools:
        if role != "agent":
            continue
        if reach.agents is None:
            raise AuthError(
                f"{d}/agent.{pool}.creds: an agent pool may call only its own environment, which the run's "
                "config names: give the server the config (--config CONFIG)"
            )
        if pool not in reach.agents:
            raise AuthError(
                f"{d}/agent.{pool}.creds: the config has no agents.{pool} (its environment decides what the "
                "pool may call); give the config that has it, or remove the file"
            )
    # TLS before any plaintext: our clients never read an INFO (or sign a nonce) that could come from a
    # downgrading impostor; other clients get the plaintext INFO (saying TLS is required) after 300 ms
    tls = {
        "cert_file": str(d / SERVER_CERT),
        "key_file": str(d / SERVER_KEY),
        "ca_file": str(d / CA_CERT),
        "timeout": 5,
        "handshake_first": "300ms",
    }
    # a trust directory made before the sandbox role has no sandbox.creds: that role then has no user
    roles = [r for r in ROLES if r != "sandbox" or creds_path(d, r).is_file()]
    users = [{"nkey": public_key(d, r), "permissions": permissions(r, namespaces, reach=reach)} for r in roles]
    users += [
        {"nkey": public_key(d, r, pool), "permissions": permissions(r, namespaces, pool, reach)} for r, pool in pools
    ]
    return (
        f"tls: {json.dumps(tls)}\n"
        f"accounts: {json.dumps(accounts(namespaces, users))}\n"
        f"authorization: {json.dumps({'timeout': 5})}\n"
    )


def accounts(namespaces: list[str], users: list[dict[str, Any]]) -> dict[str, Any]:
    """Two accounts: ``JS`` holds JetStream and no user; ``APP`` holds every user (``users``) and imports from JS
    exactly what they use: the JetStream API (``subjects.jetstream_api``; pulls answered with a stream of
    messages), acks of delivered messages, the subjects the streams store, and the advisories the collector
    hears.

    Why: JetStream answers a request (a stored message's ack, a direct get, a pull's status) by publishing to
    the reply subject the requester named, past every permission. Across accounts that answer is a service
    response: the server delivers it to the subscribers of that subject in APP and never through APP's imports,
    so no answer reaches the JetStream API, a stream or an ack subject, whatever reply a requester names
    (``tests/e2e/test_borrowed_replies.py``). Per-user permissions still decide what each user publishes.
    """
    services = [*sj.jetstream_api(), sj.acks("*", "*")]
    streams: list[str] = []
    for ns in namespaces:
        s = Subjects(ns)
        services += s.stored
        streams += [sj.advisory(e, s.tasks_stream) for e in ("MSG_TERMINATED", "MAX_DELIVERIES")]
    streamed = [sj.pull_next("*", "*")]  # a pull's messages (and its heartbeats, its status) answer one request
    exports: list[dict[str, Any]] = [{"service": x} for x in dict.fromkeys(services)]
    exports += [{"service": x, "response_type": "stream"} for x in streamed]
    exports += [{"stream": x} for x in streams]
    imports: list[dict[str, Any]] = [
        {"service": {"account": sj.JS_ACCOUNT, "subject": x}} for x in [*dict.fromkeys(services), *streamed]
    ]
    imports += [{"stream": {"account": sj.JS_ACCOUNT, "subject": x}} for x in streams]
    return {
        sj.JS_ACCOUNT: {"jetstream": "enabled", "exports": exports},
        sj.APP_ACCOUNT: {"users": users, "imports": imports},
    }


def route_tls(auth_dir: str | Path) -> dict[str, Any]:
    """The ``cluster { tls {...} }`` value: routes encrypted and mutually authenticated by the cluster CA.

    Every node presents the server certificate (it carries clientAuth) and
    accepts only peers whose certificate the same CA signed.
    """
    d = Path(auth_dir).resolve()
    return {
        "cert_file": str(d / SERVER_CERT),
        "key_file": str(d / SERVER_KEY),
        "ca_file": str(d / CA_CERT),
        "verify": True,
        "timeout": 5,
    }
