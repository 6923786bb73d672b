"""What each role and pool may do on the bus: NATS subject permissions, and the server config that holds them.

Derived from the runtime's subjects (``{ns}.task``, ``{ns}.result``, ``{ns}.res``, ``{ns}.model``,
``{ns}.call``, inboxes and ``$JS`` API subjects); the rules and why they are so are in
``gym_runtime.ops.security``'s docstring and docs/security.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gym_runtime.errors import AuthError
from gym_runtime.ops.security import CA_CERT, ROLES, SERVER_CERT, SERVER_KEY, inbox_prefix, pools_in, public_key


def _base(ns: str) -> str:
    return ns.upper().replace("-", "_")


def permissions(
    role: str, namespaces: list[str], pool: str | None = None, calls: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """What ``role`` (or one ``pool`` of it) may publish and subscribe to, in every namespace it works in.

    Allow-lists only: anything not listed is refused by the server (so e.g. no
    role but admin can create or delete a stream, and only agents publish results).
    ``calls`` (``resources.NAME.calls`` of the config): the other environments a resource
    pool may call (seed, tools, verify); the role-wide resource credential may call every
    environment some entry calls. With none given, no environment calls another.
    """
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    api = "$JS.API"
    # nats-py finds a subject's stream by name; the inbox: the role's, or only the pool's own
    pub: list[str] = [f"{api}.INFO", f"{api}.STREAM.NAMES"]
    sub: list[str] = [f"{inbox_prefix(role, pool)}.>" if pool else f"_INBOX.{role}.>"]
    mine = pool or "*"  # the entry this user serves (a role credential: every entry)
    for ns in namespaces:
        b = _base(ns)
        tasks, results, model = f"{b}_TASKS", f"{b}_RESULTS", f"{b}_MODEL"
        kv, blobs, ctl = f"KV_{b}_BATCHES", f"{b}_BLOBS", f"KV_{b}_CONTROL"
        pub += [f"{api}.STREAM.INFO.{s}" for s in (tasks, results, model, kv, ctl)]
        # bodies over the max payload: write-once chunks, read only by the key their message carries (a
        # last-by-subject direct get); no stream info (its subjects_filter lists keys), consumer or get by
        # sequence on the blob stream, so no role can list or read bodies it was not sent
        pub += [f"{ns}.blob.>", f"{api}.DIRECT.GET.{blobs}.{ns}.blob.>"]

        def pull(stream: str, subject: str, durable: str = "*") -> list[str]:
            out = [
                # named creation only: the filter is in the API subject, so the server checks it against the allow
                # list (the legacy DURABLE.CREATE carries it in the body, where a pool could name any queue)
                f"{api}.CONSUMER.CREATE.{stream}.{durable}.{subject}",
                f"{api}.CONSUMER.INFO.{stream}.{durable}",
                f"{api}.CONSUMER.MSG.NEXT.{stream}.{durable}",
            ]
            return [*out, f"$JS.ACK.{stream}.{durable}.>"]

        worker_sub = ["$SRV.>", f"{ns}.status.*", f"{ns}.ctl.>"]
        # the batch manifests and the trainer's control state (policy versions, pauses, cancelled batches)
        kv_read = [
            x
            for k in (kv, ctl)
            for x in (f"{api}.DIRECT.GET.{k}", f"{api}.DIRECT.GET.{k}.>", f"{api}.STREAM.MSG.GET.{k}")
        ]
        calls_models = [f"{ns}.model.>", f"{ns}.call.model.>"]
        if role == "publisher":
            pub += [
                f"{ns}.task.>",
                f"{ns}.ctl.>",
                f"$KV.{b}_BATCHES.>",
                f"$KV.{b}_CONTROL.>",
                *kv_read,
                # readers of batches (collect, the client) ack what they handled: the server then says when it
                # holds nothing more for them (acks on a no-retention results stream delete nothing)
                *pull(results, f"{ns}.result.>"),
                f"{api}.CONSUMER.DELETE.{results}.*",
                f"{api}.CONSUMER.LIST.{tasks}",
                f"{api}.CONSUMER.LIST.{model}",
                f"{api}.CONSUMER.LIST.{results}",
                "$SRV.>",
                f"{ns}.status.*",  # status: discovery and live counters
                f"{ns}.res.*.verify",  # reverify: the stateless verify group
                # collect: failure rows of tasks removed from the queue without a result (read as failures only)
                f"{ns}.result._lost.>",
            ]
            # ... which JetStream announces: a task terminated, or past its consumer's max deliveries
            sub += [f"$JS.EVENT.ADVISORY.CONSUMER.{e}.{tasks}.>" for e in ("MSG_TERMINATED", "MAX_DELIVERIES")]
        elif role == "agent":
            queue = pull(tasks, f"{ns}.task.{pool}.>", f"agent_{pool}") if pool else pull(tasks, f"{ns}.task.>")
            # the pool's liveness beacons (a dead peer's tasks are nak'd at once)
            live = f"{ns}.live.agent_{pool}" if pool else f"{ns}.live.*"
            # the count of a rollout's failed attempts (its pool's own keys: worker losses are the rest)
            failed = f"$KV.{b}_CONTROL.failed.{mine}.>"
            pub += [f"{ns}.result.{mine}.>", *calls_models, f"{ns}.res.>", *kv_read, *queue, live, failed]
            sub += [*worker_sub, live]
        elif role == "model":
            queue = pull(model, f"{ns}.model.{pool}", f"model_{pool}") if pool else pull(model, f"{ns}.model.>")
            # replies (and keepalives) only into the reply subjects of calls made to this model
            live = f"{ns}.live.model_{pool}" if pool else f"{ns}.live.*"
            pub += [f"_INBOX.*.*.*.model.{mine}.*", *kv_read, *queue, live]
            sub += [*worker_sub, f"{ns}.call.model.{mine}", live]  # direct calls (core NATS) while a slot is free
        elif role == "resource":
            # replies only into calls made to this environment; models for LLM judges and user simulators
            pub += [f"_INBOX.*.*.*.res.{mine}.*", *calls_models]
            # the environments this one calls by name (its replies come into its own inbox, as any call's)
            callees = (calls or {}).get(pool, []) if pool else sorted({c for cs in (calls or {}).values() for c in cs})
            pub += [f"{ns}.res.{other}.>" for other in callees]
            sub += [*worker_sub, f"{ns}.res.{mine}.>"]
        else:
            raise AuthError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    perms: dict[str, Any] = {
        "publish": {"allow": list(dict.fromkeys(pub))},
        "subscribe": {"allow": list(dict.fromkeys(sub))},
    }
    if role != "publisher":
        perms["allow_responses"] = True  # one answer to $SRV discovery, status and pause requests
    return perms


def server_config(auth_dir: str | Path, namespaces: list[str], calls: dict[str, list[str]] | None = None) -> str:
    """The ``tls`` and ``authorization`` blocks of a secured ``nats-server`` config (JSON values);
    ``calls``: which environments each resources entry may call (``permissions``)."""
    d = Path(auth_dir).resolve()
    # TLS before any plaintext: our clients never read an INFO (or sign a nonce) that could come from a
    # downgrading impostor; other clients get the plaintext INFO (saying TLS is required) after 300 ms
    tls = {
        "cert_file": str(d / SERVER_CERT),
        "key_file": str(d / SERVER_KEY),
        "ca_file": str(d / CA_CERT),
        "timeout": 5,
        "handshake_first": "300ms",
    }
    users = [{"nkey": public_key(d, r), "permissions": permissions(r, namespaces, calls=calls)} for r in ROLES]
    users += [
        {"nkey": public_key(d, r, pool), "permissions": permissions(r, namespaces, pool, calls)}
        for r, pool in pools_in(d)
    ]
    return f"tls: {json.dumps(tls)}\nauthorization: {json.dumps({'users': users, 'timeout': 5})}\n"


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
