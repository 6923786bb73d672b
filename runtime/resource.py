"""The environment author's API: a ``Resource`` class with tools, ``seed`` and ``verify``.

An instance of a Resource *is* one session (an actor): ``seed`` sets its state,
tool methods read and change it, ``verify`` scores the finished response. The
runtime creates one instance per rollout on whichever worker took the seed, and
routes every later call of that rollout to that worker. Authors never see NATS.

Tool arguments are described by the method's type hints: the runtime builds a
msgspec Struct from the signature, so the JSON schema offered to models and the
validation of the model's arguments come from the same place.

Argument semantics (``tool_arguments`` on the Resource class, or
``@tool(arguments=...)`` for one tool; the schema offered to the model is the
same either way):

* ``"strict"`` (the default for new environments): the arguments must match the
  schema exactly: unknown keys, wrong types (``"5"`` for an int) and missing
  required fields are refused with a reason the model reads.
* ``"nemo_gym"``: what a NeMo Gym resources server does, because its tool
  arguments are pydantic models (v2, default config) validated by FastAPI:
  unknown keys are **ignored**; types are coerced in pydantic's lax mode
  (``"5"``/``5.0`` → int 5, ``"true"``/``"yes"``/``1`` → True, int → float, but
  never int → str); missing optional arguments take their defaults; a missing
  required argument, ``null`` for a non-optional one or a non-object is refused.
  The arguments are validated by a pydantic model built from the same
  signature, so the semantics are pydantic's by construction. (A refused call
  reads ``Error: arguments do not match ...`` with pydantic's reasons, where
  NeMo Gym's model would read FastAPI's 422 body.) Every bundled
  environment that mirrors a NeMo Gym server turns this on, since NeMo Gym's
  recorded rewards can depend on it (a call with an extra key succeeds there).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import threading
from collections.abc import Callable, Coroutine, Generator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, TypeVar, Unpack, get_type_hints

import msgspec

from gym_runtime.errors import Failure, UserError
from gym_runtime.messages import CreateParams, FunctionCall, Response
from gym_runtime.plugins import load_plugin
from gym_runtime.sandboxes.spec import SandboxAsk

_TOOL_MARK = "__gym_tool__"

# The runtime's own session operations (``gym.reset``, ``gym.step``, ``nemo_gym.http``) are named under these;
# they travel as operations (``Session.operate``), never as a model's tool call, and no tool may be named so.
OPERATION_PREFIXES = ("gym.", "nemo_gym.")

ArgumentMode = Literal["strict", "nemo_gym"]
ARGUMENT_MODES: tuple[str, ...] = ("strict", "nemo_gym")

T = TypeVar("T")


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str = "",
    arguments: ArgumentMode | None = None,
):
    """Mark an async method of a Resource as a tool the model may call.

    ``arguments`` overrides the class's ``tool_arguments`` for this tool (see the module docstring).
    """
    if arguments is not None and arguments not in ARGUMENT_MODES:
        raise UserError(f"tool arguments mode must be one of {ARGUMENT_MODES}, not {arguments!r}")

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, _TOOL_MARK, (name or f.__name__, description or (inspect.getdoc(f) or ""), arguments))
        return f

    return mark(fn) if fn is not None else mark


class Verdict(msgspec.Struct, kw_only=True):
    """What ``verify`` returns when it has more to say than the reward.

    ``fields`` become top-level fields of the rollout row (NeMo Gym's verifier
    extras, e.g. ``accuracy`` or ``extracted_answer``).
    """

    reward: float
    fields: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolArgumentsError(ValueError):
    """The model's arguments do not fit the tool; the text is fed back to the model."""


def _json_loads(text: str | bytes) -> Any:
    """``json.loads(text)``, in one C call where msgspec reads it: msgspec refuses all that it reads otherwise
    (``NaN``, ``1e400``, a lone surrogate, a BOM, UTF-16), and those go to ``json.loads`` for its answer or error."""
    try:
        return msgspec.json.decode(text)
    except Exception:
        return json.loads(text)


