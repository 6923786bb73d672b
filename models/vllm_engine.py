"""``vllm_engine``: vLLM's ``AsyncLLM`` inside the model worker — no HTTP hop.

The model worker pulls generation requests from ``{ns}.model.{name}`` by free slot
and calls ``generate`` here, which hands the token ids straight to the engine in
the same process (install with the ``vllm`` extra: ``pip install -e '.[vllm]'``).

* Chat template with tools: the tokenizer's own (or ``chat_template:`` a Jinja file),
  applied with ``tools`` and ``chat_template_kwargs`` after vLLM's preprocessing
  (tool-call arguments parsed to objects, text parts joined), so prompts equal what
  vLLM's server would render.
* Parsers: ``tool_call_parser`` (``hermes`` built in with vLLM's semantics; any other
  name is looked up in vLLM's ``ToolParserManager``) and ``reasoning_parser`` (a
  vLLM ``ReasoningParserManager`` name; unset: ``<think>`` spans, NeMo Gym's way).
* Token ids and logprobs are native (``RequestOutput``): with ``return_token_ids``
  the last output item carries ``prompt_token_ids`` (exactly the ids the engine
  saw), ``generation_token_ids`` and ``generation_log_probs`` (``logprobs=0``: the
  sampled token's logprob).
* Later turns of a rollout are token-contiguous by the same construction as the
  ``vllm`` adapter (``models.vllm.splice_prompt``): rollout ids + the template's
  ids after the previous turn's end token, the template rendered locally.
* ``engine_args`` go to ``AsyncEngineArgs`` (``model`` is ``cfg.model``, a local
  path or hub id); a prompt that no longer fits the context ends the rollout with
  an ``incomplete`` empty message, as the HTTP adapters do.

``engine`` and ``tokenizer`` can be injected (tests use a fake engine; the slow
test tier runs real vLLM on CPU with a tiny random-weight model).
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import anyio
import msgspec

from gym_runtime.chat import (
    INCOMPLETE_REASONS,
    build_chat_body,
    chat_message_to_items,
    incomplete_response,
    make_response,
)
from gym_runtime.errors import ModelError
from gym_runtime.messages import CreateParams, Response, Usage
from gym_runtime.model import AdapterOptions, Partial
from gym_runtime.models.tokens import (
    TOKEN_FIELDS,
    find_end_token,
    last_token_turn,
    message_from_raw_text,
    parse_hermes_tool_calls,
    splice_prompt,
    tool_choice_structured_outputs,
)
from gym_runtime.models.vllm_cpu import cpu_kv_cache, cpu_start_error
from gym_runtime.observability import logs

__all__ = [
    "EngineCompletion",
    "EngineOutput",
    "Options",
    "VLLMEngineModel",
    "create",
    "interrupt_problem",
    "template_messages",
]

IPC_DIR_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM names the ZMQ IPC sockets between the engine and its core process


def own_ipc_dir() -> str:
    """The directory vLLM's engines in this process put their IPC sockets in.

    vLLM binds a few socket files per engine start in ``VLLM_RPC_BASE_PATH`` (the temp directory unless set) and
    never removes them: ~14 per run of the vLLM tests piled up in ``/tmp`` here. Unless the environment names a
    directory, this process gets one of its own, removed when it exits; set before the first engine starts (vLLM
    reads the variable then), and the engine's core process inherits it."""
    named = os.environ.get(IPC_DIR_ENV)
    if named:
        return named
    path = tempfile.mkdtemp(prefix="gym-vllm-ipc-")
    os.environ[IPC_DIR_ENV] = path
    atexit.register(shutil.rmtree, path, True)
    return path


log = logs.get("gym.models.vllm_engine")

