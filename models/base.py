"""The model adapter contract: one Responses-style generation per call.

An adapter turns ``CreateParams`` (the conversation so far and the tools) into a
``Response`` whose ``output`` holds only the new items of this call. Adapters are
plain async Python; the model worker in ``runtime/`` moves requests to them over
NATS and bounds their concurrency.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from runtime.messages import CreateParams, Response


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One entry under ``models:`` in a config.

    ``adapter`` picks the implementation; the other keys are read by the adapters
    that use them. ``api_key`` is a secret: it is never logged or printed (see
    ``runtime.config.redact``).
    """

    adapter: str = "scripted"
    model: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    api: str = "responses"  # openai adapter: "responses" or "chat"
    concurrency: int = 64
    replicas: int = 1
    timeout_s: float = 120.0
    ack_wait_s: float = 30.0  # a request whose worker went silent this long goes to another replica
    max_retries: int = 3
    retry_backoff_s: float = 0.5
    delay_s: float = 0.0  # scripted: simulated latency per call
    rollouts: str | None = None  # replay: NeMo Gym rollouts JSONL
    extra_body: dict[str, Any] = msgspec.field(default_factory=dict)

    def _shown(self) -> list[tuple[str, Any]]:
        return [
            (f, "***" if f == "api_key" and getattr(self, f) else getattr(self, f))
            for f in self.__struct_fields__
        ]

    def __repr__(self) -> str:  # the secret never reaches a log line or a traceback
        return f"ModelConfig({', '.join(f'{k}={v!r}' for k, v in self._shown())})"

    def __rich_repr__(self) -> Any:
        yield from self._shown()


class ModelError(Exception):
    """A generation failed. ``retryable`` says whether another attempt may succeed."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class ModelAdapter(Protocol):
    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        """One model call. ``rollout_key`` ({batch}:{task}:{rollout}) identifies the rollout:
        for replica affinity (prefix caches) and for replaying the right recorded repeat."""
        ...

    async def aclose(self) -> None: ...


def load_adapter(cfg: ModelConfig, *, base_dir: str | None = None) -> ModelAdapter:
    """Build the adapter a config names. ``base_dir`` resolves relative paths."""
    name = cfg.adapter
    if name == "scripted":
        from models.scripted import ScriptedModel

        return ScriptedModel(cfg)
    if name == "replay":
        from models.replay import ReplayModel

        return ReplayModel(cfg, base_dir=base_dir)
    if name in ("openai", "vllm"):
        from models.openai import OpenAIModel

        return OpenAIModel(cfg)
    raise ValueError(f"models.*.adapter: unknown adapter {name!r} (scripted, replay, openai)")