def decode_arguments(name: str, arguments: str | bytes) -> dict[str, Any]:
    """A tool call's arguments as the JSON object NeMo Gym's servers read (``json.loads``; blank: ``{}``), or a
    ``ToolArgumentsError`` naming the tool: for a ``call_tool`` of an author's own and ``@tool``'s lenient mode."""
    try:
        raw = _json_loads(arguments) if arguments.strip() else {}
    except ValueError as e:
        raise ToolArgumentsError(f"arguments for {name!r} are not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ToolArgumentsError(f"arguments of {name!r} must be a JSON object, not {type(raw).__name__}")
    return raw


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    method_name: str
    args_type: type[msgspec.Struct]
    # "nemo_gym": a pydantic model of the same signature validates (see the module docstring). It is built on
    # first use (``lenient()``, once): a process that only reads a class's tools (``publish`` checking rows)
    # never imports pydantic; a resource worker builds every one at its start (``Resource.build_validators``).
    mode: ArgumentMode = "strict"
    lenient: Callable[[], Any] | None = None

    def schema(self) -> dict[str, Any]:
        """The Responses-API function tool definition for this tool."""
        (_, defs) = msgspec.json.schema_components([self.args_type])
        params = dict(defs[self.args_type.__name__])
        params.pop("title", None)
        params.setdefault("properties", {})
        params.setdefault("required", [])
        params["additionalProperties"] = False
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": params,
            "strict": True,
        }

    def parse(self, arguments: str | bytes, *, mode: ArgumentMode | None = None) -> dict[str, Any]:
        """Decode and validate the model's JSON arguments, or raise with a readable reason.

        ``mode`` overrides the tool's own (e.g. a verifier that reads arguments as NeMo Gym's
        ``json.loads`` does, with no coercion, asks for ``"strict"``).
        """
        if isinstance(arguments, str):
            arguments = arguments.encode()
        if not arguments.strip():
            arguments = b"{}"
        if (mode or self.mode) == "nemo_gym":
            return self._parse_lenient(arguments)
        try:
            args = msgspec.json.decode(arguments, type=self.args_type)
        except msgspec.ValidationError as e:
            raise ToolArgumentsError(f"arguments do not match the schema of {self.name!r}: {e}") from None
        except msgspec.DecodeError as e:
            raise ToolArgumentsError(f"arguments for {self.name!r} are not valid JSON: {e}") from None
        return {f: getattr(args, f) for f in args.__struct_fields__}

    def _parse_lenient(self, arguments: bytes) -> dict[str, Any]:
        import pydantic

        raw = decode_arguments(self.name, arguments)
        try:
            assert self.lenient is not None
            model = self.lenient().model_validate(raw)
        except pydantic.ValidationError as e:
            reasons = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}" for err in e.errors()
            )
            raise ToolArgumentsError(f"arguments do not match the schema of {self.name!r}: {reasons}") from None
        return {f: getattr(model, f) for f in self.args_type.__struct_fields__}


def _signature_fields(fn: Callable[..., Any]) -> list[tuple[Any, ...]]:
    """(name, type[, default]) of a tool method's parameters, ``self`` left out."""
    hints = get_type_hints(fn, include_extras=True)
    fields: list[tuple[Any, ...]] = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:  # skip self
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described to a model")
        typ = hints.get(p.name, Any)
        fields.append((p.name, typ) if p.default is inspect.Parameter.empty else (p.name, typ, p.default))
    return fields


def _pydantic_args(cls_name: str, fn: Callable[..., Any]) -> Any:
    """NeMo Gym's argument model: pydantic v2 defaults (extra keys ignored, lax coercion)."""
    import pydantic

    spec = {f[0]: (f[1], f[2] if len(f) == 3 else ...) for f in _signature_fields(fn)}
    try:
        return pydantic.create_model(f"{cls_name}_{fn.__name__}_nemo_gym_args", **spec)  # type: ignore[call-overload]
    except Exception as e:  # a type pydantic cannot validate: the author's mistake, in one line
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{cls_name}.{fn.__name__}: a nemo_gym tool's arguments must be types pydantic validates ({why})"
        ) from None


def _args_struct(cls_name: str, fn: Callable[..., Any]) -> type[msgspec.Struct]:
    fields: list[Any] = _signature_fields(fn)
    return msgspec.defstruct(f"{cls_name}_{fn.__name__}_args", fields, kw_only=True, forbid_unknown_fields=True)


class ModelClient(Protocol):
    """What a resource sees of the runtime's models (e.g. an LLM judge in ``verify``)."""

    async def generate(self, params: CreateParams, *, model: str) -> Response: ...


