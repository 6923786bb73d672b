"""``openai``: any OpenAI-compatible endpoint — OpenAI, Azure OpenAI, vLLM — Responses or Chat.

``api == "responses"`` posts the Responses request as is (hosted models are
Responses-native); ``api == "chat"`` converts it to Chat Completions and the
completion back to Responses items with NeMo Gym's semantics (``gym_runtime.chat``).

Hosted APIs:

* OpenAI: ``base_url`` unset (api.openai.com), key from ``api_key`` or
  ``OPENAI_API_KEY``.
* Azure OpenAI: ``provider: azure``, ``base_url: https://NAME.openai.azure.com``,
  ``api_version`` (or ``OPENAI_API_VERSION``), ``azure_deployment`` (else the
  deployment is the ``model``), key from ``api_key`` or ``AZURE_OPENAI_API_KEY``.
  An Azure ``.../openai/v1`` base URL also works with the plain ``openai`` provider.

Retries, timeouts, several ``base_url`` replicas and rate-limit aware
concurrency (429 → the window halves and new calls pause until ``Retry-After``;
``x-ratelimit-remaining-*: 0`` pauses until the reset) are ``models.openai_http``'s,
shared with the ``vllm`` adapter. A 400 that says the context is full becomes an
``incomplete`` response with an empty assistant message (NeMo Gym's behaviour).

The API key is never logged and is scrubbed from every error message.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Literal
from uuid import uuid4

import msgspec

from gym_runtime.chat import (
    NEVER_FORWARD,
    build_chat_body,
    chat_completion_to_response,
    chat_message_to_items,
    incomplete_response,
    make_response,
    responses_to_chat_messages,
    responses_tools_to_chat,
    split_think,
)
from gym_runtime.errors import ModelError
from gym_runtime.messages import (
    TRAINING_FIELDS,
    CreateParams,
    FunctionCall,
    Item,
    Message,
    Reasoning,
    Response,
    Usage,
)
from gym_runtime.models.openai_http import (
    ContextOverflow,
    Endpoint,
    EndpointPool,
    HTTPOptions,
    PlainHTTP,
    PooledModel,
    base_urls,
    post_object,
)
from gym_runtime.observability import logs

if TYPE_CHECKING:
    import openai

__all__ = [
    "OpenAIModel",
    "Options",
    "build_chat_body",
    "build_responses_body",
    "chat_completion_to_response",
    "chat_message_to_items",
    "create",
    "make_client",
    "responses_json_to_response",
    "responses_to_chat_messages",
    "responses_tools_to_chat",
    "split_think",
]

log = logs.get("gym.models.openai")
_NEVER_FORWARD = NEVER_FORWARD


# ================================================================= Responses API

_OUTPUT_TYPES: dict[str, type] = {
    "message": Message,
    "function_call": FunctionCall,
    "reasoning": Reasoning,
}


def build_responses_body(
    params: CreateParams, *, model: str | None, extra_body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The Responses ``create`` body: params as given; items lose nulls and training fields."""
    items = [
        {k: v for k, v in d.items() if v is not None and k not in TRAINING_FIELDS and k != "policy_version"}
        for d in msgspec.to_builtins(params.input)
    ]
    for d in items:
        kind = d.get("type")
        if kind == "message":
            d.setdefault("content", "")  # omit_defaults drops an empty content
        elif kind == "reasoning":
            d.setdefault("summary", [])
    body: dict[str, Any] = {"input": items}
    if model:
        body["model"] = model
    for key in ("instructions", "temperature", "top_p", "max_output_tokens", "tool_choice", "parallel_tool_calls"):
        value = getattr(params, key)
        if value is not None:
            body[key] = value
    if params.tools:
        body["tools"] = params.tools
    for k, v in (params.extra or {}).items():
        if v is not None and k not in body and k not in _NEVER_FORWARD:
            body[k] = v
    if extra_body:
        body.update(extra_body)
    return body


