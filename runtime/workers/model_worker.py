"""Serves one model: direct calls while it has free slots, else the model's work queue.

Two ways in, one set of slots:

* **direct** (``{ns}.call.model.{name}``, core NATS, queue group ``model.{name}``):
  a call taken while a slot is free runs at once and is answered on its reply
  subject — one round trip, nothing stored. With no free slot (or paused, or
  draining) the worker answers ``busy`` at once and the caller publishes the
  call to the work queue instead (``Bus.direct_or_queued``).
* **affine** (``{ns}.call.model.{name}.{worker}``, core NATS, this replica's own): a rollout's later
  turns, sent to the replica that served its last turn (its prefix cache), admitted exactly as direct calls
  are: only with a free slot at once (``transport.model_calls``). Served only where the adapter's replicas
  hold a prefix cache (``ModelConfig.routed_load``).
* **queued** (``{ns}.model.{name}``, JetStream): pulled by free slot; one a pull request sent while a slot was
  free delivers after direct calls took every slot is nak'd back to the queue at once (``_handle``), for a
  replica with a free slot, not held behind a long generation. Each request
  carries its reply subject in the ``Gym-Reply`` header; the worker tells the caller
  when it takes the request (the call's timeout counts from then, not from its wait
  in the queue), the answer goes back on core NATS and the request is acked only
  after the reply is sent. If this worker
  dies mid-request the message is not acked and JetStream redelivers it to
  another replica after ``ack_wait``; a caller whose direct call loses its
  worker (no progress for the bus's ``timings.liveness_s``) sends it to the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import time
import uuid
from typing import Any

import anyio
from opentelemetry import trace

from gym_runtime.config import ResolvedConfig
from gym_runtime.errors import Failure, ModelError
from gym_runtime.messages import TRAINING_FIELDS, ModelRequest, ModelResponse, PauseAck, PauseModel, Response
from gym_runtime.model import (
    PAUSE_MODES,
    InterruptibleAdapter,
    ModelAdapter,
    Partial,
    check_adapter,
    cut_response,
    interruptible,
    load_adapter,
)
from gym_runtime.observability import logs
from gym_runtime.transport.bus import Bus
from gym_runtime.transport.delivery import Delivery
from gym_runtime.transport.headers import REPLY_HEADER, sent_as_control
from gym_runtime.transport.interface import Puller
from gym_runtime.transport.model_calls import PROGRESS_STREAM, ROUTES
from gym_runtime.workers.base import drain_puller, serve_pulled
from gym_runtime.workers.control import ControlView, Flight, Pausable
from gym_runtime.workers.generation_cut import CutClock, continued, progress_body

log = logs.get("gym.model")
ENDPOINT_RECHECK_S = 30.0  # a worker whose endpoint cannot serve asks again this often (it may come up)


def _as_asked(echoed: list[Any], asked: list[Any] | None) -> bool:
    """Whether a response's tools are the very tools its request offered (an adapter echoes them as given): by
    identity, so a caller learns it without comparing what can be hundreds of tools."""
    return asked is not None and (
        echoed is asked or (len(echoed) == len(asked) and all(map(operator.is_, echoed, asked)))
    )


class ModelWorker:
    """models.NAME of a resolved config: its adapter's options parsed and its fingerprint computed there."""

    def __init__(
        self,
        bus: Bus,
        name: str,
        config: ResolvedConfig,
        *,
        adapter: ModelAdapter | None = None,
        verdict_said_by_caller: bool = False,
    ) -> None:
        self.bus = bus
        # a one-shot command (`run`) refuses a dead endpoint in its own one line: then the worker's log of it is
        # info, not a second warning per worker; a service (`start`) warns, as its operator reads nothing else
        self.verdict_said_by_caller = verdict_said_by_caller
        self.name = name
        self.cfg = cfg = config.models[name]
        self.adapter = adapter or load_adapter(cfg, base_dir=config.base_dir)
        self.can_stop = interruptible(self.adapter)  # by its config: said once, read per call and per pause
        self.worker_id = uuid.uuid4().hex[:12]
        self.span_attributes = {"gym.model": name, "gym.worker": self.worker_id}  # on each call's CONSUMER span
        self.puller: Puller | None = None
        self.served = 0
        self.direct = 0  # of them, calls that came straight (not through the work queue)
        self.expired = 0  # queued calls not run: taken after their callers had stopped waiting
        self.handed_back = 0  # queued calls nak'd back to the queue: delivered while every slot was held
        self.stopped = 0  # tries stopped by a pause (interrupt, abort) and made again after the resume
        self.regenerated = 0  # generated tokens dropped by an abort (made again after the resume)
        self.cut = 0  # generations stopped at their rollout's deadline (``ModelRequest.cut_at``), their tokens kept
        # calls served by how they were routed (``ModelRequest.route``): to this replica as its rollout's last turn
        # was here, or here as that replica was full ("load") or gone ("moved"); the rest had no earlier turn
        self.routed = dict.fromkeys(ROUTES, 0)
        self.fingerprint = config.fingerprints[("model", name)]
        self.fields = config.fields[("model", name)]
        self.endpoint_problem: str | None = None  # why the adapter's endpoint cannot serve (``_check_endpoint``)
        # every endpoint of the adapter out of service, as its last call said (``ModelError.out_of_service``);
        # None again once a call succeeds. A ``run`` stops its batch on it (``service.runner``)
        self.out_of_service: str | None = None
        self.went_out = anyio.Event()  # set the first time ``out_of_service`` is
        self.control = ControlView(bus)
        self.gate = Pausable()  # trainer pause/resume (weight sync without failed calls)
        # A pulled call may arrive while direct calls hold every slot (pull requests already out
        # still deliver): it goes back to the queue (``_handle``), or, taken by a race, waits here, so no more
        # than `concurrency` generations ever run.
        # asyncio's: taking a free slot does not yield (anyio's does, once per call), so a fast
        # model's call finishes in the turn it starts; see Serving.serve_direct
        self.running = asyncio.Semaphore(max(1, cfg.concurrency))

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            await self._check_endpoint()
            if self.endpoint_problem is not None:
                tg.start_soon(self._recheck_endpoint)
            await self.control.start(tg)
            await self.bus.serve(tg, self.bus.subjects.pause(self.name), self._on_pause, concurrency=4)
            await self.bus.serve(tg, self.bus.subjects.resume(self.name), self._on_resume, concurrency=4)
            if await self.control.paused(self.name):
                await self.gate.pause()
            self.puller = await self.bus.work_queue(
                "model",
                self.name,
                slots=self.cfg.concurrency,
                ack_wait=self.cfg.ack_wait_s,
                handle=self._handle,
            )
            direct = await self.bus.serve_direct(
                tg,
                self.bus.subjects.model_direct(self.name),
                self._generate,
                queue=self.bus.subjects.model_group(self.name),
                admit=self._admit,
                done=self._direct_done,
                default_error="model_error",
                attributes=self.span_attributes,
            )
            subs = [direct]
            if self.cfg.routed_load():  # its prefix cache: a rollout's later turns come to it by name
                mine = await self.bus.serve_direct(
                    tg,
                    self.bus.subjects.model_replica(self.name, self.worker_id),
                    self._generate,
                    queue="",
                    admit=self._admit,
                    done=self._direct_done,
                    default_error="model_error",
                    attributes=self.span_attributes,
                )
                subs.append(mine)
            # ready means the server routes direct calls here: a call sent on another connection before the
            # server read this SUB finds no responders and skips every direct try for DIRECT_ABSENT_S
            await self.bus.flush()
            try:
                await serve_pulled(
                    self,
                    self.puller,
                    role="model",
                    task_status=task_status,
                    log=log,
                    adapter=self.cfg.adapter,
                    slots=self.cfg.concurrency,
                )
            finally:
                with anyio.CancelScope(shield=True):
                    for sub in subs:
                        with contextlib.suppress(Exception):  # a closed connection has no subscription left
                            await sub.unsubscribe()
                    await self.adapter.aclose()
                tg.cancel_scope.cancel()

    async def _check_endpoint(self) -> None:
        """Ask the adapter once whether its endpoint serves the model: the verdict is in this worker's
        discovery answer, so ``run`` and ``publish`` refuse a dead endpoint before anything is published
        (a ``base_url`` may resolve only on this worker's node). Said once when it changes, not per call."""
        before = self.endpoint_problem
        try:
            self.endpoint_problem = await check_adapter(self.adapter)
        except Exception as e:  # a probe that breaks is not a verdict on the endpoint
            log.debug("model.endpoint_check", model=self.name, error=str(e))
            self.endpoint_problem = None
        if self.endpoint_problem is not None and self.endpoint_problem != before:
            say = log.info if self.verdict_said_by_caller else log.warning
            say("model.endpoint_unusable", model=self.name, worker=self.worker_id, cause=self.endpoint_problem)
        elif before is not None and self.endpoint_problem is None:
            log.info("model.endpoint_ok", model=self.name, worker=self.worker_id)

    async def _recheck_endpoint(self) -> None:
        while self.endpoint_problem is not None:
            await anyio.sleep(ENDPOINT_RECHECK_S)
            await self._check_endpoint()

    def _as_sent(self, delivery: Delivery) -> bool:
        """A pause or resume is taken only as the trainer sends it: a server's answer that a requester borrowed
        into the subject (a direct get's, with the requester's own body) is not one (``sent_as_control``)."""
        if sent_as_control(delivery.headers):
            return True
        self.bus.warn_limited("control.refused", "not sent as a control message", subject=delivery.subject)
        return False

    async def _on_pause(self, msg: object, delivery: Delivery) -> PauseAck | None:
        if not self._as_sent(delivery):
            return None
        mode = msg.mode if isinstance(msg, PauseModel) and msg.mode in PAUSE_MODES else "drain"
        can_stop = self.can_stop
        if mode == "interrupt" and not can_stop:  # Client refuses this first; another caller's: drain
            log.warning("model.not_interruptible", model=self.name, worker=self.worker_id, adapter=self.cfg.adapter)
            mode = "drain"
        stopped = await self.gate.pause(mode, cancel=mode == "abort" and not can_stop)
        log.info(
            "model.paused", model=self.name, worker=self.worker_id, held=self.gate.held, mode=mode, stopped=stopped
        )
        return PauseAck(worker=self.worker_id, held=self.gate.held, stopped=stopped)

    async def _on_resume(self, _: object, delivery: Delivery) -> None:
        if not self._as_sent(delivery):
            return
        await self.control.refresh_version(self.name)  # the calls let go start on the version set while paused
        self.gate.resume()
        log.info("model.resumed", model=self.name, worker=self.worker_id)

    def stats(self) -> dict[str, Any]:
        p = self.puller
        return {
            "in_flight": p.busy if p else 0,
            "slots": self.cfg.concurrency,
            "endpoint_problem": self.endpoint_problem,
            "out_of_service": self.out_of_service,
            "served": self.served,
            "direct": self.direct,
            "expired": self.expired,
            "handed_back": self.handed_back,
            "held": self.gate.held,
            "paused": not self.gate.is_open,  # for a weight update (``why`` says so of the calls it holds)
            "stopped": self.stopped,
            "regenerated": self.regenerated,
            "cut": self.cut,
            "routed": dict(self.routed),
            "prefix_cache": cache() if (cache := getattr(self.adapter, "prefix_cache", None)) else {},
            # an HTTP adapter's endpoints out of service, each with why (``why`` names them)
            "endpoints_out": out() if (out := getattr(self.adapter, "endpoints_out", None)) else {},
        }

    async def drain(self) -> None:
        await drain_puller(self.puller)

    async def _generate(self, req: ModelRequest, msg: Delivery) -> ModelResponse:
        if req.fingerprint and req.fingerprint != self.fingerprint:
            raise Failure(
                "config_mismatch",
                (
                    f"model worker {self.worker_id} was started with another config for {self.name!r} than its "
                    f"caller's (fingerprint {self.fingerprint}, the caller's {req.fingerprint}): start every worker "
                    "with the same config and --set values, or give each experiment its own `namespace`"
                ),
            )
        if req.route is not None and req.route in self.routed:
            self.routed[req.route] += 1
        running = self.running  # `concurrency` bounds generations, however the calls arrived
        await running.acquire()
        try:
            # a queued call has a slot: its caller's timeout starts now (its wait in the queue, and behind
            # direct calls that took this replica's slots after it was pulled, was not the call's)
            reply_to = msg.headers.get(REPLY_HEADER) if msg.headers else None
            if reply_to:
                await self.bus.taken(reply_to)
            response, ranges, started, cut = await self._until_done(req)
        finally:
            running.release()
        version = ranges[0][2] if ranges else None
        took = time.perf_counter() - started  # its last try's generation (an interrupted call's earlier ones aside)
        meters = self.bus.telemetry.meters
        usage = response.usage
        if meters.enabled:
            meters.stage_time("model_call", self.name, took)
            if usage is not None:
                meters.model_tokens(self.name, usage.input_tokens, usage.output_tokens)
        span = trace.get_current_span() if self.bus.telemetry.recording else None  # no exporter: no span of ours
        if span is not None and span.is_recording():  # OTel GenAI semantic conventions
            adapter, opts = self.cfg.adapter, self.cfg.options
            model = getattr(opts, "model", None) or self.name  # options differ per adapter
            span.set_attributes(
                {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.provider.name": getattr(opts, "provider", adapter) if adapter == "openai" else adapter,
                    "gen_ai.request.model": model,
                    "gen_ai.response.model": response.model or model,
                    "gen_ai.response.id": response.id,
                    **(
                        {
                            "gen_ai.usage.input_tokens": usage.input_tokens,
                            "gen_ai.usage.output_tokens": usage.output_tokens,
                        }
                        if usage is not None
                        else {}
                    ),
                }
            )
        if version is not None:
            stamp(response, ranges)
        # who generated it and for how long: the caller's row counts both (its provenance and cost)
        return ModelResponse(
            response=response,
            policy_version=version,
            policy_version_last=ranges[-1][2] if ranges else None,
            worker=self.worker_id,
            took_ms=round(1000 * took),
            cut=cut,
            tools_asked=_as_asked(response.tools, req.params.tools),
        )

    async def _until_done(self, req: ModelRequest) -> tuple[Response, list[list[int]], float, bool]:
        """Run the call through the gate until it completes: a pause that stops it (``interrupt``: the tokens
        so far are kept and the next try continues from them; ``abort``: they are dropped) makes it wait
        for the resume and go again, so the caller still gets one response. Returns the response, the
        ``[start, end, version]`` ranges of its generated tokens (empty when no version was ever set), when
        its last try started, and whether it was cut at the request's ``cut_at`` (the response then holds
        the tokens so far: ``cut_response``)."""
        if not self.can_stop or (req.cut_at is None and req.progress_s is None):
            return await self._tries(req, None)
        with CutClock(req.cut_at, req.progress_s) as clock:
            return await self._tries(req, clock)

    async def _tries(self, req: ModelRequest, clock: CutClock | None) -> tuple[Response, list[list[int]], float, bool]:
        partial: Partial | None = None
        ranges: list[list[int]] = []  # over partial's tokens, one per interrupted try
        can_stop = self.can_stop
        if can_stop and req.continue_from is not None:  # a checkpoint's generation: its tokens kept, continued
            partial, ranges = continued(req.continue_from)
        while True:
            flight = await self.gate.enter()
            if clock is not None:
                clock.watch(flight)
            started = time.perf_counter()
            out: Response | Partial | None = None
            try:
                version = await self.control.version(self.name)  # the weights this try starts on
                if can_stop:
                    adapter: InterruptibleAdapter = self.adapter  # type: ignore[assignment]
                    out = await adapter.generate_until(
                        req.params, rollout_key=req.rollout_key, stop=flight.stop, partial=partial
                    )
                else:
                    out = await self._cancellable(flight, req)
            except ModelError as e:
                if e.out_of_service and self.out_of_service is None:
                    log.warning("model.out_of_service", model=self.name, worker=self.worker_id, cause=str(e))
                    self.went_out.set()
                self.out_of_service = str(e) if e.out_of_service else self.out_of_service
                raise Failure("model_error", str(e), retryable=e.retryable) from e
            finally:
                if clock is not None:
                    clock.watch(None)
                self.gate.exit(flight)
            if isinstance(out, Response):
                self.out_of_service = None
                if version is not None:
                    done = ranges[-1][1] if ranges else 0
                    ranges.append([done, max(done, _generated(out, partial)), version])
                return out, (ranges if version is not None else []), started, False
            if clock is not None and clock.fired and out is not None:  # the rollout's deadline: the tokens so far
                _extend(ranges, partial, out, version)
                self.cut += 1
                model = getattr(self.cfg.options, "model", None) or self.name
                return cut_response(req.params, out, model=model), ranges, started, True
            if clock is not None and out is not None and clock.progressed(flight):  # the tokens so far, then on
                _extend(ranges, partial, out, version)
                partial = out
                await self.bus.send_output(PROGRESS_STREAM, progress_body(out, ranges))
                continue
            if not flight.stopped:  # an adapter's bug: it would be called again and again
                raise Failure("model_error", f"adapter {self.cfg.adapter!r} stopped a generation nobody stopped")
            # stopped by a pause: keep the tokens (interrupt) or drop them (abort), then wait for the resume
            self.stopped += 1
            if out is None or flight.mode == "abort":  # a partial's ids include the ones it continued
                dropped = out if out is not None else partial
                self.regenerated += len(dropped.generation_token_ids) if dropped is not None else 0
                partial, ranges = None, []
                continue
            _extend(ranges, partial, out, version)
            partial = out

    async def _cancellable(self, flight: Flight, req: ModelRequest) -> Response | None:
        """The call of an adapter that cannot stop by itself; None where an ``abort`` pause cancelled it (its
        own cancel, taken back here: a cancel of the worker's too still ends the call)."""
        task = flight.task = asyncio.current_task()
        assert task is not None
        try:
            out = await self.adapter.generate(req.params, rollout_key=req.rollout_key)
        except asyncio.CancelledError:
            if flight.cancelled and task.uncancel() == 0:
                return None
            raise
        finally:
            flight.task = None  # ended: a pause from now on has nothing to cancel
        if flight.cancelled:  # the adapter caught the cancel and answered: it was delivered all the same
            task.uncancel()
        return out

    def _admit(self, _: Delivery) -> bool:
        """A direct call runs here only with a free slot and the gate open; else it goes to the queue."""
        return self.gate.is_open and self.puller is not None and self.puller.take_slot()

    async def _direct_done(self) -> None:
        """A direct call ended (answered, or cut short as the worker stops): its slot is free again."""
        assert self.puller is not None
        self.served += 1
        self.direct += 1
        await self.puller.give_slot()

    async def _handle(self, msg: Delivery) -> None:
        reply_to = (msg.headers or {}).get(REPLY_HEADER)
        if self.bus.expired(msg):  # its caller is gone: a slot spent on it would serve nobody
            self.expired += 1
            if self.puller is not None:
                await self.puller.release(msg)
            await msg.ack()
            return
        if self.running.locked() and self.gate.is_open:
            # every slot is held by direct calls taken after the pull request that delivered this one went out:
            # back to the queue at once, for a replica with a free slot, rather than behind a long generation here
            self.handed_back += 1
            if self.puller is not None:
                await self.puller.release(msg)
            await msg.nak()
            return
        meters = self.bus.telemetry.meters
        stored = msg.enqueued_at if meters.enabled else None
        if stored is not None:
            meters.stage_time("queue_wait", self.name, max(0.0, time.time() - stored))
        await self.bus.handle(
            msg,
            self._generate,
            reply_to=reply_to,
            default_error="model_error",
            attributes=self.span_attributes,
        )
        if self.puller is not None:
            await self.puller.release(msg)
        await msg.ack()
        self.served += 1


