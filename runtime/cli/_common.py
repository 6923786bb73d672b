"""What several commands share: common options, config loading, server URLs, output checks, summaries.

Light to import: what builds the parsers (options, argparse types) imports no transport, telemetry or
embedded server; a helper that runs those imports them when it runs, as the commands do (``--help`` and a
mistyped flag cost an interpreter and argparse; ``tests/test_cli_lazy.py`` pins it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gym_runtime.errors import UserError
from gym_runtime.ops.secrets import check_argv_secret
from gym_runtime.ops.security import AUTH_DIR_ENV, ensure_auth_dir
from gym_runtime.plugins import config_path

if TYPE_CHECKING:
    from gym_runtime.config import Config
    from gym_runtime.observability.tracing import Telemetry
    from gym_runtime.ops.credentials import ClientAuth
    from gym_runtime.transport.bus import Bus

EXIT_FAILURES = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


_kept: list[Callable[[], str]] = []  # what the running command has kept so far (``when_interrupted``)


def when_interrupted(kept: Callable[[], str]) -> None:
    """Say ``kept()`` after "interrupted" if Ctrl-C stops the command from now on: what it has kept so far (its
    rows, where) and how to go on. A command sets it once its work starts."""
    _kept[:] = [kept]


def interrupted_line() -> str:
    """The one line a command stopped by Ctrl-C ends with (exit 130)."""
    try:
        said = _kept[0]() if _kept else ""
    except Exception:  # noqa: BLE001 - the line about an interrupt must not fail on the state it reads
        said = ""
    return f"interrupted: {said}" if said else "interrupted"


def plural(n: int, noun: str) -> str:
    """``1 problem``, ``2 problems``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def err(msg: str) -> None:
    print(f"gym-runtime: error: {printable(msg, keep=chr(10))}", file=sys.stderr)


def printable(text: str, keep: str = "") -> str:
    """``text`` safe for a terminal: each character that is not printable (ESC and every control, C1's CSI,
    bidirectional overrides, a lone surrogate) written as its escape (``\\x1b``, ``\\u202e``), so what a row
    holds can set no title, clear no screen and reorder no line; ``keep``: characters left as they are."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() or c in keep else c.encode("unicode_escape", "backslashreplace").decode() for c in text
    )


def printable_json(text: str) -> str:
    """JSON text (``ensure_ascii=False``) with every character a terminal would act on written as a JSON
    escape (``\\u001b``): still the same JSON to a parser."""
    if text.isprintable():
        return text
    out = []
    for c in text:
        if c.isprintable() or c in "\n ":
            out.append(c)
        else:
            units = c.encode("utf-16-be", "surrogatepass")
            out += [f"\\u{int.from_bytes(units[i : i + 2], 'big'):04x}" for i in range(0, len(units), 2)]
    return "".join(out)


def common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a config value before ${VAR} substitution, e.g. --set models.policy.model=gpt-4.1; "
        "the path must exist (+KEY.PATH=VALUE adds a new entry); repeatable",
    )
    log_level_option(p)
    p.add_argument("--trace-file", metavar="PATH", help="write spans as JSON lines to this file")


def log_level_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        type=str.lower,
        help="log level of the JSON logs on stderr: info = batch and worker lifecycle, "
        "debug = one line per rollout with its ids (default: warning, error with --quiet; env GYM_LOG_LEVEL)",
    )


def log_level_of(args: argparse.Namespace) -> str:
    """``--log-level``, else ``GYM_LOG_LEVEL``, else ``error`` under ``--quiet`` (quiet means quiet: no
    per-row warnings either; a user error is still its one line) and ``warning`` otherwise."""
    given = getattr(args, "log_level", None) or os.environ.get("GYM_LOG_LEVEL", "").lower()
    if given:
        return str(given)
    return "error" if getattr(args, "quiet", False) else "warning"


def any_tools_option(p: argparse.ArgumentParser) -> None:
    """``--any-tools``: rows may offer tools the environment does not have (answer channels)."""
    p.add_argument(
        "--any-tools",
        action="store_true",
        help="rows may offer tools that are not tools of the environment (answer channels the verifier reads "
        "from the call, as an environment with row_tools = 'any' declares for itself); default: such a row "
        "is refused, as validate refuses it",
    )


def auth_option(p: argparse.ArgumentParser) -> None:
    """``--auth-dir DIR``: this node's copy of the ``server --secure`` directory (only its roles' .creds)."""
    p.add_argument(
        "--auth-dir",
        default=None,
        metavar="DIR",
        help=f"credentials for a `server --secure` bus: ca.pem + the .creds of the roles this command "
        f"runs (default: ${AUTH_DIR_ENV})",
    )


def client_auth(args: argparse.Namespace) -> ClientAuth | None:
    """The command's ``ClientAuth`` from ``--auth-dir`` or ``$GYM_AUTH_DIR`` (``None``: an unsecured bus)."""
    from gym_runtime.ops.credentials import ClientAuth

    return ClientAuth.resolve(getattr(args, "auth_dir", None))


