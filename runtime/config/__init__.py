"""Configuration: YAML → msgspec Structs, with ``${VAR}`` interpolation and ``--set`` overrides.

Order of application: parse each YAML file (``load_raw``) → deep-merge them in
order (``merge_raw``) → apply ``--set a.b=value`` (a path the config or its
schema does not have is an error; ``+a.b=value`` adds named entries) →
interpolate ``${VAR}`` / ``${VAR:-default}`` (from the environment, then an
``env.yaml`` beside the configs) → convert to Structs. Unknown or wrong-typed keys are errors
that name the key's path (``agents.weather_agent.max_steps``). Secrets stay in
the Structs but are redacted from anything printed.

Loading is pure data: it imports no agent, resource or adapter module. What only a plugin can
check — an adapter's own keys (a ``models`` entry is flat), an agent's ``check_options``, that the
modules exist — is checked by ``resolve_config``, which returns a frozen ``ResolvedConfig`` (the
parsed options, the loaded plugins, the fingerprints): the one value workers, ``make_workers``,
``publish_batch`` and ``Client`` take, made once before anything is published or any worker takes work
(a publisher imports only the adapters, ``resolve_models``: its tasks' fingerprints hash their parsed
options). Until then an
adapter's keys are held as written (``gym_runtime.model.WrittenOptions``): a key whose name looks like
a secret (``api_key``, ``token``, ``headers``, ...) or whose value came from ``${VAR}`` is redacted;
once resolved, the adapter's own ``secret_fields`` decide.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, Literal

import msgspec
import msgspec.inspect
import yaml

from gym_runtime.config import fingerprints
from gym_runtime.config import nemo as nemo_config
from gym_runtime.errors import ConfigError, UserError
from gym_runtime.messages import Cost
from gym_runtime.model import (
    WORKER_KEYS,
    ModelConfig,
    WrittenOptions,
    adapter_module,
    resolve_model,
    written_model_config,
)
from gym_runtime.plugins import import_plugin, load_plugin, use_config_dir
from gym_runtime.transport.limits import DUPLICATE_WINDOW_S, STREAM_LIMITS, parse_size


class ResourceConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    server: str = ""  # module path that defines one Resource subclass
    # Hosted instead of native: a NeMo Gym resources server (a catalogue name such as ``mcqa``, or
    # a server directory of a NeMo Gym checkout) whose own code runs in this resource's workers,
    # in its built environment (gym_runtime.hosting); ``options`` are that server's config fields.
    nemo_gym: str = ""
    replicas: int = 1
    concurrency: int = 1024
    session_ttl_s: float = 3600.0
    # open sessions one worker keeps per caller (the agent or environment pool that opened them); past it
    # that caller's least recently used is closed: replayed seeds cannot pile up sessions for an hour, and
    # one pool's flood closes only its own (gym_runtime.workers.sessions)
    max_sessions: int = 20_000
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    # Other resources entries this one's code calls by name (a hosted NeMo Gym server's
    # ``server_client.post(NAME, ...)``): under ``server --secure`` its pool may call only these.
    calls: list[str] = msgspec.field(default_factory=list)
    sandbox: str = ""  # the sandboxes entry its code's ``self.sandbox(...)`` uses (docs/sandboxes.md)
    # Where the environment's code runs (gym_runtime.workers.guest): "process", a guest process per worker,
    # killed and started again when one call (seed, a tool, verify) runs past call_timeout_s, so code that
    # holds the GIL cannot silence the worker's bus; "none", the worker's own process. Unset: the
    # environment's default (``Resource.isolation``: "none" for native environments, "process" for OpenEnv);
    # "process" for hosted NeMo Gym servers (their guest runs on the server's built environment's Python).
    isolation: Literal["process", "none"] | None = None
    # isolation: process: the longest one call of environment code may run; past it the guest is killed, that
    # call's rollout is a ``timeout`` row and the other sessions of that guest run again. Keep it under the
    # agents' timeout_s (and a tool call's 300 s), so that those sessions' rollouts have time left to rerun.
    call_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.call_timeout_s <= 0:
            raise ValueError("call_timeout_s must be > 0")
        if bool(self.server) == bool(self.nemo_gym):
            raise ValueError("give exactly one of server (a gym-runtime Resource module) or nemo_gym (a hosted server)")

    @property
    def hosted(self) -> bool:
        return bool(self.nemo_gym)


HOSTED_AGENT_MODULE = "gym_runtime.hosting.agent"


class SandboxLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A sandbox pool's limits: what a sandbox gets when its spec names none, and the most it may ask."""

    cpu: float = 1.0
    memory_mb: int = 512
    pids: int = 256
    disk_mb: int = 256  # each writable path (tmpfs: /work, /tmp, /root)
    timeout_s: float = 600.0  # the longest one exec may run
    max_output: int = 1 << 20  # bytes kept of each of stdout and stderr, and the largest file read

    def __post_init__(self) -> None:
        if self.cpu <= 0 or min(self.memory_mb, self.pids, self.disk_mb, self.max_output) <= 0 or self.timeout_s <= 0:
            raise ValueError("limits must be positive")


class SandboxConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A pool of sandbox workers (``gym-runtime start --only sandboxes.NAME``): docs/sandboxes.md."""

    backend: Literal["docker", "podman", "process", "daytona"] = "docker"
    # the engine's socket; "": $DOCKER_HOST (docker), $CONTAINER_HOST or /run/podman/podman.sock (podman);
    # daytona: the provider's API URL (its key from $DAYTONA_API_KEY)
    engine: str = ""
    image: str = "base"  # a spec's default image; "base": the Debian 12 base, built here if missing
    images: list[str] = msgspec.field(default_factory=list)  # other images a spec may name (empty: any the engine has)
    capacity: int = 64  # live sandboxes (warm ones included) one worker holds; past it it takes no create
    replicas: int = 1
    # pool-wide: live sandboxes (warm ones included) of all the pool's workers together; 0: no quota. A create
    # past it waits for a lease (not counted against the rollout's timeout_s) instead of failing
    max_live: int = 0
    warm: int = 0  # created idle containers each worker keeps ready (the default image and limits); used once
    # more warm containers per worker, by image (the pool's limits): {"swe-task:1": 4}; each image is one the
    # pool may run, checked at start-up like ``images``
    warm_images: dict[str, int] = msgspec.field(default_factory=dict)
    limits: SandboxLimits = msgspec.field(default_factory=SandboxLimits)
    idle_ttl_s: float = 600.0  # a sandbox nobody used this long is removed (its holder died)
    max_lease_s: float = 3600.0  # a lease that names no end ends after this long
    reap_interval_s: float = 10.0  # how often the reaper looks for dead workers' containers and ended leases
    # docker/podman: a container its worker stopped renewing (the worker SIGKILLed, its node or bus lost) ends by
    # itself within this long, whatever runs on the engine (docs/sandboxes.md, "Nothing leaks")
    orphan_after_s: float = 60.0
    # a rollout waiting for a lease that sees none released in the pool this long ends (``sandbox_unavailable``);
    # waiting for a saturated pool is otherwise normal, and off the rollout's clock
    lease_wait_s: float = 600.0
    # "writable": the image's own file system is writable (the container's layer, no tmpfs over /work, /tmp and
    # /root): images that keep a repository at /testbed or tests at /app, as SWE-bench's and Terminal-Bench's do.
    # Its disk is not capped (limits.disk_mb does not apply): docs/sandboxes.md
    rootfs: Literal["read-only", "writable"] = "read-only"

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.replicas < 0:
            raise ValueError("capacity must be at least 1")
        if self.max_live < 0 or self.warm < 0:
            raise ValueError("max_live and warm must be at least 0")
        if self.orphan_after_s < 2:
            raise ValueError("orphan_after_s must be at least 2 (seconds)")
        if not self.lease_wait_s > 0:
            raise ValueError("lease_wait_s must be more than 0")
        if any(n < 0 for n in self.warm_images.values()):
            raise ValueError("warm_images counts must be at least 0")
        by_image = sum(self.warm_images.values())
        if self.warm + by_image > self.capacity:
            also = f" plus warm_images ({by_image})" if by_image else ""
            raise ValueError(f"warm ({self.warm}){also} must not exceed capacity ({self.capacity})")
        if 0 < self.max_live < self.warm + by_image:
            also = f" plus warm_images ({by_image})" if by_image else ""
            raise ValueError(
                f"max_live ({self.max_live}) is less than warm ({self.warm}){also}: warm containers count against "
                "the pool's quota, so it could never fill; raise max_live or lower warm"
            )


class AgentConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    agent: str = ""  # module path, e.g. agents.simple
    sandbox: str = ""  # the sandboxes entry ``ctx.sandbox(...)`` uses (docs/sandboxes.md)
    model: str
    # Hosted instead of an agent module: a NeMo Gym agent server (``simple_agent``, ... or the
    # directory of one in a NeMo Gym checkout) whose own ``/run`` runs in this agent's workers,
    # in its built environment (gym_runtime.hosting.agent); ``options`` are its config fields.
    nemo_gym: str = ""
    # The resource whose sessions the agent opens; "" for an agent that opens none
    # (agents.verifiers_env runs a verifiers environment's own loop and rubric).
    resource: str = ""
    max_steps: int | None = None
    timeout_s: float = 600.0
    concurrency: int = 256
    replicas: int = 1
    max_attempts: int = 3  # failures of the rollout itself (a retryable error), not lost workers
    # Deliveries whose worker vanished holding the task (killed, node lost, hung past ack_wait): a budget of
    # their own, so a fault costs a rollout nothing, while a task that kills every worker still ends as a
    # worker_lost failure row after this many losses.
    max_worker_losses: int = 5
    ack_wait_s: float = 30.0  # a task whose worker went silent this long is redelivered
    # A role with no worker at all (a pool restarting) is waited out, with backoff, this long
    # before the attempt counts: max_attempts counts failures of the work, not absences of a role.
    absent_grace_s: float = 60.0
    # The batch's repeats of one task reach one agent as one group task (an agent module with
    # ``run_group(ctx, size)``, e.g. agents.verifiers_env for rubrics that score groups, or a hosted
    # NeMo Gym agent: K concurrent ``/run`` calls, for servers that score a task's repeats together).
    group_repeats: bool = False
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    # Where the agent module's code runs (gym_runtime.workers.guest_agent): "process", a guest process per
    # worker whose model calls come back to the worker's bus, killed and started again when one rollout's own
    # code runs past call_timeout_s, so code that holds the GIL (a rubric's regex) cannot silence the worker;
    # "none", the worker's own process. Unset: the module's default (its ``isolation``: "process" for
    # agents.verifiers_env, "none" for the others).
    isolation: Literal["process", "none"] | None = None
    # isolation: process: the longest a rollout's own code may run without a model call (its time waiting for
    # the model does not count); past it the guest is killed, that rollout is a ``timeout`` row and the other
    # rollouts of that guest run again. Keep it under timeout_s.
    call_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if bool(self.agent) == bool(self.nemo_gym) and not (self.nemo_gym and self.agent == HOSTED_AGENT_MODULE):
            raise ValueError("give exactly one of agent (a gym-runtime agent module) or nemo_gym (a hosted agent)")
        if self.max_attempts < 1 or self.max_worker_losses < 0:
            raise ValueError("max_attempts must be at least 1 and max_worker_losses at least 0")
        if self.call_timeout_s <= 0:
            raise ValueError("call_timeout_s must be > 0")
        if self.nemo_gym:
            self.agent = HOSTED_AGENT_MODULE  # the module that drives it (its checks, its fingerprint)

    @property
    def hosted(self) -> bool:
        return bool(self.nemo_gym)


class JetStreamConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings for every stream, KV bucket and object store the runtime creates.

    Applied when they are created (an existing stream keeps its settings). Retention
    bounds the task and result streams so a long-lived store does not grow forever;
    ``gym-runtime purge --batch`` frees a batch sooner.
    """

    replicas: int = 1  # 3 on a 3-node cluster: losing a node loses nothing
    max_age_s: float = 7 * 24 * 3600.0  # results/tasks older than this are dropped (0 = forever)
    # How long the task and result streams remember a message id (JetStream's duplicate window): a
    # publish retried after a lost ack is dropped within it. The server holds ~250 B per id for this
    # long, two ids a rollout; readers drop a later duplicate result themselves (docs/architecture.md).
    duplicate_window_s: float = DUPLICATE_WINDOW_S
    # Size limits (e.g. 10GB; -1 = unbounded). ``max_bytes`` sets every stream's; the per-stream keys win
    # over it. Unset: the defaults below (docs/operations.md, "Storage limits", says how they were sized).
    max_bytes: int | str | None = None
    tasks_max_bytes: int | str | None = None  # {NS}_TASKS: a full queue refuses new tasks
    # {NS}_RESULTS_{agent}, per agent: a full one refuses that agent's new results (storage_full), never evicts
    results_max_bytes: int | str | None = None
    model_max_bytes: int | str | None = None  # {NS}_MODEL: a full queue refuses new queued model calls
    blobs_max_bytes: int | str | None = None  # {NS}_BLOBS_{ROLE}, per role: a full one refuses that role's bodies
    kept_max_bytes: int | str | None = None  # {NS}_KEPT: each task's body until purge; the oldest batches' go first
    attempts_max_bytes: int | str | None = None  # {NS}_ATTEMPTS: each attempt's record (explain); the oldest go first
    blob_bytes_in_flight: int | str = "128MB"  # per process: large bodies held at once (more wait their turn)
    # How long a large body of a call or reply (not a stored task's or result's, which live as long as their
    # message) stays in its blob stream: it is read at once, so an unreferenced chunk expires after this.
    blob_ttl_s: float = 3600.0
    # When a server this config starts (``run``, ``Client``, ``server --secure --config``) writes its store to
    # disk: ``always`` syncs before it acknowledges (an OS crash or power cut loses no acknowledged message),
    # ``interval`` every 2 minutes (nats-server's default: faster, and such a crash loses what it had not synced).
    sync: Literal["always", "interval"] = "always"
    # How many times a batch's reader (collect, run, the client) publishes again the tasks of slots whose stored
    # result the broker lost (acknowledged, then gone) before they become ``lost`` failure rows. Recorded in the
    # batch's manifest; each task's body is kept ({NS}_KEPT) until the batch is purged, unless it is 0.
    max_republish: int = 2

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.replicas > 5:
            raise ConfigError(f"jetstream.replicas: {self.replicas} must be between 1 and 5")
        if self.max_age_s < 0:
            raise ConfigError("jetstream.max_age_s: must be >= 0 (0 keeps messages forever)")
        if not 0 <= self.max_republish <= 100:
            raise ConfigError(f"jetstream.max_republish: {self.max_republish} must be between 0 and 100")
        if not self.blob_ttl_s >= 1:
            raise ConfigError(f"jetstream.blob_ttl_s: {self.blob_ttl_s!r} must be >= 1 second")
        if not self.duplicate_window_s > 0:
            raise ConfigError(f"jetstream.duplicate_window_s: {self.duplicate_window_s!r} must be > 0 seconds")
        for key in ("max_bytes", *(f"{s}_max_bytes" for s in STREAM_LIMITS), "blob_bytes_in_flight"):
            value = getattr(self, key)
            try:
                ok = value is None or value == -1 and key != "blob_bytes_in_flight" or parse_size(value) > 0
            except UserError as e:
                raise ConfigError(f"jetstream.{key}: {e}") from None
            if not ok:
                unbounded = "" if key == "blob_bytes_in_flight" else " or -1 (unbounded)"
                raise ConfigError(f"jetstream.{key}: {value!r} must be a positive size (e.g. 2GB){unbounded}")


class EnvironmentServerLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """NeMo Gym 0.7's environment server limits (``BaseEnvironmentServerConfig``), applied to each agent's
    environment server of the gateway on its own; None: no limit, as there."""

    max_concurrent_episodes: int | None = None  # episodes running at once; the others wait for a slot
    queue_timeout_seconds: float | None = None  # how long one waits; past it, a non-terminal admission failure
    default_episode_timeout_seconds: float | None = None  # one episode's deadline; past it, "Episode timed out"
    cleanup_timeout_seconds: float = 180.0  # shown in the global config (NeMo Gym requires it); nothing to clean

    def __post_init__(self) -> None:
        for name in msgspec.structs.fields(self):
            value = getattr(self, name.name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name.name}: {value} must be > 0")  # the loader names the section
        if self.max_concurrent_episodes is not None and self.queue_timeout_seconds is None:
            raise ConfigError("queue_timeout_seconds is required when max_concurrent_episodes is set")


class GatewayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Bounds of ``gym-runtime gateway`` (docs/operations.md, "The gateway")."""

    # Rows one POST /aggregate_metrics may carry (413 past it). Its pass@k arithmetic, NeMo Gym's, grows with
    # the square of a task's rollouts: 20,000 rows of one task take ~1.5 min of a core (off the event loop),
    # 20,000 rows of 16-rollout tasks 0.05 s.
    aggregate_metrics_max_rows: int = 20_000
    environment_servers: EnvironmentServerLimits = msgspec.field(default_factory=EnvironmentServerLimits)

    def __post_init__(self) -> None:
        if self.aggregate_metrics_max_rows < 1:
            raise ConfigError(f"gateway.aggregate_metrics_max_rows: {self.aggregate_metrics_max_rows} must be >= 1")


class ModelPrice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one model entry's use costs (``pricing.models.NAME``): per million tokens for a hosted API, per
    GPU-hour of a replica for one you serve. Cached input tokens at ``cached_input_per_1m`` (unset: the input price)."""

    input_per_1m: float = 0.0
    output_per_1m: float = 0.0
    cached_input_per_1m: float | None = None
    # a replica's GPU-hour, charged for the time its calls generate, shared by the calls it runs at once
    # (the entry's ``concurrency``): an estimate of a replica's cost per call, not a bill
    gpu_hour: float = 0.0
    gpus: int = 1


class PricingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``pricing``: turns each row's ``cost`` into ``cost.estimated_cost``, an estimate in ``currency``.
    Not part of any fingerprint: prices change without changing what is served."""

    currency: str = "USD"
    models: dict[str, ModelPrice] = msgspec.field(default_factory=dict)
    # charged for tool time and sandbox time: a rollout's sandbox CPU-seconds where they were counted
    # (``cost.sandbox_cpu_ms``), else its sandboxes' wall time (``cost.sandbox_ms``), never both
    cpu_hour: float = 0.0

    def __post_init__(self) -> None:
        for name, m in self.models.items():
            for key in ("input_per_1m", "output_per_1m", "cached_input_per_1m", "gpu_hour"):
                value = getattr(m, key)
                if value is not None and value < 0:
                    raise ConfigError(f"models.{name}.{key}: {value!r} must be >= 0")
        if self.cpu_hour < 0:
            raise ConfigError(f"cpu_hour: {self.cpu_hour!r} must be >= 0")

    def estimate(self, cost: Cost, concurrency: dict[str, int]) -> float:
        """The estimated amount of ``cost`` (model entries without a price count nothing)."""
        sandbox_ms = cost.sandbox_cpu_ms or cost.sandbox_ms  # CPU where counted, else wall time: never both
        total = self.cpu_hour * (cost.tool_ms + sandbox_ms) / 3_600_000
        for name, used in cost.models.items():
            price = self.models.get(name)
            if price is None:
                continue
            cached = min(used.cached_tokens, used.input_tokens)
            cached_price = price.input_per_1m if price.cached_input_per_1m is None else price.cached_input_per_1m
            total += (
                (used.input_tokens - cached) * price.input_per_1m
                + cached * cached_price
                + used.output_tokens * price.output_per_1m
            ) / 1_000_000
            if price.gpu_hour:
                total += price.gpu_hour * price.gpus * used.call_ms / 3_600_000 / max(1, concurrency.get(name, 1))
        return round(total, 9)


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    namespace: str = "gym"
    nats: str | list[str] = "embedded"
    jetstream: JetStreamConfig = msgspec.field(default_factory=JetStreamConfig)
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    models: dict[str, ModelConfig] = msgspec.field(default_factory=dict)
    resources: dict[str, ResourceConfig] = msgspec.field(default_factory=dict)
    agents: dict[str, AgentConfig] = msgspec.field(default_factory=dict)
    sandboxes: dict[str, SandboxConfig] = msgspec.field(default_factory=dict)
    pricing: PricingConfig | None = None  # rows' estimated cost (docs/operations.md, "Cost and pricing")
    base_dir: str = "."  # set by the loader: relative paths in the config resolve here
    source: str = "config"  # set by the loader: the file(s) that errors found later (resolve_config) name

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.namespace):
            raise ConfigError(f"namespace: {self.namespace!r} may only hold letters, digits, _ and -")


# An entry's name is a token of every subject and credential that names it (``{ns}.task.{agent}.{batch}``,
# ``{ns}.res.{name}.seed``, ``agent.{name}.creds``): no ``.``, ``*``, ``>`` or space can be in it, and a
# leading ``_`` is the runtime's own (``{ns}.result._lost``: failure rows, never results).
ENTRY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
NAME_RULE = "letters, digits, _ and -, starting with a letter or digit (_ starts the runtime's own names)"


def check_name(name: str, where: str) -> str:
    """``name`` if it is a valid entry name, else a ``ConfigError`` starting with ``where`` (the key)."""
    if ENTRY_NAME.fullmatch(name) is None:
        raise ConfigError(f"{where}: {name!r} is not a valid name: {NAME_RULE}")
    return name


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")
_PATH_RE = re.compile(r"at `\$((?:\.[^`\[]+|\[\d+\])*)`")


def _interpolate(node: Any, env: dict[str, str], path: str) -> Any:
    if isinstance(node, dict):
        return {k: _interpolate(v, env, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, env, f"{path}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            raise ConfigError(f"{path}: environment variable {name} is not set (and has no default)")

        whole = _VAR.fullmatch(node)
        value = _VAR.sub(sub, node)
        # A whole-value reference like `${N:-4}` may stand for a number or bool.
        if whole and value and not value.startswith(("{", "[")):
            try:
                return yaml.safe_load(value)
            except yaml.YAMLError:
                return value
        return value
    return node


def load_raw(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One config file as plain data (no substitution, no checks beyond "a YAML mapping")."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory, not a config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    if nemo_config.is_nemo_gym(raw):  # NeMo Gym's shape → our raw dict, then on as usual (nemo_config.py)
        try:
            raw = nemo_config.convert_file(p, raw)
        except nemo_config.NemoConfigError as e:
            raise ConfigError(str(e)) from None
    return raw


def merge_raw(raws: list[dict[str, Any]]) -> dict[str, Any]:
    """Deep-merge configs in order: mappings merge key by key, anything else is replaced by the later one.

    This is the one merge every multi-file form maps onto (several ``CONFIG``
    arguments, NeMo Gym ``config_paths``), so they all mean the same thing.
    """
    out: dict[str, Any] = {}
    for raw in raws:
        _merge_into(out, raw)
    return out


def _merge_into(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge_into(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``a.b.c=value`` override; the value is parsed as a YAML scalar or flow collection.

    The path must exist in the config or in its schema (a typo is an error naming
    the nearest valid key); ``+a.b.c=value`` may add new named entries, e.g.
    ``+models.judge.adapter=openai``.
    """
    key, sep, value = assignment.partition("=")
    adding = key.startswith("+")
    key = key.removeprefix("+")
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {assignment!r}: expected KEY.PATH=VALUE")
    try:
        parsed = yaml.safe_load(value) if value else ""
    except yaml.YAMLError as e:
        problem = str(e).splitlines()[0] if str(e) else "invalid"
        raise ConfigError(f"--set {key}: the value {value!r} is not valid YAML ({problem})") from None
    parts = key.split(".")
    _check_path(raw, parts, adding=adding)
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a mapping")
        node = nxt
    node[parts[-1]] = parsed


