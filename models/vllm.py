"""``vllm``: vLLM's OpenAI-compatible server over HTTP, training-grade.

Requests are Responses-API params converted to Chat Completions with NeMo Gym's
semantics (``gym_runtime.chat``); answers come back as Responses items. HTTP,
retries (429/5xx, bounded), the per-attempt timeout, several replicas
(least-loaded, rollout affinity, failover) and rate limits are
``models.openai_http``'s, shared with the ``openai`` adapter.

Token ids and logprobs (``return_token_ids: true``)
--------------------------------------------------
Each call's last output item carries ``prompt_token_ids``, ``generation_token_ids``
and ``generation_log_probs`` (all three or none). The request asks vLLM for
``return_token_ids`` (``prompt_token_ids`` at the top level, ``choices[0].token_ids``)
and for ``logprobs: true, top_logprobs: 0, return_tokens_as_token_ids: true`` (the
sampled tokens as ``token_id:N`` with their logprobs). Both sources of the
generated ids must agree, ``usage`` must agree with both lengths, and when the
server does not return prompt ids they come from ``/tokenize`` with the same
messages and tools; any disagreement is a ``ModelError`` — never silently picked.

Token contiguity across turns (how later turns are built)
---------------------------------------------------------
A trainer needs every call's ``prompt_token_ids`` to start with all tokens of the
rollout so far (prompt + generation of the previous call). Re-sending the previous
turns as chat messages does not give that: the chat template re-tokenizes what the
model sampled token by token and merges it differently (measured on vLLM 0.32,
``tests/compat/vllm/chat_tools_text.json``). So, once a rollout has a previous
call with token ids, the adapter sends token ids, not messages:

1. The rollout's ids so far: ``R = prompt_token_ids + generation_token_ids`` of the
   last input item that carries them (the previous call's last output item; the
   items after it — tool results, user turns — are the new messages). When the
   previous generation did not end with the turn-end token (cut by
   ``max_tokens`` or a stop string), that token is appended to ``R``: the chat
   template closes every assistant turn with it.
2. **The template's ids for the new messages**: ``POST /tokenize`` with the whole
   conversation as chat messages (tools, ``chat_template_kwargs``,
   ``add_generation_prompt: true``) — the server's own template and tokenizer, so
   exactly what ``/v1/chat/completions`` would have rendered. In that rendering
   the previous assistant turn ends at the *k*-th turn-end token, where *k* is the
   number of turn-end tokens in ``R`` (each message of the chat template ends with
   one; what the template did to earlier turns — re-tokenized tool calls, dropped
   reasoning — changes their ids, never their count). Every id after that token is
   the template's rendering of the new messages plus the generation prompt (for
   ChatML: ``\\n<|im_start|>user\\n<tool_response>...<|im_end|>\\n<|im_start|>assistant\\n``).
3. ``POST /v1/completions`` with ``prompt = R + those ids`` (a token-id prompt) and the
   same sampling parameters. The prompt starts with ``R`` by construction; vLLM's
   ``choices[0].prompt_token_ids`` must equal what was sent. This reproduces
   ``tests/compat/vllm/completions_token_in_turn2.json`` exactly.

The turn-end token is ``eos_token_id`` from the config, else found once from the
template: ``/tokenize`` of ``[user, assistant "ok"]`` without a generation prompt —
the token right after the assistant's content.

``/v1/completions`` runs no server-side parsers, so on that path the text is parsed
here: Hermes tool calls (``tool_call_parser: hermes``, vLLM's ``hermes`` semantics)
and ``<think>`` reasoning (also when the template opened ``<think>`` itself);
``tool_choice`` required / named become ``structured_outputs`` as vLLM does for chat.
The first call of a rollout uses ``/v1/chat/completions`` (server-side parsers).

Failures that are not errors: a context-length or max-tokens 400 (also a token-id
prompt that no longer fits, checked against ``/tokenize``'s ``max_model_len``)
becomes an ``incomplete`` response with an empty message, as NeMo Gym does.
"""