class SandboxClient(Protocol):
    """What a resource sees of the sandbox fleet (``gym_runtime.sandboxes.client.Sandboxes``, set by its
    worker: typed here so that importing the author API loads no transport)."""

    pool: str  # the entry's pool ("": none)

    def sandbox(self, image: str | None = None, **ask: Unpack[SandboxAsk]) -> Any: ...

    async def close_all(self) -> None: ...


class _NoSandboxes:
    """A resource outside a worker (a test, ``validate``): no pool to ask."""

    pool = ""

    def sandbox(self, image: str | None = None, **ask: Unpack[SandboxAsk]) -> Any:
        raise Failure("tool_error", "no sandbox pool: this environment runs outside a resource worker")

    async def close_all(self) -> None:
        return None


class Resource:
    """Base class of an environment. Subclass it; one instance serves one session.

    Subclasses must be constructible with no arguments (state comes from ``seed``).

    Class attributes:
      ``options``: the ``options`` mapping from the config entry (shared, read-only).
    Hooks (all optional):
      ``setup(cls, options)``: once per worker process, for shared read-only state; ``cls`` is the
      entry's own subclass (``entry_class``), so two entries of one environment keep apart what it sets.
      ``seed(self, task)``: start the session from the task row.
      ``verify(self, task, response)``: reward (float) or a ``Verdict``.
      ``close(self)``: release session resources.
    ``self.models.generate(params, model=NAME)`` reaches a model of the config
    through its work queue, so a judge model scales like any model worker.
    """

    tools: ClassVar[dict[str, ToolSpec]] = {}
    options: ClassVar[dict[str, Any]] = {}
    # How the model's tool arguments are validated: "strict" or "nemo_gym" (module docstring).
    tool_arguments: ClassVar[ArgumentMode] = "strict"
    # How the session-less verify path (``gym-runtime reverify``) rebuilds state:
    # "stateless": seed, then verify; "replay": seed, run the response's function
    # calls through the tools in order, then verify (for stateful environments).
    reverify: ClassVar[Literal["stateless", "replay"]] = "stateless"
    # The verdict field holding the model's extracted answer, if any: enables majority@k.
    answer_field: ClassVar[str | None] = None
    # The task row's fields that seed/verify read, as a msgspec Struct (other fields
    # are ignored): `gym-runtime validate` and `prepare` check rows against it, so a
    # bad row is reported with its line before any rollout runs.
    task_fields: ClassVar[type[msgspec.Struct] | None] = None
    # "resource": every function tool a row offers must be a tool of this class;
    # "any": a row's tools are answer channels the verifier grades, never run here.
    row_tools: ClassVar[Literal["resource", "any"]] = "resource"
    # Top-level import names of the optional packages this resource needs, and what to install for them:
    # checked before a worker starts (``check_requires``), so that a missing
    # package is one line, not a verifier that scores 0 in a worker process or a crash at the first call.
    requires: ClassVar[tuple[str, ...]] = ()
    install: ClassVar[str] = ""
    # Where this environment's code runs when its config entry does not say (``resources.NAME.isolation``):
    # "none", the worker's own process; "process", a guest process the worker kills when a call overruns
    # (gym_runtime.workers.guest), for code that may hold the GIL past the bus's liveness window.
    isolation: ClassVar[Literal["process", "none"]] = "none"
    # Set by a tool whose output ends the episode (an ORS tool's ``finished``): the worker answers that call
    # with ``ToolReply.done`` and the agent stops after the turn, as the environment's own harness would.
    episode_done: bool = False
    # Set by the worker before ``seed``: reach models of the config (LLM judges).
    models: ModelClient
    # Set by the worker before ``seed``: this session's sandboxes (the entry's ``sandbox`` pool), removed
    # when the session closes.
    sandboxes: SandboxClient = _NoSandboxes()

    def sandbox(self, image: str | None = None, **ask: Unpack[SandboxAsk]) -> Any:
        """A sandbox of the entry's pool (``resources.NAME.sandbox``) for this session: ``async with
        self.sandbox(image=..., cpu=...) as box`` (the keywords: ``SandboxAsk``) then ``await box.exec(cmd)``
        (docs/sandboxes.md)."""
        return self.sandboxes.sandbox(image, **ask)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        specs: dict[str, ToolSpec] = {}
        for base in reversed(cls.__mro__):
            for attr, fn in vars(base).items():
                mark = getattr(fn, _TOOL_MARK, None)
                if mark is None:
                    continue
                if not inspect.iscoroutinefunction(fn):
                    raise TypeError(f"{cls.__name__}.{attr}: tools must be async methods")
                tname, desc, mode = mark
                if tname.startswith(OPERATION_PREFIXES):
                    raise TypeError(f"{cls.__name__}.{attr}: {tname!r} is a name of the runtime's own operations")
                mode = mode or cls.tool_arguments
                if mode not in ARGUMENT_MODES:
                    raise TypeError(f"{cls.__name__}.tool_arguments must be one of {ARGUMENT_MODES}, not {mode!r}")
                lenient = (
                    functools.cache(functools.partial(_pydantic_args, cls.__name__, fn)) if mode == "nemo_gym" else None
                )
                specs[tname] = ToolSpec(tname, desc, attr, _args_struct(cls.__name__, fn), mode, lenient)
        cls.tools = specs

    @staticmethod
    def check_task(task: dict[str, Any], /) -> Any:
        """Raise ``ValueError`` for a row verify would refuse beyond ``task_fields``' types (what it
        returns, e.g. the parsed task an environment reuses in ``verify``, is not used here)."""
        return None

    @classmethod
    def build_validators(cls) -> None:
        """Build each ``nemo_gym`` tool's pydantic model now: where the tools run, a type pydantic cannot validate
        stops the start, not the first call."""
        for spec in cls.tools.values():
            if spec.lenient is not None:
                spec.lenient()

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        cls.options = options

    @classmethod
    async def teardown(cls) -> None:
        """Once per worker process, when it stops (after its sessions are closed)."""
        return

    async def seed(self, task: dict[str, Any]) -> None:
        return None

    async def verify(self, task: dict[str, Any], response: Response) -> float | Verdict:
        raise NotImplementedError(f"{type(self).__name__} does not implement verify")

    async def close(self) -> None:
        return None

    async def snapshot(self) -> bytes | None:
        """Optional: the session's state as bytes, asked after each checkpointed turn and kept with the rollout's
        checkpoint. With ``restore``, a rollout whose resource worker died resumes on a fresh session set back
        to it (docs/environments.md#a-restorable-environment); None: not restorable (it starts over)."""
        return None

    async def restore(self, data: bytes) -> None:
        """Optional: set this fresh session (``seed`` ran with the same task) back to a ``snapshot``'s bytes."""
        raise NotImplementedError(f"{type(self).__name__} cannot restore a snapshot")

    async def call_tool(self, name: str, arguments: str | bytes) -> str:
        """Run one tool call and return its output as the model will see it.

        Unknown tools and bad arguments raise ``ToolArgumentsError``; the caller
        turns that into a ``function_call_output`` the model can read.
        """
        spec = self.tools.get(name)
        if spec is None:
            known = ", ".join(sorted(self.tools)) or "none"
            raise ToolArgumentsError(f"unknown tool {name!r}; available tools: {known}")
        kwargs = spec.parse(arguments)
        result = await getattr(self, spec.method_name)(**kwargs)
        return encode_tool_output(result)

    async def call_operation(self, op: str, arguments: str | bytes) -> str:
        """One of the runtime's own session operations (``Session.operate``); a model's tool call never is one,
        whatever its name, so a policy cannot drive them. Environments that have some override this
        (``GymResource``: ``gym.reset`` and ``gym.step``)."""
        raise ToolArgumentsError(f"unknown operation {op!r}")

    @classmethod
    def tool_definitions(cls) -> list[dict[str, Any]]:
        return [spec.schema() for spec in cls.tools.values()]