def refuse_argv_secrets(args: argparse.Namespace) -> None:
    """Literal secrets in ``--set`` values or ``--nats`` URLs are refused (``ps`` shows argv to every user)."""
    for o in getattr(args, "overrides", None) or []:
        check_argv_secret("--set", o)
    nats = getattr(args, "nats", None)
    if nats:
        check_argv_secret("--nats", nats)


def load(args: argparse.Namespace) -> Config:
    """The command's config, as loaded (pure data). Every command that starts workers or checks rows against
    environments resolves it (``resolve_config``: its plugins imported, their option checks) before any work."""
    from gym_runtime.config import load_config

    cfg = load_config([config_path(c) for c in args.config], args.overrides)
    if getattr(args, "concurrency", None):
        for a in cfg.agents.values():
            a.concurrency = args.concurrency
    return cfg


def stdout_gone() -> bool:
    """True when stdout is a pipe whose reader has gone (``| head`` after its line)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def quiet_stdout() -> None:
    """Send what is left for stdout to /dev/null: its reader is gone, and Python's flush at exit would fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def print_stats(batch: str, s: Any, out: str, *, elapsed_s: float | None = None) -> None:
    """The batch's summary on stdout; a reader that stopped early (``| head -1``) ends it quietly, and the
    command keeps its exit code (the rows are in the file either way)."""
    from gym_runtime.data.aggregate import summary_lines

    took = f" in {elapsed_s:.2f}s" if elapsed_s is not None else ""
    lines = [f"batch {batch}: {s.rows} rows, {s.failures} failed{took} -> {out}"]
    if s.mean_reward is not None:
        lines.append(f"mean reward: {s.mean_reward:.4f}")
    if s.refused:
        lines.append(f"refused: {s.refused} stored results not from their task's agent, or of no slot of the batch")
    lines += summary_lines(s.metrics)
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()


def failures_exit(stats: Any, out: str) -> int:
    if stats.failures:
        from gym_runtime.data.collector import sidecar_paths

        held = getattr(stats, "budget", 0)
        why = (
            f" ({held} held back by the batch's budget: run or publish it again with a larger --budget)" if held else ""
        )
        err(f"{plural(stats.failures, 'rollout')} failed{why}; see {sidecar_paths(out)[0]}")
        return EXIT_FAILURES
    return 0


@contextlib.contextmanager
def server_url(args: argparse.Namespace, cfg: Config) -> Iterator[str | list[str]]:
    """``--nats URL`` or the config's; ``embedded`` starts a server for the command and stops it after.

    With ``--auth-dir`` the embedded server is secured with that directory (created if empty).
    """
    from gym_runtime.ops.nats_server import EmbeddedServer
    from gym_runtime.ops.permissions import Reach

    url: str | list[str] = args.nats or cfg.nats
    if url != "embedded":
        reach(url)
        yield url
        return
    secure = getattr(args, "auth_dir", None) or os.environ.get(AUTH_DIR_ENV) or None
    if secure:
        ensure_auth_dir(secure)
    with EmbeddedServer(
        store_dir=getattr(args, "store_dir", None),  # kept after it stops: `run --store-dir` resumes from it
        secure_dir=secure,
        namespaces=[cfg.namespace],
        reach=Reach.of(cfg),
        jetstream=cfg.jetstream,
        sync=cfg.jetstream.sync,
    ) as server:
        yield server.url


NATS_ENV = "GYM_NATS"


def bus_options(p: argparse.ArgumentParser, what: str) -> None:
    """How a command with no config reaches the bus (``need_url``, ``client_auth``): ``--nats`` (``GYM_NATS``
    stands in for it: the deploy files set it), ``--namespace`` (the config's otherwise) and ``--auth-dir``."""
    p.add_argument("--nats", help=f"{what} (default: ${NATS_ENV})")
    p.add_argument("--namespace", default="gym", help="the config's namespace (default: gym)")
    auth_option(p)


def need_url(args: argparse.Namespace, cfg: Config | None) -> str | list[str]:
    """``--nats``, else the config's ``nats``; a command with no config reads ``GYM_NATS`` instead."""
    url = args.nats or (cfg.nats if cfg else os.environ.get(NATS_ENV))
    if not url or url == "embedded":
        also = "" if cfg else f" or {NATS_ENV}"
        raise UserError(f"{args.command} needs --nats URL{also} (start a server with `gym-runtime server`)")
    return url


