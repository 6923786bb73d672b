"""The config's schema: each section's Struct, as a YAML file spells it, checked as far as data alone allows.

What a key means and its default live here (and nowhere else); reading files into these Structs is
``loading``, what only the plugins can check is ``resolved``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import msgspec

from gym_runtime.errors import ConfigError, UserError
from gym_runtime.messages import Cost
from gym_runtime.model import ModelConfig
from gym_runtime.transport.limits import DUPLICATE_WINDOW_S, STREAM_LIMITS, parse_size


class ResourceConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    server: str = ""  # module path that defines one Resource subclass
    # Hosted instead of native: a NeMo Gym resources server (a catalogue name such as ``mcqa``, or
    # a server directory of a NeMo Gym checkout) whose own code runs in this resource's workers,
    # in its built environment (gym_runtime.nemo_gym.hosting); ``options`` are that server's config fields.
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
    # Set up once for the group (docs/sandboxes.md#set-up-once-for-the-group): ``seed`` runs once per task on a
    # worker, and each repeat's session is restored from its ``snapshot`` with forks of its sandboxes; for
    # environments that define ``snapshot`` and ``restore`` (checked as a worker starts). A task's template is
    # closed once no repeat took it for ``seed_once_idle_s``.
    seed_once: bool = False
    seed_once_idle_s: float = 120.0

    def __post_init__(self) -> None:
        if self.call_timeout_s <= 0:
            raise ValueError("call_timeout_s must be > 0")
        if self.seed_once_idle_s <= 0:
            raise ValueError("seed_once_idle_s must be > 0")
        if self.seed_once and self.nemo_gym:
            raise ValueError("seed_once: a hosted NeMo Gym server's sessions cannot be snapshotted; remove seed_once")
        if bool(self.server) == bool(self.nemo_gym):
            raise ValueError("give exactly one of server (a gym-runtime Resource module) or nemo_gym (a hosted server)")

    @property
    def hosted(self) -> bool:
        return bool(self.nemo_gym)


HOSTED_AGENT_MODULE = "gym_runtime.nemo_gym.hosting.agent"
_HOSTED_AGENT_BEFORE = "gym_runtime.hosting.agent"  # its path before the move, in configs saved beside rows


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
    # a sandbox whose holder fell silent (its agent worker or resource worker SIGKILLed, its node lost) is kept this
    # long under its lease, for a resumed attempt to reattach to (docs/sandboxes.md, "Leases"), then removed: more
    # than the agents' ack_wait_s (a dead worker's task is redelivered after it), less than idle_ttl_s to count
    lease_grace_s: float = 300.0
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
        if not self.lease_grace_s >= 2:
            raise ValueError("lease_grace_s must be at least 2 (seconds)")
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
    # in its built environment (gym_runtime.nemo_gym.hosting.agent); ``options`` are its config fields.
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
    # A rollout's checkpoint on the bus at each step of a turn that matters, so an attempt redelivered after its
    # worker died resumes at its last turn (docs/operations.md#resume-at-the-last-turn): "auto", from the 4th
    # model turn or the 60th second of a rollout (short rollouts write none: they cost nothing); "every_turn";
    # "off", a redelivered attempt starts over. (YAML reads a bare ``off`` as false: taken as "off".)
    checkpoint: Literal["auto", "every_turn", "off"] | bool = "auto"

    def __post_init__(self) -> None:
        if bool(self.agent) == bool(self.nemo_gym) and not (
            self.nemo_gym and self.agent in (HOSTED_AGENT_MODULE, _HOSTED_AGENT_BEFORE)
        ):
            raise ValueError("give exactly one of agent (a gym-runtime agent module) or nemo_gym (a hosted agent)")
        if self.max_attempts < 1 or self.max_worker_losses < 0:
            raise ValueError("max_attempts must be at least 1 and max_worker_losses at least 0")
        if self.checkpoint is False:
            self.checkpoint = "off"
        elif self.checkpoint is True:
            raise ValueError("checkpoint must be auto, every_turn or off")
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
    # {NS}_CHECKPOINTS: a rollout's checkpoint not replaced for this long is dropped (the backstop: each is
    # deleted with its row, a failure row, a cancel and ``purge``); longer than a turn of the longest rollout
    # (0: never aged out; a negative value is refused)
    checkpoint_ttl_s: float = 6 * 3600.0
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
        if not self.checkpoint_ttl_s >= 0:  # a negative TTL would turn resume off without a word
            raise ConfigError(
                f"jetstream.checkpoint_ttl_s: {self.checkpoint_ttl_s!r} must be >= 0 seconds"
                " (longer than the longest rollout's turn, e.g. 21600; 0 keeps checkpoints until deleted)"
            )
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


class RayRole(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One role's replicas as Ray actors (``start --ray``; docs/deployment.md, "On a Ray cluster"): what each
    actor asks Ray for, and the bounds its backlog scales it within."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_mb: int = 0  # 0: none asked (Ray's ``memory``, in MiB here)
    # custom Ray resources a node must offer, e.g. {docker: 1} for a sandbox pool on the nodes that run Docker
    resources: dict[str, float] = msgspec.field(default_factory=dict)
    # elastic when either is set: between min and max replicas by its backlog (``gym_runtime.placement.backlog``);
    # unset: the entry's ``replicas``, fixed
    min: int | None = None
    max: int | None = None

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0 or self.memory_mb < 0 or any(v < 0 for v in self.resources.values()):
            raise ValueError("num_cpus, num_gpus, memory_mb and resources must be at least 0")
        if self.min is not None and self.min < 0 or self.max is not None and self.max < 1:
            raise ValueError("min must be at least 0 and max at least 1")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is more than max ({self.max})")

    @property
    def elastic(self) -> bool:
        return self.min is not None or self.max is not None


class RayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``start --ray``'s placement: each role's actors, their restarts, the scaler's pace, where NATS runs."""

    roles: dict[str, RayRole] = msgspec.field(default_factory=dict)  # "models.policy": {num_gpus: 1}
    # Ray restarts a dead actor (its worker process died, or its node) this many times (-1: always); start's
    # own supervisor restarts nothing under Ray
    max_restarts: int = -1
    # an actor not placed and ready this long is one line (no node offers what it asks), never a silent wait;
    # keep it under the agents' absent_grace_s, so that a role scaled up from 0 comes within their grace
    placement_timeout_s: float = 30.0
    scale_interval_s: float = 1.0  # how often the scaler reads the backlog
    idle_s: float = 30.0  # a replica more than the backlog needs for this long is drained and removed
    # where the bus is: "config" (the config's nats or --nats: a server every node reaches, outside Ray), or
    # "head" (nats-server in an actor pinned to the head node, its store kept in ``store_dir`` there)
    nats: Literal["config", "head"] = "config"
    nats_port: int = 4222  # nats: head: its client port on the head node
    store_dir: str = ""  # nats: head: the store on the head node; "": ~/.cache/gym-runtime/ray-nats/NAMESPACE

    def __post_init__(self) -> None:
        if self.max_restarts < -1:
            raise ValueError("max_restarts must be -1 (always) or at least 0")
        if min(self.placement_timeout_s, self.scale_interval_s, self.idle_s) <= 0:
            raise ValueError("placement_timeout_s, scale_interval_s and idle_s must be more than 0")
        for key in self.roles:
            role, _, name = key.partition(".")
            if role not in ("agents", "models", "resources", "sandboxes") or not name:
                raise ValueError(f"roles: {key!r} must be ROLE.NAME (agents, models, resources or sandboxes)")


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    namespace: str = "gym"
    nats: str | list[str] = "embedded"
    jetstream: JetStreamConfig = msgspec.field(default_factory=JetStreamConfig)
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    models: dict[str, ModelConfig] = msgspec.field(default_factory=dict)
    resources: dict[str, ResourceConfig] = msgspec.field(default_factory=dict)
    agents: dict[str, AgentConfig] = msgspec.field(default_factory=dict)
    sandboxes: dict[str, SandboxConfig] = msgspec.field(default_factory=dict)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)  # start --ray: actors, scaling (docs/deployment.md)
    pricing: PricingConfig | None = None  # rows' estimated cost (docs/operations.md, "Cost and pricing")
    # the largest reward magnitude a row may carry: a non-finite reward or one beyond it is a verify_error naming the
    # value (docs/rows.md); far inside float32, which TRL casts rewards to
    reward_bound: float = 1e6
    base_dir: str = "."  # set by the loader: relative paths in the config resolve here
    source: str = "config"  # set by the loader: the file(s) that errors found later (resolve_config) name

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.namespace):
            raise ConfigError(f"namespace: {self.namespace!r} may only hold letters, digits, _ and -")
        if not (math.isfinite(self.reward_bound) and self.reward_bound > 0):
            raise ConfigError(f"reward_bound: {self.reward_bound!r} must be a finite number above 0 (default 1e6)")


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


def redact(cfg: Config) -> dict[str, Any]:
    """The config as builtins with every secret replaced, safe to print or log."""
    data = msgspec.to_builtins(cfg)
    data["models"] = {name: m.redacted() for name, m in cfg.models.items()}  # each adapter names its secrets
    return data