def encode_tool_output(result: Any) -> str:
    """Serialize a tool's return value the way NeMo Gym's recorded rollouts show it.

    Strings pass through; anything else is JSON with Python's default separators
    (``{"count": 42}``), which is what NeMo Gym's tool outputs look like.
    """
    if isinstance(result, str):
        return result
    if isinstance(result, (bytes, bytearray)):
        return bytes(result).decode()
    return _json_text(msgspec.to_builtins(result))


# ``json.dumps``'s own C encoder with its defaults (ASCII, ", " and ": ", NaN allowed), built once: ``json.dumps``
# builds one per call, half of a small tool output's cost (23 k instructions, 11 k here). No cycle check: a value
# ``msgspec.to_builtins`` made has no cycle.
_C_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)  # None where Python was built without _json
_ENCODE: Any = (
    _C_ENCODER(
        None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ": ", ", ", False, False, True
    )
    if _C_ENCODER is not None
    else None
)


def _json_text(value: Any) -> str:
    """``json.dumps(value)``, byte for byte."""
    return "".join(_ENCODE(value, 0)) if _ENCODE is not None else json.dumps(value)


def load_resource_class(module_path: str, where: str, entry: str | None = None) -> type[Resource]:
    """The Resource class of ``module_path``; a module that cannot be imported is a ValueError (a user
    error: one line) that starts with ``where``, the config key that names it. With ``entry`` (the config
    entry a worker serves): a subclass of that entry's own (``entry_class``)."""
    cls = find_resource_class(load_plugin("resource", module_path, where, hint=_bundled_hint(module_path)))
    return cls if entry is None else entry_class(cls, entry)


