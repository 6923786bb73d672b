"""Process metrics through OpenTelemetry: a Prometheus ``/metrics`` endpoint and/or OTLP.

One :class:`Meters` per process holds the instruments; it rides on
``Telemetry`` (``bus.telemetry.meters``) so workers record without any global
state. Without an endpoint or an OTLP collector it is built on OpenTelemetry's
no-op provider, so a record costs a function call (the hot path stays cheap).

Instruments (Prometheus names in brackets):

- ``gym.rollouts.completed`` [``gym_rollouts_completed_total``] by ``gym.agent``;
  ``gym.rollouts.failed`` [``gym_rollouts_failed_total``] by ``gym.agent`` and ``error.type``
- ``gym.stage.duration`` [``gym_stage_duration_seconds``], a histogram by ``gym.stage``
  (``queue_wait``, ``model_call``, ``tool_call``, ``verify``, ``rollout``) and ``gym.name``
- ``gym.model.tokens`` [``gym_model_tokens_total``] by ``gen_ai.request.model`` and
  ``gen_ai.token.type`` (``input`` / ``output``)
- ``gym.reward`` [``gym_reward``], a histogram by ``gym.agent`` (sum / count = mean reward)
- ``gym.inflight`` / ``gym.slots`` [``gym_inflight``, ``gym_slots``] by ``gym.role`` and
  ``gym.name``: work in progress and capacity per worker kind; ``gym.sessions`` for resources
- ``gym.wait.oldest`` [``gym_wait_oldest_seconds``] by ``gym.name`` (the agent) and ``gym.stage`` (``generating``,
  ``tool``, ``verify``, ``sandbox_wait``, ``agent``, ...): the longest a running rollout has been in its stage
  (``gym-runtime why`` lists each)
- ``gym.queue.pending`` / ``gym.queue.ack_pending`` by ``gym.consumer``: the queue lag of
  each work-queue consumer (messages not yet delivered / delivered but not acked)
- sandbox pools, by ``gym.name`` (the pool): ``gym.sandbox.live`` and ``gym.sandbox.warm`` (gauges:
  containers held, leased or warm; idle warm ones); ``gym.sandbox.created``, ``gym.sandbox.warm_hits``,
  ``gym.sandbox.reaped`` (counters; creates/s is the rate of ``created``); ``gym.sandbox.acquire``
  [``gym_sandbox_acquire_seconds``], a histogram of a create's time in its worker by ``gym.sandbox.warm``;
  ``gym.sandbox.wait`` [``gym_sandbox_wait_seconds``], how long rollouts waited for a lease (the quota);
  ``gym.sandbox.exec`` [``gym_sandbox_exec_seconds``], a command's time in its worker (the engine's exec)

Every process has its own endpoint: ``start`` with a worker pool gives replica
*i* the port ``P + i`` (see ``docs/operations.md``, "Metrics and dashboard"); ``run`` with worker
processes serves theirs merged with its own on its one port (``MergedMetrics``).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, MeterProvider, NoOpMeterProvider, Observation

from gym_runtime.errors import UserError, port_in_use
from gym_runtime.observability import logs

log = logs.get("gym.meters")

STAGE_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
# the other histograms in seconds, bucketed as the stages are
SECONDS_HISTOGRAMS = ("gym.sandbox.acquire", "gym.sandbox.wait", "gym.sandbox.exec")
REWARD_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Meters:
    """The runtime's instruments for one process (no-op unless built by :func:`start`)."""

    def __init__(self, provider: MeterProvider | None = None, *, closers: Iterable[Any] = ()) -> None:
        self.enabled = provider is not None
        self.provider = provider
        self._closers = list(closers)
        self._workers: list[tuple[str, str, Any]] = []  # (role, name, worker with stats())
        self.queues: dict[str, dict[str, Any]] = {}  # consumer -> consumers() entry, refreshed by watch_queues
        # Counters are tallied in plain dicts (a dict update on the hot path) and read by the SDK when
        # it collects; only histograms go through the SDK per measurement.
        self._completed: dict[str, int] = {}
        self._failed: dict[tuple[str, str], int] = {}
        self._tokens: dict[tuple[str, str], int] = {}
        # rows' cost by (agent, model entry, token type, outcome) and the estimate by (agent, outcome)
        self._cost_tokens: dict[tuple[str, str, str, str], int] = {}
        self._cost_estimated: dict[tuple[str, str], float] = {}
        self._cost_sandbox_cpu: dict[tuple[str, str], float] = {}  # seconds by (agent, outcome)
        meter = (provider or NoOpMeterProvider()).get_meter("gym_runtime")
        self.stage = meter.create_histogram(
            "gym.stage.duration", unit="s", description="time spent per stage of a rollout"
        )
        self.reward = meter.create_histogram("gym.reward", unit="1", description="reward of completed rollouts")
        self.sandbox_acquire = meter.create_histogram(
            "gym.sandbox.acquire", unit="s", description="a sandbox create's time in its worker (warm or cold)"
        )
        self.sandbox_wait = meter.create_histogram(
            "gym.sandbox.wait", unit="s", description="time a rollout waited for a sandbox lease (the pool was full)"
        )
        self.sandbox_exec = meter.create_histogram(
            "gym.sandbox.exec", unit="s", description="a sandbox command's time in its worker (the engine's exec)"
        )
        for kind, name, observe, unit, what in self._observed():
            make = meter.create_observable_gauge if kind == "gauge" else meter.create_observable_counter
            make(name, [observe], unit=unit, description=what)

    def _observed(self) -> list[tuple[str, str, Any, str, str]]:
        """The instruments the SDK reads when it collects: (gauge or counter, name, callback, unit, description)."""
        sandbox = [
            ("gauge", "live", "sandboxes held (leased, warm or being created) per pool"),
            ("gauge", "warm", "idle warm sandboxes ready per pool"),
            ("counter", "created", "containers created per pool (warm ones included)"),
            ("counter", "warm_hits", "creates served from the warm pool"),
            ("counter", "reaped", "containers removed by the reaper or the idle timeout"),
        ]
        return [
            ("counter", "gym.cost.tokens", self._observe_cost_tokens, "{token}",
             "model tokens of finished rollouts per agent and model entry (judges too), failed apart"),
            ("counter", "gym.cost.estimated", self._observe_cost_estimated, "1",
             "estimated cost of finished rollouts (pricing: in pricing.currency), failed apart"),
            ("counter", "gym.cost.sandbox_cpu", self._observe_cost_sandbox_cpu, "s",
             "CPU seconds the sandboxes of finished rollouts used, where counted, failed apart"),
            ("counter", "gym.rollouts.completed", self._observe_completed, "{rollout}", "rollouts that produced a row"),
            ("counter", "gym.rollouts.failed", self._observe_failed, "{rollout}",
             "rollouts that ended as a failure row, by error class"),
            ("counter", "gym.model.tokens", self._observe_tokens, "{token}",
             "model tokens in (prompt) and out (completion)"),
            ("counter", "gym.model.routed", self._observe_per_model("routed", "gym.route"), "{call}",
             "model calls served per model by how they were routed (affine, load, moved: docs/models.md)"),
            ("counter", "gym.model.prefix_cache", self._observe_per_model("prefix_cache", "gym.kind"), "{token}",
             "prompt tokens the engine looked up in its prefix cache (queries) and found there (hits), per model"),
            ("gauge", "gym.inflight", self._observe_inflight, "{item}",
             "rollouts / model calls in progress per worker kind"),
            ("gauge", "gym.slots", self._observe_slots, "{slot}", "concurrency slots per worker kind"),
            ("gauge", "gym.sessions", self._observe_sessions, "{session}", "open resource sessions"),
            ("gauge", "gym.wait.oldest", self._observe_oldest_wait, "s",
             "the longest a running rollout has waited in its current stage, per agent and stage (why)"),
            *[(kind, f"gym.sandbox.{k}", self._observe_sandbox(k), "{sandbox}", what) for kind, k, what in sandbox],
            ("gauge", "gym.queue.pending", self._observe_queue("pending"), "{message}",
             "messages waiting in a work queue, per consumer"),
            ("gauge", "gym.queue.ack_pending", self._observe_queue("ack_pending"), "{message}",
             "messages delivered but not yet acked"),
        ]  # fmt: skip

    # -- recording (hot path) -----------------------------------------------------------------------
    def stage_time(self, stage: str, name: str, seconds: float) -> None:
        if self.enabled:
            self.stage.record(seconds, {"gym.stage": stage, "gym.name": name})

    def rollout_done(self, agent: str, seconds: float, reward: float | None) -> None:
        self._completed[agent] = self._completed.get(agent, 0) + 1
        if self.enabled:
            self.stage.record(seconds, {"gym.stage": "rollout", "gym.name": agent})
            if reward is not None:
                self.reward.record(reward, {"gym.agent": agent})

    def rollout_failed(self, agent: str, seconds: float, error_class: str) -> None:
        key = (agent, error_class)
        self._failed[key] = self._failed.get(key, 0) + 1
        if self.enabled:
            self.stage.record(seconds, {"gym.stage": "rollout", "gym.name": agent})

    def sandbox_acquired(self, pool: str, seconds: float, *, warm: bool) -> None:
        if self.enabled:
            self.sandbox_acquire.record(seconds, {"gym.name": pool, "gym.sandbox.warm": warm})

    def sandbox_executed(self, pool: str, seconds: float) -> None:
        if self.enabled:
            self.sandbox_exec.record(seconds, {"gym.name": pool})

    def sandbox_waited(self, pool: str, seconds: float) -> None:
        if self.enabled:
            self.sandbox_wait.record(seconds, {"gym.name": pool})

    def model_tokens(self, model: str, input_tokens: int, output_tokens: int) -> None:
        t = self._tokens
        t[(model, "input")] = t.get((model, "input"), 0) + input_tokens
        t[(model, "output")] = t.get((model, "output"), 0) + output_tokens

    def rollout_cost(self, agent: str, cost: Any, *, failed: bool) -> None:
        """Count a finished rollout's ``cost`` (a ``messages.Cost``) under its agent, failed ones apart."""
        if not self.enabled or cost is None:
            return
        outcome = "failed" if failed else "ok"
        t = self._cost_tokens
        for model, used in cost.models.items():
            for kind, n in (("input", used.input_tokens), ("output", used.output_tokens)):
                key = (agent, model, kind, outcome)
                t[key] = t.get(key, 0) + n
        if cost.estimated_cost is not None:
            e = self._cost_estimated
            e[(agent, outcome)] = e.get((agent, outcome), 0.0) + cost.estimated_cost
        if cost.sandbox_cpu_ms:
            c = self._cost_sandbox_cpu
            c[(agent, outcome)] = c.get((agent, outcome), 0.0) + cost.sandbox_cpu_ms / 1000

    def _observe_cost_tokens(self, _: CallbackOptions) -> list[Observation]:
        return [
            Observation(v, {"gym.agent": a, "gym.model": m, "gen_ai.token.type": k, "gym.outcome": o})
            for (a, m, k, o), v in list(self._cost_tokens.items())
        ]

    def _observe_cost_estimated(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(v, {"gym.agent": a, "gym.outcome": o}) for (a, o), v in list(self._cost_estimated.items())]

    def _observe_cost_sandbox_cpu(self, _: CallbackOptions) -> list[Observation]:
        return [
            Observation(v, {"gym.agent": a, "gym.outcome": o}) for (a, o), v in list(self._cost_sandbox_cpu.items())
        ]

    def _observe_completed(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(v, {"gym.agent": a}) for a, v in list(self._completed.items())]

    def _observe_failed(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(v, {"gym.agent": a, "error.type": e}) for (a, e), v in list(self._failed.items())]

    def _observe_tokens(self, _: CallbackOptions) -> list[Observation]:
        return [
            Observation(v, {"gen_ai.request.model": m, "gen_ai.token.type": k})
            for (m, k), v in list(self._tokens.items())
        ]

    # -- workers and queues (read when scraped) -----------------------------------------------------
    def track(self, role: str, name: str, worker: Any) -> None:
        """Report ``worker.stats()`` (``in_flight``, ``slots``, ``sessions``) as gauges until ``untrack``."""
        self._workers.append((role, name, worker))

    def untrack(self, worker: Any) -> None:
        self._workers = [w for w in self._workers if w[2] is not worker]

    def _sum(self, key: str) -> list[Observation]:
        totals: dict[tuple[str, str], float] = {}
        for role, name, worker in self._workers:
            value = worker.stats().get(key)
            if isinstance(value, (int, float)):
                totals[(role, name)] = totals.get((role, name), 0) + value
        return [Observation(v, {"gym.role": r, "gym.name": n}) for (r, n), v in totals.items()]

    def _observe_inflight(self, _: CallbackOptions) -> list[Observation]:
        return self._sum("in_flight")

    def _observe_per_model(self, key: str, label: str) -> Any:
        """A model worker's ``stats()[key]`` (a count per ``label`` value: a route, a prefix-cache kind) summed
        per model."""

        def observe(_: CallbackOptions) -> list[Observation]:
            totals: dict[tuple[str, str], int] = {}
            for role, name, worker in self._workers:
                counts = worker.stats().get(key) if role == "model" else None
                for value, n in (counts or {}).items():
                    totals[(name, value)] = totals.get((name, value), 0) + n
            return [Observation(n, {"gym.model": m, label: v}) for (m, v), n in totals.items()]

        return observe

    def _observe_slots(self, _: CallbackOptions) -> list[Observation]:
        return self._sum("slots")

    def _observe_sessions(self, _: CallbackOptions) -> list[Observation]:
        return self._sum("sessions")

    def _observe_oldest_wait(self, _: CallbackOptions) -> list[Observation]:
        oldest: dict[tuple[str, str], float] = {}
        for _role, name, worker in self._workers:
            waits = getattr(worker, "waits", None)
            for e in waits()["waits"] if waits is not None else ():
                key = (name, e["stage"])
                oldest[key] = max(oldest.get(key, 0.0), e["for_s"])
        return [Observation(v, {"gym.name": n, "gym.stage": st}) for (n, st), v in oldest.items()]

    def _observe_sandbox(self, key: str) -> Any:
        def observe(_: CallbackOptions) -> list[Observation]:
            return [o for o in self._sum(key) if o.attributes and o.attributes.get("gym.role") == "sandbox"]

        return observe

    def _observe_queue(self, key: str) -> Any:
        def observe(_: CallbackOptions) -> list[Observation]:
            return [Observation(q[key], {"gym.consumer": c, "gym.stream": q["stream"]}) for c, q in self.queues.items()]

        return observe

    def shutdown(self) -> None:
        for close in self._closers:
            close()
        if self.provider is not None:
            self.provider.shutdown()  # type: ignore[attr-defined]
        self.provider = None