def reach(url: str | list[str], *, query: bool = False) -> str | list[str]:
    """A one-shot command's server (not a service's, which waits for it), reached first: a dead or wrong
    URL is said at once (what is tried, for how long), then ends in one error line, not ~10 s of silence.

    A ``query`` (status, explain, purge, view of a live batch) ends in that one line alone: on a terminal the
    notice is a status line, erased before what comes next; to a pipe it is not written at all."""
    import anyio

    from gym_runtime.transport.connect import connect_timeout_s, server_list, wait_reachable

    status = StatusLine() if query and sys.stderr.isatty() else None
    notice = say if not query else status
    try:
        anyio.run(functools.partial(wait_reachable, server_list(url), connect_timeout_s(), on_wait=notice))
    finally:
        if status is not None:
            status.clear()
    return url


@contextlib.asynccontextmanager
async def connected(
    args: argparse.Namespace,
    url: str | list[str],
    service: str,
    *,
    auth: ClientAuth | None,
    role: str = "publisher",
    telemetry: Telemetry | None = None,
    **options: Any,
) -> AsyncIterator[Bus]:
    """A command's connection to the bus, closed after it: ``gym-{service}`` in ``--namespace``, as ``role`` with
    ``auth`` (``client_auth``, read before the event loop starts, so a missing credentials file is one line)."""
    from gym_runtime.observability.tracing import Telemetry
    from gym_runtime.transport.bus import Bus

    bus = await Bus.connect(
        url,
        namespace=args.namespace,
        telemetry=Telemetry() if telemetry is None else telemetry,
        name=f"gym-{service}",
        auth=auth,
        role=role,
        **options,
    )
    async with bus:
        yield bus


def watched_query(args: argparse.Namespace, service: str, body: Callable[[Any], Any]) -> int:
    """A query command on a live bus (``status``, ``why``): ``--interval`` checked, the server reached, a
    publisher's connection for ``body(bus)``, closed after it; Ctrl-C ends a ``--watch`` with exit 0."""
    if args.interval <= 0:
        raise UserError(f"--interval {args.interval:g}: must be positive (seconds between refreshes)")
    url = reach(need_url(args, None), query=True)
    auth = client_auth(args)

    async def go() -> None:
        async with connected(args, url, service, auth=auth) as bus:
            await body(bus)

    from gym_runtime.service.loop import run_async

    try:
        run_async(go)
    except KeyboardInterrupt:
        if not args.watch:
            raise
    return 0


class StatusLine:
    """A notice on a terminal until the next output replaces it: the user sees why a query waits, and
    afterwards only its result or its one error line."""

    def __init__(self) -> None:
        self.shown = False

    def __call__(self, line: str) -> None:
        try:
            columns = os.get_terminal_size(sys.stderr.fileno()).columns or 80
        except OSError:
            columns = 80
        width = columns - 1  # one row: \r and erase-line clear it whole
        print(f"gym-runtime: {line}"[:width], end="", file=sys.stderr, flush=True)
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
            self.shown = False


def say(line: str) -> None:
    """A notice for the user on stderr (not an error: the command goes on)."""
    print(f"gym-runtime: {line}", file=sys.stderr, flush=True)


def config_argument(p: argparse.ArgumentParser, *, bundled: bool = False) -> None:
    extra = " (or a bundled environment's name, e.g. weather)" if bundled else ""
    p.add_argument(
        "config",
        nargs="+",
        metavar="CONFIG",
        help=f"config YAML{extra}; several files are merged in order (later ones win, mappings merge)",
    )


def input_argument(
    p: argparse.ArgumentParser,
    what: str,
    *,
    repeatable: bool = False,
    required: bool = False,
    metavar: str | None = None,
) -> None:
    """``-i/--input``: the rows a command reads (``repeatable``: a list, one per ``-i``)."""
    action = "append" if repeatable else "store"
    p.add_argument("-i", "--input", action=action, required=required, metavar=metavar, help=what)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--repeats 0`` is a usage error, not an empty batch)."""
    return _at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _at_least(text, 0)


def _whole(text: str, what: str) -> int:
    """``text`` as an int, else the usage error that says what was expected."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _at_least(text: str, least: int) -> int:
    value = _whole(text, "a whole number")
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def rows_options(p: argparse.ArgumentParser) -> None:
    """``--agent``, ``--repeats``, ``--limit``: which rows of the input a batch takes, routed where, how often."""
    p.add_argument("--agent", help="agent for rows without agent_ref (or to override it)")
    p.add_argument("--repeats", type=positive_int, default=1, help="rollouts per task (default 1)")
    p.add_argument("--limit", type=positive_int, help="use only the first N rows")