def _no_nones(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def responses_json_to_response(data: dict[str, Any], params: CreateParams) -> Response:
    """A Responses-API ``response`` JSON body → our ``Response``.

    Output items of types other than message / function_call / reasoning (e.g.
    ``web_search_call``) raise ``ModelError`` naming the type: the runtime's agents
    cannot act on them, and dropping them silently would corrupt the trajectory.
    """
    if data.get("status") == "failed":
        err = data.get("error") or {}
        raise ModelError(
            f"response failed: {err.get('code')}: {err.get('message')}",
            retryable=err.get("code") == "server_error",
        )
    output: list[Item] = []
    for i, d in enumerate(data.get("output") or []):
        kind = d.get("type") if isinstance(d, dict) else None
        cls = _OUTPUT_TYPES.get(kind)  # type: ignore[arg-type]
        if cls is None:
            raise ModelError(
                f"responses API returned output[{i}] of type {kind!r}; the runtime handles"
                " message, function_call and reasoning items only"
            )
        try:
            output.append(msgspec.convert(_no_nones(d), cls))
        except msgspec.ValidationError as e:
            raise ModelError(f"responses API output[{i}] ({kind}): {e}") from None
    usage = None
    if isinstance(data.get("usage"), dict):
        try:
            usage = msgspec.convert(_no_nones(data["usage"]), Usage)
        except msgspec.ValidationError:
            usage = None
    return make_response(
        params,
        id=str(data.get("id") or f"resp_{uuid4().hex}"),
        created_at=float(data.get("created_at") or time.time()),
        model=str(data.get("model") or params.model or ""),
        output=output,
        status=data.get("status") or "completed",
        incomplete_details=data.get("incomplete_details"),
        usage=usage,
    )


# ==================================================================== the adapter


class Options(HTTPOptions, kw_only=True, forbid_unknown_fields=True):
    """``adapter: openai`` keys (besides the HTTP ones: ``base_url``, ``api_key``, ...)."""

    api: Literal["responses", "chat"] = "responses"
    # Hosted providers. provider "azure": base_url is the resource endpoint
    # (https://NAME.openai.azure.com), with api_version and azure_deployment.
    provider: Literal["openai", "azure"] = "openai"
    api_version: str | None = None
    azure_deployment: str | None = None


def _provider(cfg: HTTPOptions) -> str:
    return cfg.provider if isinstance(cfg, Options) else "openai"


def api_key_of(cfg: HTTPOptions) -> str:
    azure = _provider(cfg) == "azure"
    env = "AZURE_OPENAI_API_KEY" if azure else "OPENAI_API_KEY"
    key = cfg.api_key or os.environ.get(env) or (os.environ.get("OPENAI_API_KEY") if azure else None)
    if key:
        return key
    if cfg.base_url and not azure:
        return "EMPTY"  # local OpenAI-compatible servers (vLLM) accept any key
    raise ValueError(f"no API key (set api_key in the model config or {env})")


def make_client(cfg: HTTPOptions, url: str | None, key: str) -> openai.AsyncOpenAI:
    """One client per hosted endpoint (OpenAI, Azure); its own retries off (the pool retries). The
    ``openai`` package is imported here, not with the module: a self-hosted ``base_url`` never needs it."""
    import openai

    common: dict[str, Any] = dict(
        api_key=key, timeout=cfg.timeout_s, max_retries=0, default_headers=cfg.headers or None
    )
    provider = _provider(cfg)
    if isinstance(cfg, Options) and provider == "azure":
        if not url:
            raise ValueError("provider azure: base_url must be the resource endpoint (https://NAME.openai.azure.com)")
        version = cfg.api_version or os.environ.get("OPENAI_API_VERSION")
        if not version:
            raise ValueError("provider azure: set api_version (or OPENAI_API_VERSION)")
        return openai.AsyncAzureOpenAI(
            azure_endpoint=url,
            azure_deployment=cfg.azure_deployment or cfg.model,
            api_version=version,
            **common,
        )
    if provider != "openai":
        raise ValueError(f"models.*.provider: {provider!r} is not 'openai' or 'azure'")
    return openai.AsyncOpenAI(base_url=url or None, **common)


def make_pool(cfg: HTTPOptions, *, concurrency: int) -> EndpointPool:
    """The endpoints of ``cfg.base_url``, each allowing ``concurrency`` requests in flight.

    A self-hosted ``base_url`` with the ``openai`` provider (vLLM, any
    OpenAI-compatible server with bearer auth) is called through plain HTTP
    (``openai_http.PlainHTTP``); hosted OpenAI and Azure through the OpenAI client.
    """
    key = api_key_of(cfg)
    urls: list[str | None] = list(base_urls(cfg)) or [None]
    endpoints = []
    for url in urls:
        headers = dict(cfg.headers)
        if url and _provider(cfg) == "openai":
            http = PlainHTTP(url, limit=concurrency + 8, timeout_s=cfg.timeout_s)
            headers["Authorization"] = f"Bearer {key}"
            endpoints.append(Endpoint(url, None, concurrency, http=http, headers=headers))
        else:
            client = make_client(cfg, url, key)
            endpoints.append(Endpoint(url or str(client.base_url), client, concurrency, headers=headers))
    return EndpointPool(cfg, endpoints, secret=key)


class OpenAIModel(PooledModel):
    """Generation through an OpenAI-compatible HTTP endpoint (OpenAI, Azure, vLLM, ...).

    ``cfg.model`` names the served model (it overrides ``params.model``);
    ``cfg.extra_body`` is merged into every request body; ``cfg.timeout_s`` bounds
    each attempt. A 400 that says the context is full (``context length``, or
    vLLM's ``max_tokens must be at least 1`` when the prompt fills the context)
    yields an ``incomplete`` response with an empty assistant message instead of an
    error, as NeMo Gym's vLLM server does, so the rollout ends and is verified.
    """

    def __init__(self, cfg: Options, *, concurrency: int = 64, base_dir: str | None = None) -> None:
        if cfg.api not in ("responses", "chat"):
            raise ValueError(f"models.*.api: {cfg.api!r} is not 'responses' or 'chat'")
        self.cfg = cfg
        self._model = cfg.model
        self._path = "/responses" if cfg.api == "responses" else "/chat/completions"
        self.pool = make_pool(cfg, concurrency=concurrency)
        self._where = ", ".join(ep.url for ep in self.pool.endpoints)

    def __repr__(self) -> str:
        return f"OpenAIModel(base_url={self._where!r}, api={self.cfg.api!r}, model={self._model!r})"

    def _body(self, params: CreateParams) -> dict[str, Any]:
        model = self._model or params.model
        if self.cfg.api == "chat":
            return build_chat_body(params, model=model, extra_body=self.cfg.extra_body)
        return build_responses_body(params, model=model, extra_body=self.cfg.extra_body)

    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        body = self._body(params)

        async def attempt(ep: Endpoint) -> Any:
            return await post_object(ep, self._path, body)

        try:
            data = await self.pool.run(attempt, rollout_key=rollout_key, what=self._path)
        except ContextOverflow:
            log.info("model.context_overflow", endpoint=self._where, path=self._path)
            return incomplete_response(params, model=self._model or params.model or "")
        if self.cfg.api == "chat":
            return chat_completion_to_response(data, params)
        return responses_json_to_response(data, params)


create = OpenAIModel
