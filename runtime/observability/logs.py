"""structlog set-up: JSON lines on stderr, with task, rollout and trace ids bound per message.

Ids are bound with ``structlog.contextvars`` inside a scope (``bound``), so they
belong to the task that handles one message and never leak to the next.
Secrets are scrubbed by key name before anything is rendered.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from contextvars import ContextVar
from typing import Any

# structlog imports rich, where it is installed, for its console renderer's tracebacks. Ours never reach that
# renderer (``format_exc_info`` makes them text first: the same output either way), and rich's import was
# 0.1-0.15 CPU-s of the start of every process of ours (each command, worker child and hosted guest). So it is
# hidden while structlog is imported, and importable as before once it is (the progress bars use it).
_HIDE_RICH = "rich" not in sys.modules
if _HIDE_RICH:
    sys.modules["rich"] = None  # type: ignore[assignment]  # None in sys.modules: `import rich` is ImportError
try:
    import structlog
    from structlog.contextvars import bind_contextvars
finally:
    if _HIDE_RICH:
        del sys.modules["rich"]

SECRET_KEYS = ("api_key", "apikey", "token", "password", "secret", "authorization")


def _scrub(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for k in list(event):
        if any(s in k.lower() for s in SECRET_KEYS):
            event[k] = "***"
    return event


# each key's own ContextVar, structlog's (what ``bind_contextvars`` sets and ``merge_contextvars`` reads), taken
# from the token of its first binding: a scope then sets it at once, without the name's formatting and lookup
_VARS: dict[str, ContextVar[Any]] = {}


def _var(key: str) -> ContextVar[Any]:
    token = bind_contextvars(**{key: None})[key]
    token.var.reset(token)
    _VARS[key] = token.var
    return token.var


class _Bound:
    __slots__ = ("_kw", "_tokens")

    def __init__(self, kw: dict[str, Any]) -> None:
        self._kw = kw

    def __enter__(self) -> None:
        known = _VARS
        self._tokens = [(known.get(k) or _var(k)).set(v) for k, v in self._kw.items()]

    def __exit__(self, *exc: object) -> None:
        for token in self._tokens:
            token.var.reset(token)


def bound(**kw: Any) -> _Bound:
    """Bind ``kw`` to the log context for this scope, then restore what each key held before.

    One ``ContextVar`` set and reset per key (structlog's ``bound_contextvars``
    copies the whole context first: a measurable cost once per rollout). The scope is a slotted
    object, not a generator context manager: a rollout's scope lives as long as the rollout, and
    the generator, its frame and its manager were three more objects per rollout for the cycle
    collector to walk.
    """
    return _Bound(kw)


def configure(level: str = "info", *, json: bool = True) -> None:
    """Configure structlog for a process (the CLI calls it once at start)."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _scrub,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # one write per line (message and newline together): worker children share the command's stderr, and
        # two writes per line let another process's line land between a message and its newline
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Quiet libraries that log through stdlib logging (nats-py, httpx).
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)


def level() -> str:
    """The level this process logs at, by name, for a child it starts to log as it does (a guest process);
    ``warning``, the CLI's default, where nothing set one (in-process workers a test or a trainer runs)."""
    wrapper = structlog.get_config()["wrapper_class"]
    try:  # a filtering bound logger's (``configure``'s) reads its class, not its instance
        number = wrapper.get_effective_level(wrapper)
    except (AttributeError, TypeError):  # another set-up's wrapper (stdlib's BoundLogger reads its instance)
        number = logging.NOTSET
    return logging.getLevelName(number).lower() if number > logging.NOTSET else "warning"


def library_mode() -> None:
    """Used as a library (the trainer's client): print nothing unless the caller configured logging.

    If structlog was not configured, its events go to stdlib ``logging`` under ``gym.*`` with a
    ``NullHandler`` there, so they surface only through handlers the caller installs.
    """
    logging.getLogger("gym").addHandler(logging.NullHandler())
    if not structlog.is_configured():
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                _scrub,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
            logger_factory=structlog.stdlib.LoggerFactory(),
            wrapper_class=structlog.stdlib.BoundLogger,
        )


def get(name: str | None = None) -> Any:
    return structlog.get_logger(name)


__all__ = ["bound", "configure", "get", "library_mode"]