# ``adapter: vllm_engine`` keys: the token ones (``models.tokens``) and these. Defined
# without importing vLLM, so configs validate where the ``vllm`` extra is not installed.
Options = msgspec.defstruct(
    "Options",
    [
        ("model", str | None, None),  # a local model directory or hub id
        ("extra_body", dict[str, Any], msgspec.field(default_factory=dict)),  # sampling keys merged in
        ("chat_template", str | None, None),  # a Jinja file overriding the tokenizer's
        ("engine_args", dict[str, Any], msgspec.field(default_factory=dict)),  # vLLM AsyncEngineArgs
        *TOKEN_FIELDS,
    ],
    bases=(AdapterOptions,),
    # the engine's automatic prefix caching (on unless engine_args turn it off): a rollout's turns gain by
    # returning to this replica (``ModelConfig.affinity_load``)
    namespace={"holds_prefix_cache": lambda self: self.engine_args.get("enable_prefix_caching") is not False},
    module=__name__,
    kw_only=True,
    forbid_unknown_fields=True,
)

_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's preprocessing before a chat template: tool-call arguments as objects, text parts joined."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "\n".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = dict(tc.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args) if args else {}
                    except ValueError:
                        parsed = {}
                    fn["arguments"] = parsed if isinstance(parsed, dict) else {}
                calls.append({**tc, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


@dataclass
class EngineCompletion:
    """What this adapter reads of one of vLLM's ``CompletionOutput``s (for engines of other adapters: the
    ``transformers`` and ``verl_server`` ones reuse everything here but the engine)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass
class EngineOutput:
    """vLLM's ``RequestOutput``, as far as this adapter reads it (cumulative, as vLLM streams it)."""

    prompt_token_ids: list[int]
    outputs: list[EngineCompletion]
    finished: bool = False


def _ids(value: Any) -> list[int]:
    if isinstance(value, dict) or hasattr(value, "keys"):
        value = value["input_ids"]
    return list(value)


class VLLMEngineModel:
    def __init__(
        self,
        cfg: Any,
        *,
        concurrency: int = 64,
        base_dir: str | None = None,
        engine: Any = None,
        tokenizer: Any = None,
    ) -> None:
        if engine is None and not cfg.model:
            raise ValueError("vllm_engine adapter: set model (a local model directory or hub id)")
        self.cfg = cfg
        self._engine = engine
        self._tokenizer = tokenizer
        self._template: str | None = None
        if cfg.chat_template:
            path = Path(cfg.chat_template)
            if not path.is_absolute() and base_dir:
                path = Path(base_dir) / path
            self._template = path.read_text()
        self._eos: int | None = cfg.eos_token_id
        self._max_len: int | None = None
        self._lock = anyio.Lock()
        self._tool_parser: Any = None
        self._reasoning_parser: Any = None
        self.cache = CacheCounts()  # the engine's own prefix-cache counters (its scheduler's stats)

    def __repr__(self) -> str:
        return f"VLLMEngineModel(model={self.cfg.model!r})"

    # ------------------------------------------------------------------ startup

    async def _ensure(self) -> None:
        if self._engine is not None and self._tokenizer is not None and self._max_len is not None:
            return
        async with self._lock:
            if self._engine is None:
                try:
                    from vllm.engine.arg_utils import AsyncEngineArgs
                    from vllm.v1.engine.async_llm import AsyncLLM
                except ImportError as e:
                    raise ModelError(
                        f"vllm_engine needs vLLM in this environment (pip install -e '.[vllm]'): {e}"
                    ) from None
                on_cpu = cpu_kv_cache(self.cfg.engine_args)
                own_ipc_dir()
                args = AsyncEngineArgs(model=self.cfg.model, **self.cfg.engine_args)
                try:
                    self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[self.cache.logger_factory()])
                except (RuntimeError, ValueError) as e:
                    if not on_cpu:
                        raise
                    raise cpu_start_error(e) from None
                log.info("model.engine_started", model=self.cfg.model)
            if self._tokenizer is None:
                tok = self._engine.get_tokenizer()
                self._tokenizer = await tok if inspect.isawaitable(tok) else tok
            if self._max_len is None:
                mc = getattr(self._engine, "model_config", None)
                self._max_len = int(getattr(mc, "max_model_len", 0) or 0) or 1 << 62

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, add_generation_prompt: bool = True
    ) -> list[int]:
        kwargs: dict[str, Any] = dict(self.cfg.chat_template_kwargs)
        if self._template:
            kwargs["chat_template"] = self._template
        return _ids(
            self._tokenizer.apply_chat_template(
                template_messages(messages),
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                **kwargs,
            )
        )

    def end_token(self) -> int:
        if self._eos is not None:
            return self._eos
        user = {"role": "user", "content": "hi"}
        found = find_end_token(
            self._render([user], None),
            self._render([user, {"role": "assistant", "content": "ok"}], None, add_generation_prompt=False),
            _ids(self._tokenizer.encode("ok", add_special_tokens=False)),
        )
        if found is None:
            found = getattr(self._tokenizer, "eos_token_id", None)
        if found is None:
            raise ModelError("cannot find the chat template's turn-end token; set eos_token_id")
        self._eos = int(found)
        return self._eos

    # --------------------------------------------------------------- parsing

    def _parse(self, text: str, body: dict[str, Any]) -> dict[str, Any]:
        reasoning = None
        if self.cfg.reasoning_parser:
            reasoning, text = self._vllm_reasoning(text, body)
        name = self.cfg.tool_call_parser
        parse = (
            parse_hermes_tool_calls
            if name == "hermes"
            else None
            if name in (None, "none")
            else (lambda t: self._vllm_tools(t, body))
        )
        msg = message_from_raw_text(text, body, parse_tools=parse, think=not self.cfg.reasoning_parser)
        if reasoning:
            msg["reasoning"] = reasoning
        return msg

    def _request(self, body: dict[str, Any]) -> Any:
        try:
            from vllm.entrypoints.openai.protocol import ChatCompletionRequest
        except ImportError:  # newer layouts
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        fields = {k: body[k] for k in ("messages", "tools", "tool_choice") if k in body}
        return ChatCompletionRequest(model=self.cfg.model or "model", **fields)

    def _vllm_tools(self, text: str, body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
        if self._tool_parser is None:
            try:
                from vllm.tool_parsers import ToolParserManager
            except ImportError:
                from vllm.entrypoints.openai.tool_parsers import ToolParserManager
            self._tool_parser = ToolParserManager.get_tool_parser(self.cfg.tool_call_parser)(self._tokenizer)
        info = self._tool_parser.extract_tool_calls(text, self._request(body))
        calls = [
            {
                "id": getattr(tc, "id", None) or f"chatcmpl-tool-{uuid4().hex[:16]}",
                "type": "function",
                "function": {"name": tc.function.name, "arguments": tc.function.arguments},
            }
            for tc in (info.tool_calls if info.tools_called else [])
        ]
        return info.content, calls

    def _vllm_reasoning(self, text: str, body: dict[str, Any]) -> tuple[str | None, str]:
        if self._reasoning_parser is None:
            from vllm.reasoning import ReasoningParserManager

            self._reasoning_parser = ReasoningParserManager.get_reasoning_parser(self.cfg.reasoning_parser)(
                self._tokenizer
            )
        p = self._reasoning_parser
        extract = getattr(p, "extract_reasoning", None) or p.extract_reasoning_content
        reasoning, content = extract(text, self._request(body))
        return reasoning, content or ""

    # --------------------------------------------------------------- generate

    async def _prepare(self, params: CreateParams) -> tuple[dict[str, Any], list[int], dict[str, Any]] | None:
        """The chat body, the prompt's token ids and the sampling parameters (None: the prompt does not fit)."""
        await self._ensure()
        body = build_chat_body(params, model=None)
        messages, tools = body["messages"], body.get("tools")
        prev = last_token_turn(params.input) if self.cfg.token_in else None
        full = self._render(messages, tools)
        if prev is None:
            prompt = full
        else:
            item = params.input[prev]
            rollout = list(item.prompt_token_ids) + list(item.generation_token_ids)  # type: ignore[union-attr,arg-type]
            prompt = splice_prompt(rollout, full, self.end_token())
        assert self._max_len is not None
        room = self._max_len - len(prompt)
        asked = body.get("max_tokens")
        if room < 1 or (asked is not None and asked < 1):
            if asked is not None and asked < 1:
                raise ModelError(f"max_output_tokens must be at least 1, got {asked}")
            return None
        from_cfg = {k: v for k, v in self.cfg.extra_body.items() if k in _SAMPLING_KEYS}
        sampling = {**{k: body[k] for k in _SAMPLING_KEYS if k in body}, **from_cfg}
        sampling["max_tokens"] = min(asked, room) if asked is not None else room
        guided = tool_choice_structured_outputs(body) or body.get("structured_outputs")
        if guided:
            sampling["structured_outputs"] = guided
        return body, prompt, sampling

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        prepared = await self._prepare(params)
        if prepared is None:
            return incomplete_response(params, model=self.cfg.model or "")
        body, prompt, sampling = prepared
        final = await self._run(prompt, sampling)
        out = final.outputs[0]
        gen = list(out.token_ids)
        lps: list[float] | None = None
        if self.cfg.return_token_ids:
            seen = list(final.prompt_token_ids) if final.prompt_token_ids is not None else prompt
            if seen != prompt:
                raise ModelError("vllm_engine: the engine's prompt_token_ids differ from the prompt sent")
            lps = _logprobs(out, gen)
        return self._response(params, body, prompt, gen, lps, out.text or "", out.finish_reason)

    def _response(
        self,
        params: CreateParams,
        body: dict[str, Any],
        prompt: list[int],
        gen: list[int],
        lps: list[float] | None,
        text: str,
        finish: str | None,
    ) -> Response:
        output = chat_message_to_items(self._parse(text, body))
        reason = INCOMPLETE_REASONS.get(finish or "")
        resp = make_response(
            params,
            id=f"resp_{uuid4().hex}",
            created_at=time.time(),
            model=self.cfg.model or "",
            output=output,
            status="incomplete" if reason else "completed",
            incomplete_details={"reason": reason} if reason else None,
            usage=Usage(input_tokens=len(prompt), output_tokens=len(gen), total_tokens=len(prompt) + len(gen)),
        )
        if lps is not None:
            last = resp.output[-1]
            last.prompt_token_ids = prompt  # type: ignore[union-attr]
            last.generation_token_ids = gen  # type: ignore[union-attr]
            last.generation_log_probs = lps  # type: ignore[union-attr]
        return resp

    # ----------------------------------------------------- interruptible: the engine's abort

    @property
    def can_interrupt(self) -> bool:
        return self.cfg.return_token_ids

    async def generate_until(
        self, params: CreateParams, *, rollout_key: str | None, stop: Any, partial: Partial | None
    ) -> Response | Partial:
        """Generate until done, or until ``stop`` is set: then the engine aborts the request and the ids and
        logprobs so far come back as a ``Partial``; continuing it sends prompt ids + generated ids."""
        if not self.can_interrupt:
            return await self.generate(params, rollout_key=rollout_key)
        if partial is None or partial.state is None:  # no state: a checkpoint's generation, continued here
            prepared = await self._prepare(params)
            if prepared is None:
                return incomplete_response(params, model=self.cfg.model or "")
            body, prompt, sampling = prepared
            if partial is None:
                partial = Partial(prompt_token_ids=prompt, state=(body, sampling, 0))
            else:
                partial = msgspec.structs.replace(partial, state=(body, sampling, 1))
        body, sampling, tries = partial.state
        prompt, done = partial.prompt_token_ids, list(partial.generation_token_ids)
        lps = list(partial.generation_log_probs)
        if stop.is_set():
            return partial
        sent = prompt + done
        left = int(sampling["max_tokens"]) - len(done)
        last: Any = None
        if left >= 1:
            sp = self._sampling_params({**sampling, "max_tokens": left})
            request_id = uuid4().hex
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    await stop.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    async for out in self._engine.generate({"prompt_token_ids": sent}, sp, request_id=request_id):
                        last = out  # cumulative: each output holds every token of this request so far
                finally:
                    if last is None or not last.finished:
                        with anyio.CancelScope(shield=True):
                            await _abort(self._engine, request_id)
                tg.cancel_scope.cancel()
        new = list(last.outputs[0].token_ids) if last is not None and last.outputs else []
        gen = done + new
        lps += _logprobs(last.outputs[0], new) if new else []
        finish = last.outputs[0].finish_reason if last is not None and last.outputs and last.finished else None
        if left < 1:
            finish = "length"
        if finish is None:
            if stop.is_set():
                return Partial(
                    prompt_token_ids=prompt,
                    generation_token_ids=gen,
                    generation_log_probs=lps,
                    state=(body, sampling, tries + 1),
                    text=self._tokenizer.decode(gen, skip_special_tokens=True),  # a cut's message (cut_response)
                )
            raise ModelError("vllm_engine: the engine returned no output", retryable=True)
        if tries or done:  # continued: decode every generated id at once (a character may straddle the cut)
            text = self._tokenizer.decode(gen, skip_special_tokens=True)
        else:
            text = last.outputs[0].text or ""
        return self._response(params, body, prompt, gen, lps, text, finish)

    async def _run(self, prompt: list[int], sampling: dict[str, Any]) -> Any:
        sp = self._sampling_params(sampling)
        final = None
        async for out in self._engine.generate({"prompt_token_ids": prompt}, sp, request_id=uuid4().hex):
            final = out
        if final is None or not final.outputs:
            raise ModelError("vllm_engine: the engine returned no output", retryable=True)
        return final

    def _sampling_params(self, sampling: dict[str, Any]) -> Any:
        factory = getattr(self._engine, "sampling_params", None)  # injected fakes
        if factory is not None:
            return factory(logprobs=0 if self.cfg.return_token_ids else None, **sampling)
        from vllm import SamplingParams

        guided = sampling.pop("structured_outputs", None)
        if guided is not None:
            from vllm.sampling_params import StructuredOutputsParams

            sampling["structured_outputs"] = StructuredOutputsParams(**guided)
        return SamplingParams(logprobs=0 if self.cfg.return_token_ids else None, **sampling)

    def prefix_cache(self) -> dict[str, int]:
        """The engine's prefix-cache hits and queries in tokens, summed since it started (the model worker's
        ``stats``; none until it has scheduled a call)."""
        return self.cache.counts()

    async def aclose(self) -> None:
        engine, self._engine = self._engine, None
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            result = shutdown()
            if inspect.isawaitable(result):
                await result


class CacheCounts:
    """Prefix-cache hits and queries (prompt tokens found in the cache, and looked up) as the engine's scheduler
    counts them (``PrefixCacheStats``), gathered by a stat logger the engine is built with: vLLM's own numbers,
    the ones its ``vllm:prefix_cache_hits`` / ``_queries`` metrics export."""

    __slots__ = ("hits", "queries")

    def __init__(self) -> None:
        self.hits = 0
        self.queries = 0

    def counts(self) -> dict[str, int]:
        return {"hits": self.hits, "queries": self.queries} if self.queries else {}

    def logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        counts = self

        class Counted(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                stats = getattr(scheduler_stats, "prefix_cache_stats", None)
                if stats is not None:
                    counts.hits += int(stats.hits)
                    counts.queries += int(stats.queries)

            def log_engine_initialized(self) -> None:
                pass

        return Counted


def _logprobs(out: Any, gen: list[int]) -> list[float]:
    """The sampled tokens' logprobs (``logprobs=0``) of the last ``len(gen)`` steps of ``out``."""
    steps = list(out.logprobs or [])[-len(gen) :] if gen else []
    if len(steps) != len(gen):
        raise ModelError("vllm_engine: the engine returned no logprob for some generated tokens")
    return [float(step[t].logprob) for step, t in zip(steps, gen, strict=True)]


async def _abort(engine: Any, request_id: str) -> None:
    """Stop a request in the engine now (AsyncLLM also aborts one whose output stream is closed)."""
    abort = getattr(engine, "abort", None)
    if abort is not None:
        result = abort(request_id)
        if inspect.isawaitable(result):
            await result


def interrupt_problem(options: Any) -> str | None:
    if not options.return_token_ids:
        return "set return_token_ids: true (a continuation needs the token ids generated so far)"
    return None


create = VLLMEngineModel
