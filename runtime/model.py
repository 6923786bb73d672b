"""The model adapter author's API: one Responses-style generation per call.

An adapter turns ``CreateParams`` (the conversation so far and the tools) into a
``Response`` whose ``output`` holds only the new items of this call. Adapters are
plain async Python; the model worker moves requests to them over the bus and
bounds their concurrency.

An adapter is a module (a plugin, like agents and resources) that defines:

* ``Options``: a ``msgspec.Struct`` subclass of ``AdapterOptions`` — the adapter's
  own config keys, validated when the config is resolved (``gym_runtime.config.resolve_config``,
  before any worker starts; loading a config imports no adapter);
* ``create(options, *, concurrency, base_dir) -> ModelAdapter``.

A config names it by a bundled name (``adapter: openai`` →
``gym_runtime.models.openai``) or by any importable module path (a user's own).
The ``models.NAME`` entry stays flat: the worker keys (``WORKER_KEYS``) belong to
``ModelConfig``, every other key to the adapter's ``Options``. Until the entry is resolved
(``resolve_model``) those keys are held as written (``WrittenOptions``), their secrets hidden by name.
"""

from __future__ import annotations

import re
import time
from types import ModuleType
from typing import Any, ClassVar, Protocol
from uuid import uuid4

import msgspec

from gym_runtime.chat import make_response
from gym_runtime.errors import UserError
from gym_runtime.messages import CreateParams, Response, Usage, assistant_message
from gym_runtime.plugins import load_plugin

__all__ = [
    "WORKER_KEYS",
    "PAUSE_MODES",
    "AdapterOptions",
    "InterruptibleAdapter",
    "Partial",
    "ModelAdapter",
    "ModelConfig",
    "WrittenOptions",
    "adapter_module",
    "check_adapter",
    "cut_response",
    "interrupt_problem",
    "interruptible",
    "load_adapter",
    "looks_secret",
    "model_config",
    "resolve_model",
    "written_model_config",
]


class ModelAdapter(Protocol):
    async def generate(self, params: CreateParams, *, rollout_key: str | None = None) -> Response:
        """One model call. ``rollout_key`` ({batch}:{task}:{rollout}) identifies the rollout:
        for replica affinity (prefix caches) and for replaying the right recorded repeat."""
        ...

    async def aclose(self) -> None: ...


class Partial(msgspec.Struct, kw_only=True):
    """What a generation stopped by ``pause(mode="interrupt")`` produced: the next ``generate_until`` with the
    same params continues from it (prompt ids + these ids as its prompt, nothing re-tokenized)."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int] = msgspec.field(default_factory=list)
    generation_log_probs: list[float] = msgspec.field(default_factory=list)
    state: Any = None  # the adapter's own (the request it continues, text so far)
    text: str = ""  # the text of the generated ids so far, where the adapter has it (a cut generation's message)


def cut_response(params: CreateParams, partial: Partial, *, model: str) -> Response:
    """A generation stopped at its rollout's deadline as a ``Response``: one assistant message of its raw text so
    far (tool calls unparsed: a half-written call is no call), ``status: "incomplete"``, carrying the ids and
    logprobs generated so far, so a failure row keeps them (``ModelResponse.cut``)."""
    message = assistant_message(partial.text)
    message.status = "incomplete"
    message.prompt_token_ids = list(partial.prompt_token_ids)
    message.generation_token_ids = list(partial.generation_token_ids)
    message.generation_log_probs = list(partial.generation_log_probs)
    prompt, gen = len(partial.prompt_token_ids), len(partial.generation_token_ids)
    return make_response(
        params,
        id=f"resp_{uuid4().hex}",
        created_at=time.time(),
        model=model or params.model or "",
        output=[message],
        status="incomplete",
        incomplete_details={"reason": "cut"},
        usage=Usage(input_tokens=prompt, output_tokens=gen, total_tokens=prompt + gen),
    )


class InterruptibleAdapter(ModelAdapter, Protocol):
    """An adapter whose generations can stop at once and continue later (``pause(mode="interrupt")``).

    Its module defines ``interrupt_problem(options) -> str | None``: why an entry with these options
    cannot be interrupted (``None``: it can), so a trainer is told before anything is paused."""

    can_interrupt: bool  # False: this instance's options do not allow it (it then only generates)

    async def generate_until(
        self, params: CreateParams, *, rollout_key: str | None, stop: Any, partial: Partial | None
    ) -> Response | Partial:
        """Generate (continuing ``partial``) until done, or until ``stop`` (an ``anyio.Event``) is set:
        then return what was generated so far as a ``Partial``, promptly."""
        ...


PAUSE_MODES = ("drain", "interrupt", "abort")


def interrupt_problem(cfg: ModelConfig) -> str | None:
    """Why generations of this (resolved) entry cannot be interrupted and continued, or None."""
    check = getattr(adapter_module(cfg.adapter), "interrupt_problem", None)
    if check is None:
        return f"adapter {cfg.adapter!r} has no token ids to continue from (pause modes: drain, abort)"
    return check(cfg.options)


def interruptible(adapter: object) -> bool:
    """Whether this adapter instance stops generations on a pause's ``stop`` (its ``can_interrupt``)."""
    return callable(getattr(adapter, "generate_until", None)) and bool(getattr(adapter, "can_interrupt", True))


