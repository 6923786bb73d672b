"""``gym-runtime``: run a batch, serve workers, or run the NATS server.

Each command is a module here with ``add_parser(sub)`` and ``main(args) -> int``.
Exit codes: 0 success; 1 the batch finished with failure rows; 2 bad usage,
config or input (one line on stderr, nothing was run); 3 an internal error (a
bug: the traceback is printed, labelled as such); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from types import ModuleType
from typing import NoReturn

import gym_runtime
from gym_runtime.cli._gc import tune_gc
from gym_runtime.cli._lazy import defer_imports

# The commands, each a module of this package; imported by ``commands()`` once ``main`` has tuned the
# cycle collector (importing this package stays light: ``main`` imports the stack, not the import).
COMMAND_NAMES = (
    "run",
    "start",
    "publish",
    "collect",
    "reverify",
    "status",
    "why",
    "server",
    "gateway",
    "purge",
    "explain",
    "health",
    "validate",
    "prepare",
    "init",
    "env",
    "parity",
    "view",
    "diff",
    "export",
)


def commands(only: str | None = None) -> dict[str, ModuleType]:
    """Every command's module by name (imported on first call); ``only``: that one command's, when it is one.

    A process runs one command, so it imports that command's module, not the other fifteen and what they
    import (the hosting catalogue, parity, images...): ``publish`` and ``collect`` of a small batch spend
    most of their CPU starting up (issue 41; ``tests/bench/cli_startup.py``)."""
    names = (only,) if only in COMMAND_NAMES else COMMAND_NAMES
    return {name: importlib.import_module(f"gym_runtime.cli.{name}") for name in names}


def command_named(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (the top level has only flags);
    None when the top level's own help comes first (``gym-runtime --help publish`` lists every command)."""
    for a in argv:
        if a in ("-h", "--help"):
            return None
        if not a.startswith("-"):
            return a
    return None


EXIT_BUG = 3
# A user's mistake (config, input, CLI value, path, server address): one line, exit 2. A bare
# ValueError is not one: it comes from a bug, and is reported as one (exit 3). With these, ``main``
# counts gym_runtime.errors.UserError (config, input, credentials, CLI values, server addresses).
PATH_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)


class VersionAction(argparse.Action):
    """``--version``: the version looked up when asked for (``importlib.metadata`` is not a cost of every
    command's start-up)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        print(f"gym-runtime {gym_runtime.__version__}")  # on stdout, as argparse's own version action
        parser.exit()


class Parser(argparse.ArgumentParser):
    """argparse with a usage mistake said in one line (the flag and its value), not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; ``only``: with just that command's subparser when it is a command (what ``main``
    parses with); otherwise, as for ``gym-runtime --help`` or a mistyped command, with every command's."""
    parser = Parser(prog="gym-runtime", description="Run a batch, serve workers, or run the NATS server.")
    parser.add_argument("--version", action=VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in commands(only).values():
        module.add_parser(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, with what a command does not take said as what it should have been
    (``_usage.unrecognized``), by that command's parser."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        from gym_runtime.cli._usage import unrecognized

        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command = sub.choices[args.command]
        command.error(unrecognized(command, args.command, extras))
    return args


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) ExceptionGroups, in order; cancellations dropped when others exist."""
    if isinstance(exc, BaseExceptionGroup):
        found = [leaf for e in exc.exceptions for leaf in leaves(e)]
        real = [e for e in found if not _is_cancel(e)]
        return real or found
    return [exc]


def _is_cancel(exc: BaseException) -> bool:
    import asyncio

    return isinstance(exc, asyncio.CancelledError)


def main(argv: list[str] | None = None) -> int:
    tune_gc()  # before the commands import the stack: the collector's passes over it cost start-up time
    defer_imports()  # aiohttp, which nats-py imports for a transport we do not use: run where it is used
    from gym_runtime.cli._common import (
        EXIT_INTERRUPTED,
        EXIT_USAGE,
        check_output,
        err,
        interrupted_line,
        log_level_of,
        quiet_stdout,
        refuse_argv_secrets,
        stdout_gone,
    )
    from gym_runtime.errors import UserError

    user_errors: tuple[type[BaseException], ...] = (UserError, *PATH_ERRORS)

    argv = sys.argv[1:] if argv is None else argv
    command = command_named(argv)
    args = parse(build_parser(command), argv)
    if hasattr(args, "log_level"):
        args.log_level = log_level_of(args)  # resolved once: children started with it get the same
    from gym_runtime.observability import logs  # structlog: after parsing (`--help` and a usage error need none)

    logs.configure(getattr(args, "log_level", "warning"))
    try:
        refuse_argv_secrets(args)
        if getattr(args, "trace_file", None):  # its folder made as -o's is, before anything runs
            check_output(args.trace_file, flag="--trace-file")
        return int(commands(command)[args.command].main(args))
    except BaseException as exc:  # classified below; SystemExit is re-raised
        causes = leaves(exc)
        if any(isinstance(e, KeyboardInterrupt) for e in causes):
            err(interrupted_line())
            return EXIT_INTERRUPTED
        if any(isinstance(e, SystemExit) for e in causes):
            raise
        if any(isinstance(e, BrokenPipeError) for e in causes) and stdout_gone():
            quiet_stdout()  # the reader of our output stopped early (`| head`): not an error of ours
            return 0
        from gym_runtime.transport.connect import jetstream_unavailable, unanswered  # nats-py: loaded to connect

        unavailable = next((e for e in causes if jetstream_unavailable(e)), None)
        if unavailable is not None:  # a cluster that lost the quorum of a stream or of its meta group
            said = getattr(unavailable, "description", None) or unavailable
            err(
                f"JetStream stopped answering ({said}): a cluster answers while a quorum of its nodes is up; "
                "what was stored is kept, run the command again once it is"
            )
            return EXIT_USAGE
        timeout = next((e for e in causes if unanswered(e)), None)
        if timeout is not None:  # e.g. a request the server's permissions refused: it never gets an answer
            err(
                f"a NATS request got no answer ({timeout}); on a `server --secure` bus, see the permissions "
                "warning above"
            )
            return EXIT_USAGE
        user = next((e for e in causes if isinstance(e, user_errors)), None)
        if user is not None and all(isinstance(e, user_errors) or _is_cancel(e) for e in causes):
            err(user_message(user))
            return EXIT_USAGE
        print(
            "gym-runtime: internal error (this is a bug in gym-runtime; please report it with the traceback below)",
            file=sys.stderr,
        )
        traceback.print_exception(exc, file=sys.stderr)
        return EXIT_BUG


def user_message(exc: BaseException) -> str:
    from gym_runtime.transport.connect import ServerUnreachable

    if isinstance(exc, OSError) and exc.filename is not None and not isinstance(exc, ServerUnreachable):
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)