from __future__ import annotations

import time
from typing import Any
from uuid import uuid4

import anyio
import msgspec

from gym_runtime.chat import (
    INCOMPLETE_REASONS,
    THINK_RE,
    build_chat_body,
    chat_completion_to_response,
    chat_message_to_items,
    incomplete_response,
    make_response,
    usage_from_chat,
)
from gym_runtime.errors import ModelError
from gym_runtime.messages import CreateParams, Response
from gym_runtime.model import Partial
from gym_runtime.models.openai import make_pool
from gym_runtime.models.openai_http import (
    ContextOverflow,
    Endpoint,
    HTTPOptions,
    HTTPStatusError,
    PooledModel,
    base_urls,
    is_context_overflow,
    post_object,
)
from gym_runtime.models.tokens import (
    TOKEN_FIELDS,
    find_end_token,
    last_token_turn,
    message_from_raw_text,
    parse_hermes_tool_calls,
    splice_prompt,
    tool_choice_structured_outputs,
)
from gym_runtime.observability import logs

__all__ = [
    "Options",
    "VLLMModel",
    "create",
    "interrupt_problem",
    "token_fields_from_chat",
    "token_fields_from_completion",
]

log = logs.get("gym.models.vllm")

# ``adapter: vllm`` keys: the HTTP ones (``base_url``, ``api_key``, ...), the token ones, and
# ``interruptible`` (every call streams over /v1/completions, so ``pause(mode="interrupt")`` can stop it).
Options = msgspec.defstruct(
    "Options",
    [*TOKEN_FIELDS, ("interruptible", bool, False)],
    bases=(HTTPOptions,),
    module=__name__,
    kw_only=True,
    forbid_unknown_fields=True,
)


def interrupt_problem(options: Any) -> str | None:
    """Why calls with these options cannot be interrupted and continued (``Client.pause`` asks first)."""
    if not options.return_token_ids:
        return "set return_token_ids: true (a continuation needs the token ids generated so far)"
    if not options.interruptible:
        return "set interruptible: true (calls then stream over /v1/completions, so a pause can stop them)"
    return None


TOKEN_FLAGS = {"logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}
# Chat-only request keys that /v1/completions does not take.
_CHAT_ONLY = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "reasoning_effort",
        "logprobs",
        "top_logprobs",
        "documents",
        "mm_processor_kwargs",
        "include_reasoning",
        "n",
    }
)
_TOKENIZE_KEYS = ("model", "messages", "tools", "chat_template_kwargs", "chat_template", "mm_processor_kwargs")


def _token_id(token: Any, where: str) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise ModelError(
            f"{where}: logprob token {token!r} is not 'token_id:N' (does the server honour return_tokens_as_token_ids?)"
        )
    try:
        return int(token[9:])
    except ValueError:
        raise ModelError(f"{where}: logprob token {token!r} is not 'token_id:N'") from None


def _check_usage(data: dict[str, Any], prompt: list[int], gen: list[int], where: str) -> None:
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(p, int) and p != len(prompt):
        raise ModelError(f"{where}: usage.prompt_tokens={p} disagrees with {len(prompt)} prompt token ids")
    if isinstance(c, int) and c != len(gen):
        raise ModelError(f"{where}: usage.completion_tokens={c} disagrees with {len(gen)} generated token ids")