async def check_adapter(adapter: object) -> str | None:
    """Why an adapter's endpoint cannot serve it (one line naming the URL), or None. An adapter may define
    ``async def check(self) -> str | None``; one without it (in process, scripted) is not checked."""
    check = getattr(adapter, "check", None)
    return await check() if check is not None else None


class AdapterOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every adapter's ``Options``: unknown keys are errors, secrets stay out of reprs.

    ``secret_fields`` name the fields shown as ``***`` (a dict's values each) in
    ``repr``, rich output and ``redacted()`` — so they never reach a log line or a traceback.
    """

    secret_fields: ClassVar[tuple[str, ...]] = ()

    def call_budget_s(self) -> float:
        """How long one ``generate`` may take, the adapter's own retries included
        (an agent waits this long, plus the worker's ``ack_wait_s``, for an answer)."""
        return 480.0

    def holds_prefix_cache(self) -> bool:
        """Whether a replica (one model worker) keeps earlier calls' prefixes in its own cache, so a rollout's
        later turns gain by returning to it (``affinity_load``): an in-process engine's. An HTTP adapter's cache is
        its endpoints', chosen by the adapter itself; a test double has none."""
        return False

    def redacted(self) -> dict[str, Any]:
        """The options as builtins with every secret replaced, safe to print."""
        return {k: _hide(v) if self._secret(k) else msgspec.to_builtins(v) for k, v in self._pairs()}

    def _secret(self, key: str) -> bool:
        return key in self.secret_fields

    def _pairs(self) -> list[tuple[str, Any]]:
        return [(f, getattr(self, f)) for f in self.__struct_fields__]

    def _shown(self) -> list[tuple[str, Any]]:
        return [(k, _hide(v) if self._secret(k) else v) for k, v in self._pairs()]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._shown())})"

    def __rich_repr__(self) -> Any:
        yield from self._shown()


# Words that make an option key a secret while no adapter has said which of its keys are
# (``api_key``, ``hf_token``, ``headers``, ``db_password``, ...): hiding too much is the safe side.
_SECRET_WORDS = frozenset(
    "key apikey token secret secrets password passwd pass credential credentials auth authorization "
    "header headers cookie cookies bearer".split()
)


def looks_secret(key: str) -> bool:
    """Whether an option key names a secret by its words (``api_key``, ``access_token``, ``headers``)."""
    return any(w in _SECRET_WORDS for w in re.split(r"[_\-.]+", key.lower()))


class WrittenOptions(AdapterOptions, kw_only=True, forbid_unknown_fields=True):
    """An adapter's keys as the config wrote them, held unparsed until ``resolve_model`` imports the adapter.

    Loading a config imports no plugin, so no adapter has said yet which keys are secret: a key that
    ``looks_secret``, or whose value came from a ``${VAR}`` (``from_env``), is hidden in ``repr`` and
    ``redacted()``. Once resolved, the adapter's own ``secret_fields`` decide, as before.
    """

    values: dict[str, Any] = msgspec.field(default_factory=dict)
    from_env: frozenset[str] = frozenset()  # keys whose value was substituted from ${VAR}
    from_set: frozenset[str] = frozenset()  # keys a --set override wrote (their errors name the --set)

    def call_budget_s(self) -> float:
        raise RuntimeError("the model entry is not resolved: call gym_runtime.config.resolve_config first")

    def _secret(self, key: str) -> bool:
        return looks_secret(key) or key in self.from_env

    def _pairs(self) -> list[tuple[str, Any]]:
        return list(self.values.items())