def _check_path(raw: dict[str, Any], parts: list[str], *, adding: bool) -> None:
    """Raise unless every step of ``parts`` is in ``raw`` or allowed by the schema."""
    problem = _path_problem(raw, parts, adding=adding)
    if problem is not None:
        here, hint = problem
        raise ConfigError(f"--set {'.'.join(parts)}: no key {here}{hint}")


OptionsOf = Callable[[str], Any]  # an adapter's name → its Options type (imports it: resolve_config only)


def _path_problem(
    raw: dict[str, Any], parts: list[str], *, adding: bool, options_of: OptionsOf | None = None
) -> tuple[str, str] | None:
    """The first step of ``parts`` that is neither in ``raw`` nor in the schema, with a hint (the nearest
    key: ``; did you mean ...?``), or None when the path is fine. ``--set`` and the config files share it.
    Without ``options_of`` (loading: no adapter imported) an adapter's key of a models entry passes."""
    info: Any = msgspec.inspect.type_info(Config)
    node: Any = raw
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        present = isinstance(node, dict) and part in node
        if _is_model_entry(info) and options_of is None and part not in WORKER_KEYS:
            return None  # an adapter's own key: resolve_config checks it against the adapter's Options
        info = _flat_model_entry(info, node, options_of)
        known, free, choices = _schema_step(info, part)
        if not present and not known and not free:
            if isinstance(info, msgspec.inspect.DictType) and adding:
                pass  # a new named entry, asked for explicitly
            else:
                names = sorted(set(choices) | (set(node) if isinstance(node, dict) else set()))
                near = difflib.get_close_matches(part, names, n=1, cutoff=0.5)
                hint = (
                    f"; did you mean {'.'.join([*parts[:i], near[0]])}?"
                    if near
                    else (f"; valid keys here: {', '.join(names)}" if names and len(names) <= 12 else "")
                )
                plus = " (use +KEY.PATH=VALUE to add a new entry)" if isinstance(info, msgspec.inspect.DictType) else ""
                return here, hint + plus
        if free:
            return None  # free-form mapping (options, headers): anything below goes
        info = _schema_child(info, part)
        node = node.get(part) if isinstance(node, dict) else None
    return None


def _unknown_key_hint(raw: dict[str, Any], path: str, options_of: OptionsOf | None = None) -> str:
    """``; did you mean agents.a.max_steps?`` for an unknown key a config file spells (``path``), or ``""``."""
    parts = [p for p in path.split(".") if p]
    if not parts:
        return ""
    # the same mappings along the path, without the key in question (a present key counts as known)
    copy: dict[str, Any] = dict(raw)
    node = copy
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            break
        node[part] = node = dict(child)
    else:
        node.pop(parts[-1], None)
    problem = _path_problem(copy, parts, adding=False, options_of=options_of)
    if problem is None:
        return ""
    hint = problem[1].split(" (use +", 1)[0]
    return hint if "did you mean" in hint else ""


def _is_model_entry(info: Any) -> bool:
    return isinstance(info, msgspec.inspect.StructType) and info.cls is ModelConfig


def _flat_model_entry(info: Any, node: Any, options_of: OptionsOf | None) -> Any:
    """A ``models.NAME`` entry is flat in YAML: the worker's keys plus its adapter's option fields."""
    if not _is_model_entry(info) or options_of is None:
        return info
    adapter = node.get("adapter", "scripted") if isinstance(node, dict) else "scripted"
    try:
        options: Any = msgspec.inspect.type_info(options_of(str(adapter)))
    except ValueError:
        return info  # an unknown adapter is reported when the entry is converted
    worker = [f for f in info.fields if f.encode_name != "options"]
    return msgspec.inspect.StructType(
        cls=ModelConfig,
        fields=tuple(worker) + options.fields,
        tag_field=None,
        tag=None,
        array_like=False,
        forbid_unknown_fields=True,
    )


def _structs(info: Any) -> list[Any]:
    if isinstance(info, msgspec.inspect.StructType):
        return [info]
    if isinstance(info, msgspec.inspect.UnionType):
        return [t for x in info.types for t in _structs(x)]
    return []


def _schema_step(info: Any, part: str) -> tuple[bool, bool, list[str]]:
    """(``part`` is a schema field here, anything goes here, the field names here)."""
    structs = _structs(info)
    if structs:
        names = [f.encode_name for s in structs for f in s.fields]
        return part in names, False, names
    if isinstance(info, msgspec.inspect.UnionType):
        info = next((t for t in info.types if isinstance(t, msgspec.inspect.DictType)), None)
    if isinstance(info, msgspec.inspect.DictType):
        # a mapping of named entries (models, agents): names are data, not schema
        free = not _structs(info.value_type) and not isinstance(info.value_type, msgspec.inspect.DictType)
        return False, free, []
    return False, info is None or isinstance(info, msgspec.inspect.AnyType), []