class MergedMetrics:
    """A prometheus_client collector: this process's own metrics plus those of the ``/metrics`` URLs of
    worker processes it started (``run --processes``), merged so that the user's one port shows the whole
    run: the same series from several processes are summed (counters, histograms), or the largest kept
    (gauges: the queue lag every process reports); a process that does not answer is left out."""

    def __init__(self, own: Any, urls: list[str]) -> None:
        self.own = own
        self.urls = urls

    def _families(self) -> list[Any]:
        import urllib.request

        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        # this process's own through the same text round trip, so that family names and types match
        families = list(text_string_to_metric_families(generate_latest(self.own).decode()))
        for url in self.urls:
            try:
                with urllib.request.urlopen(url, timeout=2.0) as r:
                    families += list(text_string_to_metric_families(r.read().decode()))
            except (OSError, ValueError):
                continue  # starting or stopping: its series come back with the next scrape
        return families

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import Metric

        merged: dict[str, Any] = {}
        values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for fam in self._families():
            out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            acc = values.setdefault(fam.name, {})
            for sample in fam.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in acc:
                    acc[key] = sample.value
                elif sample.name.endswith("_created"):
                    acc[key] = min(acc[key], sample.value)
                elif out.type == "gauge":
                    acc[key] = max(acc[key], sample.value)
                else:
                    acc[key] += sample.value
        for name, out in merged.items():
            for (sample_name, labels), value in values[name].items():
                out.add_sample(sample_name, dict(labels), value)
            yield out


