"""The error tree: every error gym-runtime raises on purpose is a ``GymError``.

::

    GymError
    ├── Failure            a typed failure with an ErrorInfo; crosses the bus unchanged
    │   ├── NoResponders   (gym_runtime.transport.bus) nobody serves the subject right now
    │   └── StorageFull    a stream at its size limit (also a UserError: a command says which key to raise)
    ├── UserError          a mistake the user can fix: the CLI prints one line, exit 2
    │   ├── ConfigError    (+ NemoConfigError) the message names the file and the key
    │   ├── InputError     bad rows; the message names file:line
    │   ├── AuthError      a trust directory or credentials file that cannot be used
    │   └── ...            CLI values, prepare, init, server addresses, stream setup
    ├── ModelError         a generation failed (adapters raise it)
    └── ClientError        the trainer's client was used wrongly or the cluster refused
        ├── PublishTimeout the server did not acknowledge a publish within the client's budget
        └── RolloutFailed  one row ended in a failure row

Anything else that escapes a command is a bug: the CLI says so, prints the traceback, exit 3.
``UserError`` is also a ``ValueError`` so that code checking values keeps its ``except ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from gym_runtime.messages import ErrorClass, ErrorInfo

__all__ = [
    "AuthError",
    "ClientError",
    "ConfigError",
    "Failure",
    "GymError",
    "InputError",
    "ModelError",
    "PublishTimeout",
    "RolloutFailed",
    "StorageFull",
    "UserError",
    "did_you_mean",
    "nearest",
    "observed",
    "port_in_use",
]


class GymError(Exception):
    """The root of every error gym-runtime raises on purpose."""


class Failure(GymError):
    """A failure with an ``ErrorInfo``: error class, message, whether a retry may help.

    Raised by a handler or an agent to answer or fail with that error class
    (``Failure("tool_error", "...", retryable=False)``), and raised by the bus when
    the other side answered with one or was lost (``Failure(info)``), so one
    exception crosses any number of hops unchanged.

    ``observed``: the runtime saw this failure itself (a peer's answer over the bus, a worker or guest lost, one of
    its clocks), rather than environment code raising it; only such a failure keeps a class that environment
    code may not raise as its own (``data.error_classes``). Set where the runtime raises it (``observed``).
    """

    observed = False

    def __init__(self, error: ErrorClass | ErrorInfo, message: str = "", *, retryable: bool = False) -> None:
        info = (
            error
            if isinstance(error, ErrorInfo)
            else ErrorInfo(error_class=error, message=message, retryable=retryable)
        )
        super().__init__(f"{info.error_class}: {info.message}")
        self.info = info


F = TypeVar("F", bound=Failure)


def observed(e: F) -> F:
    """``e``, marked as the runtime's own finding (``Failure.observed``)."""
    e.observed = True
    return e


class UserError(GymError, ValueError):
    """A mistake the user can fix (config, input, credentials, a command's values): one line, exit 2."""


class StorageFull(Failure, UserError):
    """A stream refused a store: it is at its size limit. A worker turns it into a ``storage_full``
    failure row; a command prints it as one line (exit 2). The message names the key that raises it."""

    observed = True  # the stream's refusal, never an environment's

    def __init__(self, message: str) -> None:
        super().__init__("storage_full", message)

    def __str__(self) -> str:
        return self.info.message


def nearest(word: str, names: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The name of ``names`` nearest ``word`` (difflib's ratio at least ``cutoff``), if any: the one rule a
    message suggests a spelling by."""
    import difflib

    near = difflib.get_close_matches(word, list(names), n=1, cutoff=cutoff)
    return near[0] if near else None


def did_you_mean(word: str, names: Iterable[str], *, cutoff: float = 0.6) -> str:
    """``"; did you mean NAME?"`` for ``nearest(word, names)``, else ``""``."""
    near = nearest(word, names, cutoff=cutoff)
    return f"; did you mean {near}?" if near else ""


def port_in_use(host: str, port: int, flag: str = "", *, zero: bool = False) -> str:
    """The words for ``host:port`` held by another process, with a port that is free now to give instead
    (``flag``: the option that takes it; ``zero``: it also takes 0, any free one): the one rule every listener
    (``server``, ``gateway``, ``view``, ``--metrics-port``) says a taken port by."""
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:  # not an address of this machine: a free port of loopback still says what to do
            s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    give = f"{flag} {free}" if flag else str(free)
    also = f", or {flag} 0 for any free one" if zero and flag else ""
    return f"{host}:{port} is already in use (another server running?): give a free port, e.g. {give}{also}"


class ConfigError(UserError):
    """A config problem; the message names the file and the key."""


def in_entry(text: str, role: str, name: str) -> str:
    """A plugin's message, which names its config key as ``agents.*.options.x`` (it does not know its entry's
    name), with the entry named: ``agents.vf04.options.x``."""
    return text.replace(f"{role}.*.", f"{role}.{name}.")


class InputError(UserError):
    """Bad input rows; ``problems`` lists ``file:line: reason`` for each."""

    def __init__(self, problems: list[str]) -> None:
        if len(problems) == 1:  # one problem, one line
            super().__init__(f"{problems[0]} (nothing was published)")
        else:
            shown = problems[:20]
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            super().__init__("invalid input rows (nothing was published):\n  " + "\n  ".join(shown) + more)
        self.problems = problems


class AuthError(UserError):
    """A user mistake with an auth dir or a credentials file (missing file, wrong role, bad seed)."""


class ModelError(GymError):
    """A generation failed. ``retryable`` says whether another attempt may succeed; ``out_of_service``: the
    adapter has no endpoint in service (each taken out for its silence or errors), so every call fails alike
    until a probe brings one back (a ``run`` stops its batch on it)."""

    def __init__(self, message: str, *, retryable: bool = False, out_of_service: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.out_of_service = out_of_service


class ClientError(GymError):
    """A usage or cluster problem the trainer must fix (bad rows, config mismatch, no replica acked)."""


class PublishTimeout(ClientError):
    """The NATS server did not acknowledge a publish within the client's budget (``Client(publish_retry_s=)``):
    it was sent again with the same message id until then, so it is stored at most once. An overloaded or
    unreachable server, not a bug: one line, not nats-py's ``TimeoutError``."""


class RolloutFailed(GymError):
    """``Client.run`` of one row ended in a failure row (``row`` holds it, as ``collect`` writes it)."""

    def __init__(self, row: dict[str, Any]) -> None:
        super().__init__(f"{row.get('error_class')}: {row.get('error')}")
        self.error_class = str(row.get("error_class"))
        self.row = row