def token_fields_from_chat(data: dict[str, Any], prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """The three training fields from a chat completion (``prompt_ids`` from /tokenize if the
    server sent none). Generated ids from ``token_ids`` and from the logprobs must agree."""
    choice = data["choices"][0]
    block = choice.get("logprobs")
    if not isinstance(block, dict) or not isinstance(block.get("content"), list):
        raise ModelError("chat completion has no logprobs although they were requested (logprobs=true)")
    lp_ids = [_token_id(e.get("token"), "chat completion") for e in block["content"]]
    lps = [float(e["logprob"]) for e in block["content"]]
    gen = choice.get("token_ids")
    prompt = data.get("prompt_token_ids")
    if gen is not None and gen != lp_ids:
        raise ModelError("chat completion: choices[0].token_ids disagree with the logprob tokens")
    if prompt is None:
        prompt = prompt_ids
    elif prompt_ids is not None and prompt_ids != prompt:
        raise ModelError("chat completion: prompt_token_ids disagree with /tokenize of the same messages")
    if prompt is None:
        raise ModelError("chat completion has no prompt_token_ids")
    gen = lp_ids if gen is None else gen
    _check_usage(data, prompt, gen, "chat completion")
    return {"prompt_token_ids": list(prompt), "generation_token_ids": list(gen), "generation_log_probs": lps}


def token_fields_from_completion(data: dict[str, Any], sent_prompt: list[int]) -> dict[str, Any]:
    """The three training fields from a /v1/completions answer to a token-id prompt."""
    choice = data["choices"][0]
    block = choice.get("logprobs")
    if not isinstance(block, dict) or not isinstance(block.get("tokens"), list):
        raise ModelError("completion has no logprobs although they were requested (logprobs=0)")
    lp_ids = [_token_id(t, "completion") for t in block["tokens"]]
    lps = [float(x) for x in block.get("token_logprobs") or []]
    if len(lps) != len(lp_ids):
        raise ModelError("completion: logprobs.tokens and logprobs.token_logprobs differ in length")
    gen = choice.get("token_ids")
    if gen is not None and gen != lp_ids:
        raise ModelError("completion: choices[0].token_ids disagree with the logprob tokens")
    prompt = choice.get("prompt_token_ids")
    if prompt is not None and prompt != sent_prompt:
        raise ModelError("completion: the server's prompt_token_ids differ from the token-id prompt sent")
    gen = lp_ids if gen is None else gen
    _check_usage(data, sent_prompt, gen, "completion")
    return {"prompt_token_ids": list(sent_prompt), "generation_token_ids": list(gen), "generation_log_probs": lps}


def _stream_tokens(choice: dict[str, Any], sent: list[int]) -> tuple[list[int], list[float]]:
    """One streamed completion chunk's token ids and logprobs (the two sources of ids must agree)."""
    prompt = choice.get("prompt_token_ids")
    if prompt is not None and list(prompt) != sent:
        raise ModelError("completion stream: the server's prompt_token_ids differ from the token-id prompt sent")
    block = choice.get("logprobs") or {}
    lp_ids = [_token_id(t, "completion stream") for t in block.get("tokens") or ()]
    lps = [float(x) for x in block.get("token_logprobs") or ()]
    if len(lps) != len(lp_ids):
        raise ModelError("completion stream: logprobs.tokens and logprobs.token_logprobs differ in length")
    gen = choice.get("token_ids")
    if gen is not None and list(gen) != lp_ids:
        raise ModelError("completion stream: choices[0].token_ids disagree with the logprob tokens")
    return lp_ids, lps


def _attach(resp: Response, fields: dict[str, Any]) -> Response:
    last = resp.output[-1]
    for k, v in fields.items():
        setattr(last, k, v)
    return resp


def _think_to_reasoning_field(messages: list[dict[str, Any]]) -> None:
    """With a server-side reasoning parser, history reasoning goes in ``reasoning`` (NeMo Gym)."""
    for m in messages:
        content = m.get("content")
        if m.get("role") != "assistant" or not isinstance(content, str) or "<think>" not in content:
            continue
        spans = THINK_RE.findall(content)
        m["content"] = THINK_RE.sub("", content)  # "" when only reasoning is left, as NeMo Gym sends it
        if spans:
            m["reasoning"] = m["reasoning_content"] = spans[0]


class VLLMModel(PooledModel):
    """Generation through one or more vLLM OpenAI-compatible servers (see the module doc)."""

    def __init__(self, cfg: Any, *, concurrency: int = 64, base_dir: str | None = None) -> None:
        if not base_urls(cfg):
            raise ValueError("vllm adapter: base_url is required (one URL or a list of replicas)")
        self.cfg = cfg
        self._model = cfg.model
        self.pool = make_pool(cfg, concurrency=concurrency)
        self._eos: int | None = cfg.eos_token_id

    def __repr__(self) -> str:
        urls = ", ".join(ep.url for ep in self.pool.endpoints)
        return f"VLLMModel(base_url={urls!r}, model={self._model!r}, return_token_ids={self.cfg.return_token_ids})"

    # ------------------------------------------------------------------ requests

    def chat_body(self, params: CreateParams) -> dict[str, Any]:
        body = build_chat_body(params, model=self._model or params.model)
        if self.cfg.chat_template_kwargs:
            body["chat_template_kwargs"] = {**self.cfg.chat_template_kwargs, **(body.get("chat_template_kwargs") or {})}
        if self.cfg.reasoning_parser:
            _think_to_reasoning_field(body["messages"])
        if self.cfg.extra_body:
            body.update(self.cfg.extra_body)
        if self.cfg.return_token_ids:
            if body.get("n") not in (None, 1):
                raise ModelError("return_token_ids needs n=1 (one generation per call)")
            body.update(TOKEN_FLAGS)
        return body

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        body = self.chat_body(params)
        prev = last_token_turn(params.input) if self.cfg.return_token_ids and self.cfg.token_in else None
        try:
            if prev is None:
                return await self.pool.run(
                    lambda ep: self._chat(ep, body, params), rollout_key=rollout_key, what="/chat/completions"
                )
            return await self.pool.run(
                lambda ep: self._token_in(ep, body, params, prev), rollout_key=rollout_key, what="/completions"
            )
        except ContextOverflow as e:
            log.info("model.context_overflow", model=self._model, detail=str(e)[:200])
            return incomplete_response(params, model=self._model or params.model or "")

    _post = staticmethod(post_object)

    def _tokenize_body(self, body: dict[str, Any], *, add_generation_prompt: bool = True) -> dict[str, Any]:
        out = {k: body[k] for k in _TOKENIZE_KEYS if k in body}
        out["add_generation_prompt"] = add_generation_prompt
        return out

    # ------------------------------------------------------------- first turn: chat

    async def _chat(self, ep: Endpoint, body: dict[str, Any], params: CreateParams) -> Response:
        data = await self._post(ep, "/chat/completions", body)
        if not data.get("choices"):
            raise ModelError("chat completion has no choices", retryable=True)
        resp = chat_completion_to_response(data, params)
        if self.cfg.return_token_ids:
            prompt_ids = None
            if data.get("prompt_token_ids") is None:  # an older server: ask the tokenizer
                tok = await self._post(ep, "/tokenize", self._tokenize_body(body), root=True)
                prompt_ids = tok.get("tokens")
            _attach(resp, token_fields_from_chat(data, prompt_ids))
        return resp

    # --------------------------------------------------- later turns: token ids in

    async def end_token(self, ep: Endpoint) -> int:
        """The token that ends an assistant turn in the chat template (cached)."""
        if self._eos is not None:
            return self._eos
        model = {"model": self._model} if self._model else {}
        user = {"role": "user", "content": "hi"}
        head = await self._post(
            ep, "/tokenize", {**model, "messages": [user], "add_generation_prompt": True}, root=True
        )
        turn = await self._post(
            ep,
            "/tokenize",
            {**model, "messages": [user, {"role": "assistant", "content": "ok"}], "add_generation_prompt": False},
            root=True,
        )
        word = await self._post(ep, "/tokenize", {**model, "prompt": "ok", "add_special_tokens": False}, root=True)
        found = find_end_token(head.get("tokens") or [], turn.get("tokens") or [], word.get("tokens") or [])
        if found is not None:
            self._eos = found
            log.info("model.end_token", token=found)
            return found
        raise ModelError(
            "cannot find the chat template's turn-end token from /tokenize; set eos_token_id in the model config"
        )

    def _completion_body(self, body: dict[str, Any], params: CreateParams, prompt: list[int]) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
        out["prompt"] = prompt
        out.update(logprobs=0, return_tokens_as_token_ids=True, return_token_ids=True)
        guided = tool_choice_structured_outputs(body)
        if guided is not None:
            out["structured_outputs"] = guided
        return out

    def _message_from_text(self, text: str, body: dict[str, Any]) -> dict[str, Any]:
        name = self.cfg.tool_call_parser
        if name not in (None, "hermes", "none"):
            raise ModelError(f"tool_call_parser {name!r} is not supported on the token-in path (hermes)")
        return message_from_raw_text(text, body, parse_tools=parse_hermes_tool_calls if name == "hermes" else None)

    async def _prompt_ids(
        self, ep: Endpoint, body: dict[str, Any], params: CreateParams, prev: int | None
    ) -> list[int]:
        """The call's prompt as token ids: the chat template's (``/tokenize``), spliced after the rollout's
        ids so far when a previous call has them (``prev``)."""
        tok = await self._post(ep, "/tokenize", self._tokenize_body(body), root=True)
        prompt = list(tok.get("tokens") or [])
        if prev is not None:
            item = params.input[prev]
            rollout = list(item.prompt_token_ids) + list(item.generation_token_ids)  # type: ignore[union-attr,arg-type]
            prompt = splice_prompt(rollout, prompt, await self.end_token(ep))
        max_len = tok.get("max_model_len")
        if isinstance(max_len, int) and len(prompt) >= max_len:
            raise ContextOverflow(f"token-in prompt of {len(prompt)} tokens fills the context ({max_len})")
        return prompt

    async def _token_in(self, ep: Endpoint, body: dict[str, Any], params: CreateParams, prev: int) -> Response:
        prompt = await self._prompt_ids(ep, body, params, prev)
        cbody = self._completion_body(body, params, prompt)
        data = await self._post(ep, "/completions", cbody)
        choices = data.get("choices") or []
        if not choices:
            raise ModelError("completion has no choices", retryable=True)
        choice = choices[0]
        fields = token_fields_from_completion(data, prompt)
        output = chat_message_to_items(self._message_from_text(choice.get("text") or "", body))
        reason = INCOMPLETE_REASONS.get(choice.get("finish_reason") or "")
        resp = make_response(
            params,
            id=f"resp_{uuid4().hex}",
            created_at=float(data.get("created") or time.time()),
            model=str(data.get("model") or self._model or params.model or ""),
            output=output,
            status="incomplete" if reason else "completed",
            incomplete_details={"reason": reason} if reason else None,
            usage=usage_from_chat(data.get("usage")),
        )
        return _attach(resp, fields)

    # ------------------------------------------------- interruptible: streamed, continued

    @property
    def can_interrupt(self) -> bool:
        return interrupt_problem(self.cfg) is None

    async def generate_until(
        self, params: CreateParams, *, rollout_key: str | None, stop: Any, partial: Partial | None
    ) -> Response | Partial:
        """Stream the call over ``/v1/completions`` (a token-id prompt); when ``stop`` is set, close the stream
        and return the ids and logprobs so far. Continuing ``partial`` sends its prompt ids + generated ids
        as the prompt, so nothing is re-tokenized and the ids stay contiguous."""
        if not self.can_interrupt:
            return await self.generate(params, rollout_key=rollout_key)
        body = self.chat_body(params)
        try:
            return await self.pool.run(
                lambda ep: self._stream(ep, body, params, stop, partial),
                rollout_key=rollout_key,
                what="/completions (stream)",
            )
        except ContextOverflow as e:
            log.info("model.context_overflow", model=self._model, detail=str(e)[:200])
            return incomplete_response(params, model=self._model or params.model or "")

    async def _stream(
        self, ep: Endpoint, body: dict[str, Any], params: CreateParams, stop: Any, partial: Partial | None
    ) -> Response | Partial:
        if partial is None:
            prev = last_token_turn(params.input) if self.cfg.token_in else None
            prompt = await self._prompt_ids(ep, body, params, prev)
            partial = Partial(prompt_token_ids=prompt, state={"text": "", "tries": 0})
        prompt = partial.prompt_token_ids
        ids, lps = list(partial.generation_token_ids), list(partial.generation_log_probs)
        # no state: a generation another worker made (a checkpoint's), continued here as an interrupted one is
        state = dict(partial.state or {"text": partial.text, "tries": 1 if ids else 0})
        text = [str(state.get("text") or "")]
        if stop.is_set():
            return partial
        sent = prompt + ids
        cbody = self._completion_body(body, params, sent)
        cbody["stream"] = True
        asked = cbody.get("max_tokens")
        if isinstance(asked, int) and ids:
            cbody["max_tokens"] = asked - len(ids)
        finish: str | None = None
        created, model = time.time(), self._model or params.model or ""
        if isinstance(asked, int) and asked - len(ids) < 1:
            finish = "length"
        else:
            failed: Exception | None = None  # raised below the task group, so the pool's retry loop sees it
            async with anyio.create_task_group() as tg:  # as itself, not wrapped in an ExceptionGroup

                async def watch() -> None:
                    await stop.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    async for event in ep.stream("/completions", cbody):
                        created, model = float(event.get("created") or created), str(event.get("model") or model)
                        for choice in event.get("choices") or ():
                            new_ids, new_lps = _stream_tokens(choice, sent)
                            ids += new_ids  # no await between these two: a stop keeps them in step
                            lps += new_lps
                            text.append(choice.get("text") or "")
                            finish = choice.get("finish_reason") or finish
                except HTTPStatusError as e:
                    failed = ContextOverflow(str(e.message)) if is_context_overflow(e, cbody) else e
                except Exception as e:
                    failed = e
                tg.cancel_scope.cancel()
            if failed is not None:
                raise failed
        state["tries"] = int(state.get("tries") or 0) + 1
        if finish is None:
            if stop.is_set():
                state["text"] = "".join(text)
                return Partial(
                    prompt_token_ids=prompt,
                    generation_token_ids=ids,
                    generation_log_probs=lps,
                    state=state,
                    text=state["text"],
                )
            raise ModelError("completion stream ended without a finish_reason", retryable=True)
        full = "".join(text)
        if state["tries"] > 1:  # continued: decode all ids at once (a character may straddle the cut)
            full = await self._detokenize(ep, ids, finish)
        output = chat_message_to_items(self._message_from_text(full, body))
        reason = INCOMPLETE_REASONS.get(finish)
        resp = make_response(
            params,
            id=f"resp_{uuid4().hex}",
            created_at=created,
            model=model,
            output=output,
            status="incomplete" if reason else "completed",
            incomplete_details={"reason": reason} if reason else None,
            usage=usage_from_chat(
                {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
            ),
        )
        return _attach(resp, {"prompt_token_ids": prompt, "generation_token_ids": ids, "generation_log_probs": lps})

    async def _detokenize(self, ep: Endpoint, ids: list[int], finish: str) -> str:
        if finish == "stop" and ids and ids[-1] == await self.end_token(ep):
            ids = ids[:-1]  # the end token is not text (the streamed text leaves it out too)
        model = {"model": self._model} if self._model else {}
        data = await self._post(ep, "/detokenize", {**model, "tokens": ids}, root=True)
        return str(data.get("prompt") or "")


create = VLLMModel
