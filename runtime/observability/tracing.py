"""OpenTelemetry wiring: an injected tracer provider and W3C trace context in NATS headers.

The provider is never made global (``set_tracer_provider`` works once per
process and tests build many). Without an exporter no span is made: a handler
passes its message's ``traceparent`` on to what it sends, and a message sent
outside any context starts a trace of its own, so every message still carries
a ``traceparent`` and a downstream exporter can join in, at a fraction of the
cost of recording.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from random import getrandbits as _random_bits
from typing import TYPE_CHECKING, Any, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import (
    INVALID_SPAN,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    TraceFlags,
)

from gym_runtime.observability.meters import Meters

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class JsonLinesExporter:
    """Writes one JSON object per finished span to a file (appending; many processes may share it).

    An OpenTelemetry ``SpanExporter`` by its methods, not by its base class: the tracing SDK (and its
    resource detection, psutil included: 25-50 ms of every command's start-up on 2 loaded cores) is
    imported only when something records.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = []
        for s in spans:
            ctx = s.get_span_context()
            parent = s.parent
            if ctx is None:
                continue
            lines.append(
                json.dumps(
                    {
                        "name": s.name,
                        "kind": s.kind.name,
                        "trace_id": format(ctx.trace_id, "032x"),
                        "span_id": format(ctx.span_id, "016x"),
                        "parent_span_id": format(parent.span_id, "016x") if parent else None,
                        "start_ns": s.start_time,
                        "end_ns": s.end_time,
                        "status": s.status.status_code.name,
                        "attributes": dict(s.attributes or {}),
                        "links": [format(link.context.span_id, "016x") for link in s.links],
                        "service": (s.resource.attributes or {}).get("service.name"),
                    }
                )
            )
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # every export is written when it is made


class _Remote(NonRecordingSpan):
    """A remote parent, with the ``traceparent`` it arrived in (when canonical)."""

    traceparent: str | None = None


class _Attached:
    """Make a remote parent the current context for the duration of a handler."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: otel_context.Context) -> None:
        self._ctx = ctx

    def __enter__(self) -> Span:
        self._token = otel_context.attach(self._ctx)
        return trace.get_current_span()

    def __exit__(self, *exc: object) -> None:
        otel_context.detach(self._token)


def current_context() -> otel_context.Context:
    """The trace context now current: kept with work handed to another task, to be ``attached`` there."""
    return otel_context.get_current()


def attached(ctx: otel_context.Context) -> _Attached:
    """``with attached(ctx):`` makes ``ctx`` current (spans started inside are its children)."""
    return _Attached(ctx)


class _Current:
    """No span of ours: the caller's context stays current (and is not ours to set status on)."""

    __slots__ = ()

    def __enter__(self) -> Span:
        return INVALID_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_CURRENT = _Current()

# Without an exporter nothing is recorded, and a handler only has to pass its
# message's ``traceparent`` on to the messages it sends: that string is kept here
# for the handler's duration instead of an OpenTelemetry context (a span context,
# span and context per message were ~5% of a rollout's instructions).
_CARRIED: ContextVar[str | None] = ContextVar("gym_traceparent", default=None)
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACEPARENT_ANY_CASE = re.compile(_TRACEPARENT.pattern, re.IGNORECASE)
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


class _Carried:
    """A non-recording handler's scope: its message's ``traceparent`` is what it sends on."""

    __slots__ = ("_tp", "_token")

    def __init__(self, traceparent: str) -> None:
        self._tp = traceparent

    def __enter__(self) -> Span:
        self._token: Token[str | None] = _CARRIED.set(self._tp)
        return INVALID_SPAN  # nothing records: status and attributes set on it go nowhere

    def __exit__(self, *exc: object) -> None:
        _CARRIED.reset(self._token)


# headers already checked, and their canonical form: every message of a rollout carries the same ``traceparent``
# (5 a weather rollout), so its check (7.6 k instructions, the regular expressions) runs once; emptied when full
_CHECKED: dict[str, str | None] = {}
CHECKED_KEPT = 4096
_UNCHECKED = ""  # (no header is checked as "")


def _valid_traceparent(tp: str | None) -> str | None:
    """``tp`` in canonical form (lower case; version 00 unless it already was), or None if malformed
    (W3C: 2-32-16-2 hex digits; version ff and all-zero ids are invalid)."""
    if not tp or len(tp) != 55:
        return None
    valid = _CHECKED.get(tp, _UNCHECKED)
    if valid is not _UNCHECKED:
        return valid
    if len(_CHECKED) >= CHECKED_KEPT:
        _CHECKED.clear()
    _CHECKED[tp] = valid = _checked_traceparent(tp)
    return valid


def _checked_traceparent(tp: str) -> str | None:
    """``_valid_traceparent``'s answer for a header of 55 characters, worked out."""
    if not _TRACEPARENT.fullmatch(tp):
        if not _TRACEPARENT_ANY_CASE.fullmatch(tp):
            return None
        tp = "00-" + tp[3:].lower()
    if tp[:2] == "ff" or tp[3:35] == _ZERO_TRACE or tp[36:52] == _ZERO_SPAN:
        return None
    return tp


class Telemetry:
    """Tracer plus header propagation for one process."""

    def __init__(self, provider: TracerProvider | None = None, *, meters: Meters | None = None) -> None:
        # Without an exporter nothing is recorded and no span is made (messages carry their caller's
        # context, or a fresh one), so there is no provider either.
        self.recording = provider is not None
        self.provider = provider
        self.tracer = provider.get_tracer("gym_runtime") if provider is not None else None
        self.meters = meters or Meters()  # metric instruments (no-op unless an endpoint was asked for)

    @classmethod
    def from_options(
        cls,
        *,
        trace_file: str | None = None,
        service: str = "gym-runtime",
        meters: Meters | None = None,
    ) -> Telemetry:
        """Export to ``trace_file`` (JSON lines) and/or OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set."""
        exporters: list[SpanExporter] = []
        if trace_file:
            exporters.append(cast("SpanExporter", JsonLinesExporter(trace_file)))
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )

            exporters.append(OTLPSpanExporter())
        if not exporters:
            return cls(meters=meters)
        from opentelemetry.sdk.resources import Resource as OtelResource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

        # a remote parent that was not recorded (its sender had no exporter: a `publish` to `start`'s workers)
        # is joined all the same: this process was asked for its spans, and they land in the sender's trace
        provider = TracerProvider(
            sampler=ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON),
            resource=OtelResource.create({"service.name": service}),
        )
        for e in exporters:
            provider.add_span_processor(BatchSpanProcessor(e, schedule_delay_millis=200))
        return cls(provider, meters=meters)

    def span(
        self,
        name: str,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        parent: otel_context.Context | str | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> AbstractContextManager[Span]:
        """A span as the current span; without an exporter, just the caller's context
        (``parent``, what ``extract`` returned, is what the messages sent inside carry on)."""
        if not self.recording:
            # Nothing is exported: keep the caller's context (``inject`` starts a fresh
            # trace for a message sent outside any context).
            if isinstance(parent, str):
                return _Carried(parent)
            return _Attached(parent) if parent is not None else _CURRENT
        if isinstance(parent, str):
            parent = self._otel_parent(parent)
        assert self.tracer is not None  # recording
        return self.tracer.start_as_current_span(
            name, context=parent, kind=kind, attributes=attributes, record_exception=True
        )

    @staticmethod
    def inject(headers: dict[str, str]) -> dict[str, str]:
        """Add ``traceparent`` for the current span (W3C trace context, version 00).

        Formatted here rather than by OpenTelemetry's propagator, which costs ~30 µs
        a message on the hot path; ``tracestate`` is not used by the runtime.
        """
        tp = _CARRIED.get()
        if tp is not None:  # in a non-recording handler: its message's own header, passed on
            headers["traceparent"] = tp
            return headers
        span = trace.get_current_span()
        tp = getattr(span, "traceparent", None)
        if tp:  # the remote parent's own header (no span of ours in between): no formatting
            headers["traceparent"] = tp
            return headers
        ctx = span.get_span_context()
        if ctx.is_valid:
            headers["traceparent"] = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        else:  # a message sent outside any span still starts a trace of its own
            headers["traceparent"] = f"00-{_random_bits(128) or 1:032x}-{_random_bits(64) or 1:016x}-00"
        return headers

    def extract(self, headers: Mapping[str, str] | None) -> otel_context.Context | str | None:
        """The remote parent in ``traceparent`` (None if absent or malformed), for ``span(parent=...)``.

        Without an exporter it is the header itself, in canonical form: handlers only pass it on.
        """
        tp = _valid_traceparent(headers.get("traceparent") if headers else None)
        if tp is None or not self.recording:
            return tp
        return self._otel_parent(tp)

    @staticmethod
    def _otel_parent(tp: str) -> otel_context.Context:
        """An OpenTelemetry context whose span is the remote parent ``tp`` (a valid, canonical header)."""
        sc = SpanContext(
            int(tp[3:35], 16), int(tp[36:52], 16), is_remote=True, trace_flags=TraceFlags(int(tp[53:55], 16))
        )
        span = _Remote(sc)
        span.traceparent = tp  # messages sent in this context carry it on unchanged
        return trace.set_span_in_context(span)

    @staticmethod
    def current_ids() -> tuple[str, str]:
        tp = _CARRIED.get()
        if tp is not None:
            return tp[3:35], tp[36:52]
        ctx = trace.get_current_span().get_span_context()
        return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
        self.meters.shutdown()