def entry_class(cls: type[Resource], entry: str) -> type[Resource]:
    """``cls`` for one config entry: a subclass of its own, so what ``setup`` keeps on the class it is called
    on (``cls.options``, parsed options, clients) belongs to that entry alone. Two entries of one environment
    in one process (``run``, a ``Client``) then never serve each other's rows, and ``setup`` stays as
    authors write it."""
    return type(
        cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    )


class HostedStandIn(Resource):
    """A hosted NeMo Gym server (``resources.NAME.nemo_gym``) where its code is not loaded (publishing,
    validating rows): the server's own request models check rows when its workers take them."""

    row_tools = "any"


def config_resource_class(rcfg: Any, where: str) -> type[Resource]:
    """The Resource class a ``resources`` entry names, for checks outside its workers."""
    if getattr(rcfg, "nemo_gym", ""):
        return HostedStandIn
    return load_resource_class(rcfg.server, where)


def check_requires(cls: type[Resource], where: str) -> None:
    """A ValueError naming the packages of ``cls.requires`` that are not installed, if any. Workers check
    before they start; validating and publishing rows do not (a publisher node runs no verifier)."""
    missing = [m for m in cls.requires if importlib.util.find_spec(m) is None]
    if missing:
        hint = f": {cls.install}" if cls.install else ""
        raise UserError(f"{where}: {cls.__module__!r} needs {', '.join(missing)} (not installed{hint})")


def check_seed_once(cls: type[Resource], isolation: str, where: str) -> None:
    """A UserError where ``resources.NAME.seed_once`` is asked of an environment whose sessions cannot be copied:
    one that defines no ``snapshot`` and ``restore`` of its own, or whose code runs in a guest process."""
    own = [m for m in ("snapshot", "restore") if getattr(cls, m, None) is getattr(Resource, m)]
    if own:
        raise UserError(
            f"{where}: {cls.__name__} cannot snapshot its sessions (it defines no {' or '.join(own)}): "
            "remove seed_once, or give it snapshot and restore (docs/sandboxes.md#set-up-once-for-the-group)"
        )
    if isolation != "none":
        raise UserError(f"{where}: needs isolation: none (a guest process's sessions are not restored here)")


def _bundled_hint(module_path: str) -> str:
    bundled = module_path.startswith(("resources.", "gym_runtime.resources.")) or "." not in module_path
    return " (the bundled environments' verifier packages: pip install 'gym-runtime[envs]')" if bundled else ""


def find_resource_class(module: Any) -> type[Resource]:
    """The Resource subclass a module defines (or names as ``resource``)."""
    named = getattr(module, "resource", None)
    if isinstance(named, type) and issubclass(named, Resource):
        return named
    found = [
        v
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, Resource) and v is not Resource and v.__module__ == module.__name__
    ]
    if len(found) != 1:
        raise UserError(
            f"module {module.__name__} must define exactly one Resource subclass "
            f"(or name it as `resource = ...`); found {len(found)}"
        )
    return found[0]


def parse_options(raw: dict[str, Any] | None, options_type: type[T], env: str) -> T:
    """A resource's config ``options`` as its msgspec Struct; a bad value is one ``ValueError``
    naming the environment and the key (``math options: Expected `bool`... - at `$.use_judge```)."""
    try:
        return msgspec.convert(raw or {}, options_type)
    except (msgspec.ValidationError, ValueError) as e:
        raise UserError(f"{env} options: {e}") from None