def budget_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--budget",
        type=budget_value,
        metavar="AMOUNT|Ntokens",
        help="stop starting tasks once the batch would pass this: money in pricing.currency (2.50; needs a "
        "`pricing` section) or tokens of every model entry (200000tokens); the rest become `budget` failure "
        "rows, and running the batch again (--batch ID) with a larger budget finishes it",
    )


def budget_value(text: str) -> Any:
    """argparse type of ``--budget`` (``gym_runtime.admission.parse_budget``)."""
    from gym_runtime.admission import parse_budget

    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def budgeted(budget: Any, cfg: Config, *, repeats: int) -> Any:
    """``--budget``'s gate for ``run_batch``, or None; a budget in money needs ``pricing`` (exit 2)."""
    if budget is None:
        return None
    if not budget.tokens and cfg.pricing is None:
        raise UserError(
            f"--budget {budget.limit:g} is an amount of money, but the config has no `pricing` section to "
            "estimate costs with: add one, or give the budget in tokens (--budget 200000tokens)"
        )
    from gym_runtime.service.budget import BudgetedPublish

    return BudgetedPublish(budget, repeats, cfg.pricing.currency if cfg.pricing else None)


def budget_exit(stats: Any, out: str, budget: Any, batch: str, *, kept: bool = True) -> int:
    """The one line a batch stopped by its budget ends with (exit 1: nothing lost, it can be resumed where its
    server ``kept`` it; ``run``'s embedded server without ``--store-dir`` kept nothing, and the line says so)."""
    from gym_runtime.data.collector import sidecar_paths

    others = stats.failures - stats.budget
    more = f"; {plural(others, 'other rollout')} failed" if others else ""
    then = (
        f"run again with --batch {batch} and a larger --budget to finish the batch"
        if kept
        else "this run's embedded server kept nothing of the batch: to resume one, run it with --store-dir DIR "
        "(or --nats URL), then again with the same --batch and a larger --budget"
    )
    err(
        f"budget reached: {budget.spent_line()}; {stats.budget} of {stats.rows + stats.failures} rollouts not "
        f"started (class budget, in {sidecar_paths(out)[0]}){more}; {then}"
    )
    return EXIT_FAILURES


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 to 65535 (0: any free one, where the command takes it)."""
    value = _whole(text, "a port number, 0 to 65535 (e.g. 8765)")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def check_output(path: str, *, flag: str = "-o", source: str | None = None) -> None:
    """Fail now, before any work, if ``path`` cannot be written (by trying: ``os.access`` says yes to root), or
    is ``source``, the command's ``-i`` (writing there would destroy what it reads). Missing folders are made."""
    p = Path(path)
    if source is not None and p.exists() and p.resolve() == Path(source).resolve():
        suggestion = p.with_name(f"{p.stem}_out{p.suffix or '.jsonl'}")
        raise UserError(
            f"{flag} {path} is the input file (-i {source}): it would be overwritten; give another {flag}, "
            f"e.g. {flag} {suggestion}"
        )
    if p.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file's path, e.g. {flag} {p / 'out.jsonl'}")
    existed = p.exists()
    blocking = next((a for a in reversed(p.parents) if a.exists() and not a.is_dir()), None)
    if blocking is not None:  # mkdir would say "File exists" about the wrong thing
        raise UserError(f"{flag} {path}: {blocking} is a file, not a directory; give a path outside it")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("ab"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write it ({e.strerror or e}); give a path you can write") from None
    if not existed:
        p.unlink(missing_ok=True)


def metrics_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port",
        type=port_number,
        metavar="P",
        help="serve Prometheus metrics on this port (/metrics); a `start` worker pool uses P, P+1, ...; `run` "
        "serves its worker processes' metrics merged with its own there",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="ADDR",
        help="address for --metrics-port to listen on (default 127.0.0.1, loopback, as `server`'s; 0.0.0.0 for "
        "a collector on another host)",
    )


def telemetry(
    args: argparse.Namespace, role: str, *, port_offset: int = 0, children: list[str] | None = None
) -> Telemetry:
    """Traces (``--trace-file`` / OTLP) and metrics (``--metrics-port`` / OTLP), named ``gym-runtime.ROLE``;
    ``children``: worker processes' ``/metrics`` URLs, merged into this process's endpoint."""
    from gym_runtime.observability import meters
    from gym_runtime.observability.tracing import Telemetry

    service = f"gym-runtime.{role}"
    port = getattr(args, "metrics_port", None)
    m = meters.start(
        service=service,
        role=role,
        port=None if port is None else port + port_offset,
        host=getattr(args, "metrics_host", "127.0.0.1"),
        children=children,
    )
    return Telemetry.from_options(trace_file=getattr(args, "trace_file", None), service=service, meters=m)