def _schema_child(info: Any, part: str) -> Any:
    for s in _structs(info):
        for f in s.fields:
            if f.encode_name == part:
                return f.type
    if isinstance(info, msgspec.inspect.UnionType):
        info = next((t for t in info.types if isinstance(t, msgspec.inspect.DictType)), None)
    if isinstance(info, msgspec.inspect.DictType):
        return info.value_type
    return msgspec.inspect.AnyType()


def _env_file(config_path: Path) -> dict[str, str]:
    env_path = config_path.parent / "env.yaml"
    if not env_path.is_file():
        return {}
    try:
        data = yaml.safe_load(env_path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{env_path}: invalid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{env_path}: must be a mapping of NAME: value")
    return {str(k): str(v) for k, v in data.items()}


def load_config(
    path: str | os.PathLike[str] | list[str | os.PathLike[str]],
    overrides: list[str] | None = None,
) -> Config:
    """Read, merge (in order), override, substitute, convert.

    ``--set`` overrides are applied to the merged file contents *before* ``${VAR}``
    substitution, so ``--set 'models.policy.api_key=${KEY}'`` reads ``KEY`` from
    the environment. Relative paths resolve beside the first file.
    """
    paths = [Path(p) for p in (path if isinstance(path, list) else [path])]
    if not paths:
        raise ConfigError("no config file given")
    raw = merge_raw([load_raw(p) for p in paths])
    source = ", ".join(str(p) for p in paths)
    for o in overrides or []:
        apply_override(raw, o)
    from_set = _adapter_keys_set(overrides or [])
    from_env = _adapter_keys_from_env(raw)
    env: dict[str, str] = {}
    for p in paths:
        env.update(_env_file(p))
    env.update(os.environ)
    try:
        raw = _interpolate(raw, env, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    raw["base_dir"] = str(paths[0].resolve().parent)
    use_config_dir(_module_names(raw), raw["base_dir"])  # modules named relative to the config (gym_runtime.plugins)
    cfg = config_from_dict(raw, source=source)
    for name, m in cfg.models.items():
        if isinstance(m.options, WrittenOptions):
            m.options = msgspec.structs.replace(
                m.options, from_env=from_env.get(name, frozenset()), from_set=from_set.get(name, frozenset())
            )
    return cfg


def _adapter_keys_set(overrides: list[str]) -> dict[str, frozenset[str]]:
    """models entry → the adapter keys that ``--set`` overrides wrote (their errors name the ``--set``)."""
    out: dict[str, set[str]] = {}
    for o in overrides:
        parts = o.partition("=")[0].removeprefix("+").split(".")
        if len(parts) >= 3 and parts[0] == "models" and parts[2] not in WORKER_KEYS:
            out.setdefault(parts[1], set()).add(parts[2])
    return {k: frozenset(v) for k, v in out.items()}


def _adapter_keys_from_env(raw: dict[str, Any]) -> dict[str, frozenset[str]]:
    """models entry → the keys whose value (anywhere inside) is a ``${VAR}`` reference: held as secrets."""

    def refers(value: Any) -> bool:
        if isinstance(value, dict):
            return any(refers(v) for v in value.values())
        if isinstance(value, list):
            return any(refers(v) for v in value)
        return isinstance(value, str) and _VAR.search(value) is not None

    models = raw.get("models")
    return {
        str(name): frozenset(k for k, v in entry.items() if refers(v))
        for name, entry in (models.items() if isinstance(models, dict) else [])
        if isinstance(entry, dict)
    }


def _module_names(raw: dict[str, Any]) -> list[str]:
    """The ``server``/``agent`` module names of a raw config (malformed entries are left to the checks)."""
    names = []
    for section, key in (("resources", "server"), ("agents", "agent")):
        entries = raw.get(section)
        for entry in entries.values() if isinstance(entries, dict) else []:
            if isinstance(entry, dict) and isinstance(entry.get(key), str):
                names.append(entry[key])
    return names


def _converter(typ: type[msgspec.Struct]) -> Callable[[Any], Any]:
    return lambda entry: msgspec.convert(entry, typ, strict=False)


# How one entry of each section is parsed (a models entry is flat: the worker's
# keys, and its adapter's keys held as written until resolve_config, see gym_runtime.model).
_SECTIONS: dict[str, Callable[[Any], Any]] = {
    "models": written_model_config,
    "resources": _converter(ResourceConfig),
    "agents": _converter(AgentConfig),
    "sandboxes": _converter(SandboxConfig),
}


_ENTRY_TYPES: dict[str, type[msgspec.Struct]] = {
    "resources": ResourceConfig,
    "agents": AgentConfig,
    "sandboxes": SandboxConfig,
}


def _choices(typ: type[msgspec.Struct], path: str) -> str:
    """`` (one of: docker, podman, ...)``: the values a key of ``typ`` (``path``: ``backend``, ``limits.x``) takes
    when it is a ``Literal``; "" for any other key."""
    info: Any = msgspec.inspect.type_info(typ)
    for part in path.split(".") if path else []:
        fields = {f.name: f.type for f in getattr(info, "fields", ())}
        if part not in fields:
            return ""
        info = fields[part]
    kinds = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    values = [v for t in kinds if isinstance(t, msgspec.inspect.LiteralType) for v in t.values]
    return f" (one of: {', '.join(map(str, values))})" if values else ""


def config_from_dict(raw: dict[str, Any], *, source: str = "config") -> Config:
    """Plain data → ``Config``, checked as far as data alone allows (no plugin imported: ``resolve_config``)."""
    # Entries are converted one by one so that errors can name them (msgspec
    # reports dict keys as `[...]`).
    sections: dict[str, dict[str, Any]] = {}
    for section, parse in _SECTIONS.items():
        entries = raw.get(section) or {}
        if not isinstance(entries, dict):
            raise ConfigError(f"{source}: {section}: expected a mapping of name -> settings")
        sections[section] = {}
        for name, entry in entries.items():
            check_name(str(name), f"{source}: {section}")
            try:
                sections[section][str(name)] = parse(entry)
            except msgspec.ValidationError as e:
                text = _readable(str(e))  # "path: problem", or ": problem" for the entry itself
                if section in _ENTRY_TYPES and "Invalid enum value" in text:  # say which values it takes
                    text += _choices(_ENTRY_TYPES[section], text.partition(":")[0])
                where = f"{section}.{name}" + (text if text.startswith(":") else f".{text}")
                raise ConfigError(f"{source}: {where}{_file_key_hint(raw, f'{section}.{name}', text)}") from None
    try:
        cfg = msgspec.convert({k: v for k, v in raw.items() if k not in _SECTIONS}, Config, strict=False)
    except msgspec.ValidationError as e:
        text = _readable(str(e))
        raise ConfigError(f"{source}: {text.lstrip(': ')}{_file_key_hint(raw, '', text)}") from None
    cfg.models, cfg.resources, cfg.agents = sections["models"], sections["resources"], sections["agents"]
    cfg.sandboxes = sections["sandboxes"]
    cfg.source = source
    users = [("agents", n, a.sandbox) for n, a in cfg.agents.items()]
    for section, name, pool in users + [("resources", n, r.sandbox) for n, r in cfg.resources.items()]:
        if pool and pool not in cfg.sandboxes:
            raise ConfigError(f"{source}: {section}.{name}.sandbox: no sandbox pool named {pool!r} under sandboxes")
    for name, a in cfg.agents.items():
        if a.model not in cfg.models:
            raise ConfigError(f"{source}: agents.{name}.model: no model named {a.model!r} under models")
        if a.resource and a.resource not in cfg.resources:
            raise ConfigError(f"{source}: agents.{name}.resource: no resource named {a.resource!r} under resources")
        for key, value in a.options.items():  # any model the options name (``*_model`` keys) must exist
            if key.endswith("_model") and isinstance(value, str) and value not in cfg.models:
                raise ConfigError(f"{source}: agents.{name}.options.{key}: no model named {value!r} under models")
    for name in cfg.pricing.models if cfg.pricing else ():
        if name not in cfg.models:
            raise ConfigError(f"{source}: pricing.models.{name}: no model named {name!r} under models")
    for name, r in cfg.resources.items():
        for other in r.calls:
            if other not in cfg.resources or other == name:
                raise ConfigError(f"{source}: resources.{name}.calls: {other!r} is not another entry under resources")
    return cfg


HOSTED_RESOURCE_MODULE = "gym_runtime.hosting.resource"  # what the workers use of hosting


class ResolvedConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A config whose plugins have checked it: what workers, ``make_workers``, ``publish_batch`` and ``Client``
    take. Made only by ``resolve_config`` (or ``resolve_models``), once, from a loaded ``Config``, which it
    leaves as it was.

    ``config``: the loaded config with each ``models`` entry's options parsed by its adapter. ``agent_modules``:
    each agent entry's module (a hosted one's: ``gym_runtime.hosting.agent``); ``hosting``: what the workers use
    of hosting (``gym_runtime.hosting.resource``), when a resource is hosted or an agent module runs in verifiers'
    own built environment (its ``verifiers_version``). Both loaded by name, as
    plugins are, so that the workers import nothing from ``gym_runtime.hosting``; empty when resolved for
    publishing only (``plugins`` False). ``fingerprints`` and ``fields``: each entry's, by (role, name) as
    workers register (``config.fingerprints``)."""

    config: Config
    plugins: bool
    agent_modules: Mapping[str, ModuleType]
    hosting: ModuleType | None
    fingerprints: Mapping[tuple[str, str], str]
    fields: Mapping[tuple[str, str], Mapping[str, str]]

    # the loaded config's sections, read through (the resolved value is not a second copy of them)
    @property
    def namespace(self) -> str:
        return self.config.namespace

    @property
    def nats(self) -> str | list[str]:
        return self.config.nats

    @property
    def gateway(self) -> GatewayConfig:
        return self.config.gateway

    @property
    def jetstream(self) -> JetStreamConfig:
        return self.config.jetstream

    @property
    def models(self) -> Mapping[str, ModelConfig]:
        return self.config.models

    @property
    def resources(self) -> Mapping[str, ResourceConfig]:
        return self.config.resources

    @property
    def agents(self) -> Mapping[str, AgentConfig]:
        return self.config.agents

    @property
    def sandboxes(self) -> Mapping[str, SandboxConfig]:
        return self.config.sandboxes

    @property
    def pricing(self) -> PricingConfig | None:
        return self.config.pricing

    @property
    def base_dir(self) -> str:
        return self.config.base_dir

    @property
    def source(self) -> str:
        return self.config.source

    def model_fingerprints(self) -> dict[str, str]:
        """Each models entry's fingerprint, by name."""
        return {name: self.fingerprints[("model", name)] for name in self.config.models}

    def model_table(self) -> dict[str, dict[str, str]]:
        """Each model entry's adapter, model name and fingerprint (the batch manifest's ``models``: what rows'
        ``provenance.turns`` name); URLs, keys and headers are never in it."""
        table = {}
        for name, m in self.config.models.items():
            model = getattr(m.options, "model", None)
            entry = {"adapter": m.adapter, "fingerprint": self.fingerprints[("model", name)]}
            if isinstance(model, str) and model:
                entry["model"] = model
            table[name] = entry
        return table

    def agent_module(self, name: str) -> ModuleType:
        """agents.NAME's module, loaded when this config was resolved."""
        module = self.agent_modules.get(name)
        if module is None:  # a bug: a config resolved for publishing only cannot start an agent's workers
            raise TypeError(f"agents.{name}: its module was not loaded (resolve_config, not resolve_models)")
        return module


def resolve_config(cfg: Config) -> ResolvedConfig:
    """Import the adapters and agents ``cfg`` names, let them check their options, and compute the fingerprints.

    The step between loading (pure data) and starting workers: ``start``, ``run``, ``validate`` and ``Client``
    call it, once, so a bad option is one ``ConfigError`` naming the key before anything is published or any
    worker takes work. ``cfg`` is left as it is.
    """
    cfg = copy.deepcopy(cfg)  # its own copy: the caller's Config may change later, this one never does
    models = _parsed_models(cfg)
    agents = {name: _agent_module(name, a, cfg.source) for name, a in cfg.agents.items()}
    hosted = any(r.hosted for r in cfg.resources.values())
    built = any(getattr(m, "verifiers_version", None) for m in agents.values())  # verifiers' own environment
    hosting = import_plugin(HOSTED_RESOURCE_MODULE) if hosted or built else None
    return _resolved(cfg, models, plugins=True, agent_modules=agents, hosting=hosting)


def resolve_models(cfg: Config) -> ResolvedConfig:
    """The adapters' half of ``resolve_config``: each ``models`` entry's options parsed by its adapter.

    Publishing needs this much (a task carries its agent's fingerprint, which hashes the adapters'
    parsed options, defaults included, as the workers see them), so ``publish`` imports the adapters,
    as loading did before; never an agent or environment module (the result starts no worker).
    """
    cfg = copy.deepcopy(cfg)
    return _resolved(cfg, _parsed_models(cfg), plugins=False, agent_modules={}, hosting=None)


def _resolved(
    cfg: Config,
    models: dict[str, ModelConfig],
    *,
    plugins: bool,
    agent_modules: dict[str, ModuleType],
    hosting: ModuleType | None,
) -> ResolvedConfig:
    config = msgspec.structs.replace(cfg, models=models)
    roles = [("model", n) for n in config.models] + [("resource", n) for n in config.resources]
    roles += [("agent", n) for n in config.agents]
    return ResolvedConfig(
        config=config,
        plugins=plugins,
        agent_modules=MappingProxyType(agent_modules),
        hosting=hosting,
        fingerprints=MappingProxyType(fingerprints.config_fingerprints(config)),
        fields=MappingProxyType({(r, n): MappingProxyType(fingerprints.config_fields(config, r, n)) for r, n in roles}),
    )


def _parsed_models(cfg: Config) -> dict[str, ModelConfig]:
    """Each ``models`` entry with its options parsed by its adapter (a new mapping: ``cfg`` is not changed)."""
    models = {}
    for name, m in cfg.models.items():
        try:
            models[name] = resolve_model(m)
        except msgspec.ValidationError as e:
            raise ConfigError(_model_error(cfg, name, m, _readable(str(e)))) from None
    return models


def _model_error(cfg: Config, name: str, m: ModelConfig, text: str) -> str:
    """A models entry's option error as loading used to say it: the key's path and the nearest valid key;
    a key a ``--set`` wrote is named as that ``--set`` (``--set models.p.prefx: no key ...; did you mean``)."""
    written = m.options.values if isinstance(m.options, WrittenOptions) else {}
    raw = {"models": {name: {**{k: getattr(m, k) for k in WORKER_KEYS}, **written}}}
    where = f"models.{name}" + (text if text.startswith(":") else f".{text}")
    key = text.removesuffix(": unknown key")
    hint = _file_key_hint(raw, f"models.{name}", text, _adapter_options)
    if isinstance(m.options, WrittenOptions) and text.endswith(": unknown key") and key in m.options.from_set:
        return f"--set models.{name}.{key}: no key models.{name}.{key}{hint}"
    return f"{cfg.source}: {where}{hint}"


def _adapter_options(name: str) -> Any:
    return adapter_module(name).Options


def _agent_module(name: str, a: AgentConfig, source: str) -> ModuleType:
    """agents.NAME's module, which validates its ``options`` now, not as a failure on every rollout.

    An agent module may define ``check_options(options) -> parsed`` (raising ``ValueError``).
    """
    try:
        module = load_plugin("agent", a.agent, f"agents.{name}.agent")
    except UserError as e:
        raise ConfigError(f"{source}: {e}") from None
    check = getattr(module, "check_options", None)
    if check is not None:
        try:
            check(a.options)
        except ValueError as e:
            text = _readable(str(e).removeprefix("options: "))
            sep = "" if text.startswith(":") else "."
            raise ConfigError(f"{source}: agents.{name}.options{sep}{text}") from None
    return module


def _file_key_hint(raw: dict[str, Any], prefix: str, text: str, options_of: OptionsOf | None = None) -> str:
    """For ``KEY: unknown key`` (a typo in a file): the nearest valid key, as ``--set`` says it."""
    if not text.endswith(": unknown key"):
        return ""
    key = text.removesuffix(": unknown key")
    return _unknown_key_hint(raw, f"{prefix}.{key}" if prefix else key, options_of)


def _readable(msg: str) -> str:
    """``Object contains unknown field `x` - at `$.agents.a``` → ``agents.a.x: unknown key``."""
    m = _PATH_RE.search(msg)
    path = m.group(1).lstrip(".") if m else ""
    unknown = re.match(r"Object contains unknown field `([^`]+)`", msg)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return f"{key}: unknown key"
    text = _PATH_RE.sub("", msg).rstrip(" -")
    return f"{path}: {text}" if path else f": {text}"


def redact(cfg: Config) -> dict[str, Any]:
    """The config as builtins with every secret replaced, safe to print or log."""
    data = msgspec.to_builtins(cfg)
    data["models"] = {name: m.redacted() for name, m in cfg.models.items()}  # each adapter names its secrets
    return data