# Set per call in a guest process (``workers.guest_main``): called in a thread as it starts to run environment
# code, it notes which call the thread runs for (and returns the undo), so that a thread stuck holding the GIL
# is blamed on its own call, not on the calls waiting behind it. Unset (None) in a worker's own process.
ENV_THREAD: ContextVar[Callable[[], Callable[[], None]] | None] = ContextVar("gym_env_thread", default=None)
# The guest call whose code runs here (0: none, or not in a guest): a model call that code makes carries it,
# so the worker traces the call under that call's span. Set per call task (``ENV_CALL``) and, for code on
# another thread (a hosted server's app loop), per thread while it runs that call's code (``thread_call``).
ENV_CALL: ContextVar[int] = ContextVar("gym_env_call", default=0)
# The guest session whose call runs here ("": none): a hosted server's sandboxes are created under its lease.
ENV_SESSION: ContextVar[str] = ContextVar("gym_env_session", default="")
_THREAD_CALL = threading.local()


def thread_call() -> int:
    """The guest call whose code this thread runs now (``note_thread_call``), else 0."""
    return int(getattr(_THREAD_CALL, "id", 0))


def note_thread_call(call_id: int) -> Callable[[], None]:
    """Note ``call_id`` as this thread's call; the undo puts back what was there."""
    before = thread_call()
    _THREAD_CALL.id = call_id
    return lambda: setattr(_THREAD_CALL, "id", before)


async def in_call(call_id: int, coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` with ``ENV_CALL`` set (a task of its own: on another loop, say)."""
    if call_id:
        ENV_CALL.set(call_id)
    return await coro


class ThreadMarked:
    """Awaits ``coro`` with each of its steps marked as its call's on the thread that runs it (``ENV_THREAD``):
    a hosted server's request, on the app loop's thread where many calls interleave, is blamed on its own call
    when that thread is stuck holding the GIL."""

    __slots__ = ("_coro", "_mark")

    def __init__(self, coro: Coroutine[Any, Any, Any], mark: Callable[[], Callable[[], None]]) -> None:
        self._coro, self._mark = coro, mark

    def __await__(self) -> Generator[Any, Any, Any]:
        step, value, error = self._coro.__await__(), None, None
        while True:
            undo = self._mark()
            try:
                yielded = step.send(value) if error is None else step.throw(error)
            except StopIteration as done:
                return done.value
            finally:
                undo()
            try:
                value, error = (yield yielded), None
            except BaseException as e:  # noqa: BLE001 - thrown in (a cancellation): passed to the call
                value, error = None, e


def _in_thread(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    mark = ENV_THREAD.get()
    undo = mark() if mark is not None else None
    try:
        return fn(*args)
    finally:
        if undo is not None:
            undo()


async def run_blocking(fn: Callable[..., Any], *args: Any, abandon: bool = False) -> Any:
    """Run blocking I/O or sync environment code in a worker thread so the event loop keeps serving.
    ``abandon``: a cancelled caller stops waiting (the thread runs on; only a guest process can be stopped)."""
    import anyio.to_thread

    return await anyio.to_thread.run_sync(_in_thread, fn, args, abandon_on_cancel=abandon)


async def run_in_process(fn: Callable[..., Any], *args: Any, timeout: float | None = None, limiter: Any = None) -> Any:
    """Run CPU-heavy pure-Python work (math-verify, checkers) in a worker process.

    ``fn`` must be a picklable top-level function. On timeout the worker process
    is killed (anyio's ``cancellable=True``) and ``TimeoutError`` is raised, so a
    runaway verification cannot wedge the resource worker. Processes are reused
    between calls; ``limiter`` (an ``anyio.CapacityLimiter``) bounds how many run at once.
    """
    import anyio
    import anyio.to_process

    async def call() -> Any:
        # An idle pooled worker can be dead (killed, or left by a finished event loop);
        # anyio then raises BrokenWorkerProcess: try once more on a fresh worker.
        try:
            return await anyio.to_process.run_sync(fn, *args, cancellable=True, limiter=limiter)
        except anyio.BrokenWorkerProcess:
            return await anyio.to_process.run_sync(fn, *args, cancellable=True, limiter=limiter)

    if timeout is None:
        return await call()
    with anyio.fail_after(timeout):
        return await call()


async def replay_calls(inst: Resource, response: Response) -> None:
    """Run a finished response's function calls through a fresh session, in order, as the tool calls they were
    (a call named like one of the runtime's operations reached none live, and reaches none here)."""
    for item in response.output:
        if isinstance(item, FunctionCall):
            try:
                await inst.call_tool(item.name, item.arguments)
            except ToolArgumentsError:
                pass  # the model saw an error for this call; state is unchanged