def _extend(ranges: list[list[int]], partial: Partial | None, out: Partial, version: int | None) -> None:
    """Add the ``[start, end, version]`` range of the tokens ``out`` has past ``partial``'s (its try's own)."""
    done = len(partial.generation_token_ids) if partial else 0
    if version is not None and len(out.generation_token_ids) > done:
        ranges.append([done, len(out.generation_token_ids), version])


def _generated(response: Response, partial: Partial | None) -> int:
    """Tokens the response generated in all (its last token item's), else what ``partial`` held."""
    for item in reversed(response.output):
        ids = getattr(item, "generation_token_ids", None)
        if isinstance(ids, list):
            return len(ids)
    return len(partial.generation_token_ids) if partial else 0


def stamp(response: Response, ranges: list[list[int]]) -> None:
    """Mark each output item that carries token ids with the policy versions that produced them: the one the
    call started on, and ``[start, end, version]`` ranges over its generated tokens (adjacent ones of one
    version merged; more than one when the call was interrupted and continued under a newer version)."""
    merged: list[list[int]] = []
    for start, end, version in ranges:
        if merged and merged[-1][2] == version:
            merged[-1][1] = end
        elif end > start or not merged:
            merged.append([start, end, version])
    for item in response.output:
        if isinstance(getattr(item, TRAINING_FIELDS[0], None), list):
            item.policy_version = ranges[0][2]  # type: ignore[union-attr]
            item.policy_version_ranges = [list(r) for r in merged]  # type: ignore[union-attr]