def _hide(value: Any) -> Any:
    if isinstance(value, dict):  # headers: the names may be shown, never the values
        return {k: "***" for k in value}
    return "***" if value else value


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One entry under ``models:``: the worker's keys plus the adapter's parsed ``options``.

    Build it from a flat config entry with ``model_config``.
    """

    adapter: str = "scripted"  # a bundled adapter's name or a module path
    concurrency: int = 64  # generations in flight per worker
    replicas: int = 1
    ack_wait_s: float = 30.0  # a request whose worker went silent this long goes to another replica
    # a rollout's later turns go first to the replica that served its last turn (its prefix cache), only while
    # that replica has a free slot at once (never a wait) and holds at most this times the mean of the caller's
    # rollouts (docs/models.md, "Cache-aware routing"); 0: no affinity. Only where the adapter's replicas hold a
    # prefix cache (``AdapterOptions.holds_prefix_cache``; ``routed_load``)
    affinity_load: float = 1.15
    options: AdapterOptions = msgspec.field(default_factory=AdapterOptions)

    def __post_init__(self) -> None:
        if self.affinity_load != 0 and self.affinity_load < 1:
            raise ValueError(f"affinity_load: {self.affinity_load!r} must be 0 (off) or at least 1 (e.g. 1.25)")

    def routed_load(self) -> float:
        """``affinity_load`` where it applies (the adapter's replicas hold a prefix cache), else 0: no routing at
        all, no subject of the replica's own, nothing per call."""
        return self.affinity_load if self.options.holds_prefix_cache() else 0.0

    def redacted(self) -> dict[str, Any]:
        """The flat config entry, secrets replaced (what ``config.redact`` prints)."""
        common = {f: getattr(self, f) for f in WORKER_KEYS}
        return {**common, **self.options.redacted()}

    def __rich_repr__(self) -> Any:
        yield from ((f, getattr(self, f)) for f in self.__struct_fields__)


WORKER_KEYS: tuple[str, ...] = tuple(f for f in ModelConfig.__struct_fields__ if f != "options")


def adapter_module(name: str) -> ModuleType:
    """The module an ``adapter:`` value names (``gym_runtime.plugins.load_plugin``'s rule).

    Raises ``UserError`` with a one-line reason when it cannot be used.
    """
    module = load_plugin("adapter", name)
    options = getattr(module, "Options", None)
    if not (isinstance(options, type) and issubclass(options, AdapterOptions)) or not callable(
        getattr(module, "create", None)
    ):
        raise UserError(f"adapter {name!r}: the module must define Options (an AdapterOptions) and create()")
    return module


def written_model_config(entry: dict[str, Any]) -> ModelConfig:
    """A flat ``models.NAME`` mapping → ``ModelConfig`` with the adapter's keys held as written (no import).

    Raises ``msgspec.ValidationError`` whose path names a worker key (``$.concurrency``).
    """
    if not isinstance(entry, dict):
        raise msgspec.ValidationError("Expected `object`, got `" + type(entry).__name__ + "`")
    common = {k: v for k, v in entry.items() if k in WORKER_KEYS}
    cfg = msgspec.convert(common, ModelConfig, strict=False)
    cfg.options = WrittenOptions(values={k: v for k, v in entry.items() if k not in WORKER_KEYS})
    return cfg


def resolve_model(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its adapter's ``Options`` parsed (the adapter module imported); as is if already parsed.

    Raises ``msgspec.ValidationError`` whose path names the key (``$.base_urll``, ``$.adapter``).
    """
    if not isinstance(cfg.options, WrittenOptions):
        return cfg
    try:
        module = adapter_module(cfg.adapter)
    except ValueError as e:
        raise msgspec.ValidationError(f"{e} - at `$.adapter`") from None
    return msgspec.structs.replace(cfg, options=msgspec.convert(cfg.options.values, module.Options, strict=False))


def model_config(entry: dict[str, Any]) -> ModelConfig:
    """A flat ``models.NAME`` mapping → ``ModelConfig`` with the adapter's ``Options`` (written, then resolved).

    Raises ``msgspec.ValidationError`` whose path names the key (``$.base_urll``).
    """
    return resolve_model(written_model_config(entry))


def load_adapter(cfg: ModelConfig, *, base_dir: str | None = None) -> ModelAdapter:
    """Build the adapter a config names. ``base_dir`` resolves relative paths."""
    cfg = resolve_model(cfg)
    module = adapter_module(cfg.adapter)
    options = cfg.options
    if not isinstance(options, module.Options):  # built by hand with the default options
        options = msgspec.convert(msgspec.to_builtins(options), module.Options)
    return module.create(options, concurrency=cfg.concurrency, base_dir=base_dir)