def start(
    *, service: str, role: str, port: int | None = None, host: str = "127.0.0.1", children: list[str] | None = None
) -> Meters:
    """Meters for this process: a Prometheus endpoint on ``host:port`` when ``port`` is given, OTLP
    metrics when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._METRICS_ENDPOINT``) is set, else no-op.
    ``children``: the ``/metrics`` URLs of worker processes this one started, served merged on ``port``
    (see ``MergedMetrics``).

    This is also the hook for other long-lived processes (e.g. a gateway) to expose the same metrics.
    The metrics SDK is imported only when there is somewhere to send metrics (a command without an
    endpoint or OTLP does not pay for its import, ~15-25 ms on 2 loaded cores).
    """
    readers: list[Any] = []
    closers: list[Any] = []
    if port is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()  # per process, not prometheus_client's global one
        readers.append(PrometheusMetricReader(registry=registry))
        served = registry
        if children:
            served = CollectorRegistry(auto_describe=False)
            served.register(MergedMetrics(registry, children))
        try:
            server, thread = start_http_server(port, addr=host, registry=served)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"--metrics-port {port}: {port_in_use(host, port, '--metrics-port')}") from None
            raise UserError(f"--metrics-port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None

        def close_http() -> None:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

        closers.append(close_http)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if not readers:
        return Meters()
    from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
    from opentelemetry.sdk.resources import Resource

    provider = SdkMeterProvider(
        metric_readers=readers,
        resource=Resource.create({"service.name": service, "gym.role": role}),
        views=[
            View(instrument_name="gym.stage.duration", aggregation=ExplicitBucketHistogramAggregation(STAGE_BUCKETS_S)),
            View(instrument_name="gym.reward", aggregation=ExplicitBucketHistogramAggregation(REWARD_BUCKETS)),
            # the sandbox histograms are in seconds too (OpenTelemetry's default buckets are milliseconds')
            *[
                View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(STAGE_BUCKETS_S))
                for name in SECONDS_HISTOGRAMS
            ],
        ],
    )
    return Meters(provider, closers=closers)
