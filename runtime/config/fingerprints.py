"""Fingerprints: a short hash of a config entry (scaling fields left out), so two experiments that both name
a model ``policy`` in one namespace cannot serve each other's calls by accident.

``resolve_config`` computes them once, after the adapters parsed their options (a fingerprint hashes the
parsed options, defaults included, as the workers see them); workers, publishers and the client read them
from the ``ResolvedConfig``. What is told from them lives here too: ``mismatches`` (a config's against those
live workers announce) and ``grader_identity`` (rows' ``provenance.grader``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgspec

from gym_runtime.config.schema import Config
from gym_runtime.messages import Cost
from gym_runtime.model import WrittenOptions

# Fields that may differ between nodes of one experiment (scaling, where the model is served, credentials,
# timeouts), so they are not hashed: what is left says *what* is served (adapter, model, options, ...).
_DEPLOYMENT = frozenset(
    {
        "replicas",
        "concurrency",
        "base_url",
        "api_key",
        "headers",
        "timeout_s",
        "ack_wait_s",
        "max_retries",
        "retry_backoff_s",
        "replica_cooldown_s",
        "max_attempts",
        "max_worker_losses",
        "session_ttl_s",
        "seed_once",  # how sessions are set up, not what serves them
        "seed_once_idle_s",
        "affinity_load",
        "endpoint_load",
        "stall_s",
        "out_after",
    }
)


def _served(entry: msgspec.Struct) -> dict[str, Any]:
    """A config entry's fields that say *what* is served (deployment fields left out), a model's options flat."""
    raw = msgspec.structs.asdict(entry)
    options = raw.get("options")
    if isinstance(options, WrittenOptions):  # a bug: only resolve_config hashes entries, after parsing them
        raise TypeError("fingerprint of a models entry whose adapter options are not parsed")
    if isinstance(options, msgspec.Struct):  # a model entry: the adapter's own options, flattened
        del raw["options"]
        raw.update(msgspec.structs.asdict(options))
    return {k: v for k, v in raw.items() if k not in _DEPLOYMENT}


def _digest(value: Any) -> str:
    return hashlib.sha256(msgspec.json.encode(value, order="sorted")).hexdigest()[:12]


def fingerprint(entry: msgspec.Struct) -> str:
    """12 hex digits over a config entry's fields, deployment fields excluded."""
    return _digest(_served(entry))


def entry_fields(key: str, entry: msgspec.Struct) -> dict[str, str]:
    """Each served field's digest under its config key (``models.policy.temperature``): a worker announces
    these, so a publisher with another config names the keys that differ, never seeing a value."""
    return {f"{key}.{k}": _digest(v) for k, v in _served(entry).items()}


def agent_fingerprint(config: Config, agent: str) -> str:
    """An agent's entry together with the model and resource entries it uses."""
    a = config.agents[agent]
    parts = [fingerprint(a)]
    for table, name in ((config.models, a.model), (config.resources, a.resource)):
        parts.append(fingerprint(table[name]) if name in table else f"?{name}")
    return hashlib.sha256(":".join(parts).encode()).hexdigest()[:12]


def agent_parts(config: Config, agent: str) -> dict[str, str]:
    """Rows' ``provenance.parts``: the fingerprint of each entry an agent's rollouts depend on, apart
    (``agent``, ``model.NAME``, ``resource``), so a diff of two runs tells a changed grader (regrade) from a
    changed model (rerun); ``provenance.config`` hashes them together."""
    a = config.agents[agent]
    out = {"agent": fingerprint(a)}
    if a.model in config.models:
        out[f"model.{a.model}"] = fingerprint(config.models[a.model])
    if a.resource in config.resources:
        out["resource"] = fingerprint(config.resources[a.resource])
    return out


def agent_fields(config: Config, agent: str) -> dict[str, str]:
    """``entry_fields`` of an agent's entry and of the model and resource entries it uses (its fingerprint's parts)."""
    a = config.agents[agent]
    out = entry_fields(f"agents.{agent}", a)
    for section, table, name in (("models", config.models, a.model), ("resources", config.resources, a.resource)):
        if name in table:
            out.update(entry_fields(f"{section}.{name}", table[name]))
    return out


def config_fingerprints(config: Config) -> dict[tuple[str, str], str]:
    """(role, name) → fingerprint for every entry of a config (roles as in worker registration)."""
    out = {("model", n): fingerprint(m) for n, m in config.models.items()}
    out.update({("resource", n): fingerprint(r) for n, r in config.resources.items()})
    out.update({("agent", n): agent_fingerprint(config, n) for n in config.agents})
    return out


def config_fields(config: Config, role: str, name: str) -> dict[str, str]:
    """What ``role`` ``name``'s workers announce as their fields, for this config."""
    if role == "agent":
        return agent_fields(config, name)
    section, table = ("models", config.models) if role == "model" else ("resources", config.resources)
    return entry_fields(f"{section}.{name}", table[name])


def grader_identity(fingerprints: dict[str, str], cost: Cost | None) -> str | None:
    """Rows' ``provenance.grader``, where the grade is not the environment's code alone: each model entry the
    environment's own code called (an LLM judge) with its config fingerprint, ``judge:1a2b3c4d5e6f``."""
    if cost is None or not cost.models:
        return None
    return ",".join(f"{m}:{fingerprints.get(m) or '?'}" for m in sorted(cost.models))


def mismatches(
    mine: Mapping[tuple[str, str], str],
    fields: Mapping[tuple[str, str], Mapping[str, str]],
    workers: list[dict[str, Any]],
) -> list[str]:
    """One phrase per config entry that live workers serve with another config than the one whose fingerprints
    and fields are ``mine`` and ``fields`` (``ResolvedConfig.mismatches``): the keys that differ (or, for a
    worker that announces no fields, the two fingerprints). Workers of entries this config lacks are another
    experiment's business, not a mismatch."""
    seen: dict[tuple[str, str], tuple[set[str], list[str]]] = {}
    for w in workers:
        role, name = str(w.get("role")), str(w.get("name"))
        expected, got = mine.get((role, name)), w.get("fingerprint")
        if expected is None or got is None or got == expected:
            continue
        keys, ids = seen.setdefault((role, name), (set(), []))
        ids.append(str(w.get("worker")))
        theirs = w.get("fields")
        if isinstance(theirs, dict):
            ours = fields[(role, name)]
            keys.update(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        else:
            keys.add(f"fingerprint {got}, this config's {expected}")
    return [
        f"{role} {name!r} ({len(ids)} worker{'s' if len(ids) > 1 else ''}: {', '.join(ids[:3])}) differs in "
        + ", ".join(sorted(keys))
        for (role, name), (keys, ids) in sorted(seen.items())
    ]
