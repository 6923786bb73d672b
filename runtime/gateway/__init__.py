"""NeMo Gym's HTTP protocols over the bus: the head server with the agent protocol before 0.7 on one port, and
NeMo Gym 0.7's Environment Servers, one per agent, each on a port of its own; one app per protocol over one
shared state (``state.Gateway``), each behind the same access guard (``access``: its trainer, never a web page).

Trainer integrations written for NeMo Gym (TRL's rollout function, NeMo RL) fetch
``GET /global_config_dict_yaml``, find each agent's ``host``/``port`` under ``cfg[agent][<kind>][<impl>]``, and
``POST /run`` a task row. Every agent is listed with the gateway's advertised host and head port, every
Environment Server with its own port, so those requests land here, each row run through ``Client.run`` (one
task publish, one result message).

Reply shapes, decided from NeMo Gym's code (``nemo_gym/server_utils.py``, ``simple_agent``):

* ``GET /`` → ``{"status": "ok"}`` (NeMo Gym's liveness body), on every port.
* ``GET /global_config_dict_yaml`` → a JSON *string* holding YAML (FastAPI JSON-encodes the str that
  ``OmegaConf.to_yaml`` returns; clients do ``OmegaConf.create(json.loads(body))``).
* ``GET /server_instances`` → a JSON list, one entry per agent and per Environment Server, with the display
  fields NeMo Gym's head server lists (``name``, ``server_type``, ``host``, ``port``, ``url``, ``status``, ...).
* ``POST /run`` on the head → the verify response: the row as ``collect`` writes it, without the collector's
  ``_ng_task_index``/``_ng_rollout_index`` (NeMo Gym's agent returns the request's extra fields, so those appear
  only when the request carried them) and with ``agent_ref`` only when the request had one. A failed rollout
  answers HTTP 500 with a JSON string body ``"RolloutFailed(error_class='timeout', error='...')"`` (NeMo Gym's
  exception middleware answers 500 with ``repr(e)``) plus a ``Gym-Error-Class`` header; a body that is not a
  task row answers 422 ``{"detail": ...}`` like FastAPI's validation error.
* ``POST /run`` on an Environment Server → NeMo Gym 0.7's episode protocol (``episodes``, ``environment``).
* ``POST /aggregate_metrics`` with ``{"verify_responses": [rows]}`` → the agent's entry of
  ``<out>_aggregate_metrics.json``, computed in a worker thread, one request at a time; past
  ``gateway.aggregate_metrics_max_rows`` rows, 413.
* ``POST /pause`` / ``POST /resume`` on the head (the control token always) → ``Client.pause`` / ``resume``.
* A body that cannot be decoded (not JSON, not UTF-8, nested past the decoder's depth) answers 422.

aiohttp: one well-kept dependency that is both a fast asyncio HTTP server and the client our tests and NeMo Gym
itself use; no ASGI layer between the request and the bus.
"""

from __future__ import annotations

from gym_runtime.gateway.access import Access, control_token, default_token_file
from gym_runtime.gateway.replies import BOOKKEEPING, run_reply
from gym_runtime.gateway.serve import Served, start
from gym_runtime.gateway.state import (
    ENVIRONMENT_SERVER_TYPE,
    GATEWAY,
    Gateway,
    environment_server_names,
    impl_name,
)

__all__ = [
    "BOOKKEEPING",
    "ENVIRONMENT_SERVER_TYPE",
    "GATEWAY",
    "Access",
    "Gateway",
    "Served",
    "control_token",
    "default_token_file",
    "environment_server_names",
    "impl_name",
    "run_reply",
    "start",
]
