"""``gym-runtime run``: collect verified rollouts for an input file, end to end.

Where the workers run (``--processes``): ``one`` runs them all in this process;
``per-role`` starts one child process per role (models, resources, agents), so
that the command uses the machine's cores; a number N starts N child processes
that each serve every role, for a machine with more cores than roles (each adds
about one core's worth of rollouts until the cores, nats-server's included, are
busy). The children are forks of this command, which has already imported the
stack: ready 0.17-0.35 s after the fork on a 2-core machine at load 8-10, where
fresh interpreters took 4.2-4.8 s at the same load.

``auto`` (the default) runs a batch of at least ``MULTI_PROCESS_MIN_ROLLOUTS`` in one child
process per core, each serving every role, and a smaller one in this process: measured with
``tests/bench/process_modes.py`` (the whole command, per mode and batch size, on 2 cores, with
nothing else running): at 1,000 rollouts every mode was within 2% (the children's start-up and
extra round trips are not paid back yet); from 2,000 two processes were the fastest, with the
in-process scripted model (2,000: 1,255/s against one's 1,135; 10,000: 1,945 against 1,573;
100,000: 2,299 against 1,677) and with the ``openai`` adapter to a local server alike (the
HTTP client's work is spread too); ``per-role`` (three children on two cores) was never the
fastest. On a machine busy with other work one process can be ahead at 2,000 (up to 18% at
load 3): the rule is for a machine given to the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gym_runtime.cli import _common as cli
from gym_runtime.cli._gc import freeze_startup
from gym_runtime.errors import UserError
from gym_runtime.observability import progress
from gym_runtime.plugins import example_input

if TYPE_CHECKING:
    from gym_runtime.config import Config, ResolvedConfig
    from gym_runtime.data.inputs import Plan
    from gym_runtime.nemo_gym.hosting.env import HostedEnv


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="collect verified rollouts for an input file, end to end")
    cli.config_argument(p, bundled=True)
    what = "input tasks JSONL (NeMo Gym format); default for a bundled environment's name: its data/example.jsonl"
    cli.input_argument(p, what)
    p.add_argument("-o", "--output", required=True, help="output rollouts JSONL")
    cli.rows_options(p)
    p.add_argument("--concurrency", type=cli.positive_int, help="rollouts in flight per agent worker")
    p.add_argument("--nats", help="use this NATS server instead of starting an embedded one")
    p.add_argument("--batch", help="batch id (default: random)")
    p.add_argument(
        "--store-dir",
        metavar="DIR",
        help="where the embedded server keeps its store, kept after the run (default: a temporary one, deleted): "
        "a batch stopped by its --budget resumes from it with the same --store-dir and --batch",
    )
    p.add_argument(
        "--processes",
        type=processes_value,
        default="auto",
        metavar="auto|one|per-role|N",
        help="where the workers run: one = all in this process, per-role = one child process per "
        "role, N = N child processes that each serve every role; auto (default) = one process per core, "
        f"each serving every role, from {MULTI_PROCESS_MIN_ROLLOUTS:,} rollouts on several cores, else one",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines (same as --quiet)")
    cli.budget_option(p)
    progress.add_arguments(p)
    cli.metrics_options(p)
    cli.any_tools_option(p)
    cli.auth_option(p)
    cli.common_options(p)


# where `--processes N` (N = cores) started to beat one process here, with the scripted model and over HTTP
# alike (2026-11-25, nothing else running: 2,000 scripted rollouts 1,255/s against 1,135, over HTTP 1,009
# against 877; at 1,000 every mode within 2%)
MULTI_PROCESS_MIN_ROLLOUTS = 2000


def processes_value(text: str) -> str | int:
    """argparse type of ``--processes``: ``auto``, ``one``, ``per-role`` or a number of worker processes."""
    if text in ("auto", "one", "per-role"):
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected auto, one, per-role or a number of processes, got {text!r}")
    return int(text)


def worker_groups(args: argparse.Namespace, cfg: Any, expected: int) -> list[list[str]] | None:
    """The roles each worker child serves (``[]``: every role), or None to run the workers in this process."""
    roles = [r for r in ("models", "resources", "agents") if getattr(cfg, r)]
    mode = args.processes
    if mode == "auto":
        cores = os.cpu_count() or 1
        mode = cores if cores >= 2 and len(roles) >= 2 and expected >= MULTI_PROCESS_MIN_ROLLOUTS else "one"
    if mode == "one":
        return None
    if mode == "per-role":
        return [[r] for r in roles]
    return [[] for _ in range(mode)]


async def server_answers(url: str | list[str], cfg: Any, auth: Any) -> None:
    """Connect as the batch will and let go: a one-shot command says in one line that its server is dead or
    refuses it, before it starts worker children that (as services) would wait for that server."""
    from gym_runtime.observability.tracing import Telemetry
    from gym_runtime.service.runner import close_buses, open_buses

    await close_buses(
        await open_buses(
            url,
            ["publisher"],
            namespace=cfg.namespace,
            telemetry=Telemetry(),
            name="gym-run",
            auth=auth,
            jetstream=cfg.jetstream,
        )
    )


def _passthrough(args: argparse.Namespace, cfg: Any, auth: Any) -> list[str]:
    """The flags of this command every worker child gets too (no secret: ``ps`` shows them)."""
    passthrough = [x for o in args.overrides for x in ("--set", o)] + ["--log-level", args.log_level]
    if args.concurrency:
        passthrough += [x for a in cfg.agents for x in ("--set", f"agents.{a}.concurrency={args.concurrency}")]
    if args.trace_file:
        passthrough += ["--trace-file", args.trace_file]
    if auth is not None:  # a path, never a secret
        passthrough += ["--auth-dir", str(auth.auth_dir)]
    return passthrough


@contextlib.contextmanager
def worker_processes(
    args: argparse.Namespace,
    cfg: Any,
    url: str | list[str],
    auth: Any,
    groups: list[list[str]],
    metrics_ports: list[int] | None = None,
) -> Iterator[None]:
    """One ``start --in-process`` child per entry of ``groups``, every one ready before the batch is published."""
    from gym_runtime.cli import main as cli_main
    from gym_runtime.cli._common import config_path
    from gym_runtime.service.supervisor import Child, role_argv

    configs = [str(config_path(c)) for c in args.config]
    passthrough = _passthrough(args, cfg, auth)
    # the URL of this command's own server, or the one named on its command line; else the children read
    # the config's (it may carry credentials: never put it in argv)
    child_url = args.nats or (url if cfg.nats == "embedded" and isinstance(url, str) else None)
    children = []
    for i, roles in enumerate(groups, start=1):
        # each child serves its metrics on loopback only; this process merges them on --metrics-port
        metrics = (
            [] if not metrics_ports else ["--metrics-port", str(metrics_ports[i - 1]), "--metrics-host", "127.0.0.1"]
        )
        name = ",".join(roles) or f"workers-{i}"
        said = ["--verdicts-said-by-caller"]  # this command refuses a dead model endpoint in its one line
        children.append(Child(name, role_argv(configs, child_url, roles, passthrough + metrics + said), entry=cli_main))
    with _supervised(children):
        yield


@contextlib.contextmanager
def _supervised(children: list[Any], ready_timeout: float = 120.0) -> Iterator[None]:
    """The children kept for the block; one that says in one line why it cannot start ends the run, exit 2."""
    from gym_runtime.service.supervisor import NotStarted, RoleProcesses

    try:
        with RoleProcesses(children, ready_timeout=ready_timeout):
            yield
    except NotStarted as e:
        if e.code == 2:  # the child said what is wrong, in one line
            raise SystemExit(2) from None
        raise RuntimeError(str(e)) from None


HOSTED_READY_S = 300.0  # seconds a hosted server's worker child has to be ready (its own start-up code)


@contextlib.contextmanager
def hosted_processes(
    args: argparse.Namespace, cfg: Any, url: str | list[str], auth: Any, hosted: dict[str, HostedEnv]
) -> Iterator[None]:
    """One ``start --in-process --only ROLE.NAME`` child per hosted resource or agent (``hosted`` is keyed
    by ``ROLE.NAME``), on its environment's Python."""
    from gym_runtime.cli._common import config_path
    from gym_runtime.nemo_gym.hosting.env import HOSTED_ENV
    from gym_runtime.service.supervisor import Child, role_argv

    configs = [str(config_path(c)) for c in args.config]
    child_url = args.nats or (url if cfg.nats == "embedded" and isinstance(url, str) else None)
    children = []
    for spec, env in hosted.items():
        argv = role_argv(configs, child_url, [spec], _passthrough(args, cfg, auth))
        children.append(Child(spec, [env.python, *argv[1:]], env={HOSTED_ENV: env.prefix}))
    # a hosted server's start is its own code (Ray's start, large imports: tens of seconds on a loaded
    # machine, gdpval and code_gen passed 120 s at load 20), so its children get longer to be ready
    with _supervised(children, ready_timeout=HOSTED_READY_S):
        yield


def input_or_example(args: argparse.Namespace, cfg: Config) -> str:
    """``--input``, or the example input of a bundled environment the config names (``run weather``)."""
    if args.input is not None:
        return str(args.input)
    bundled = len(args.config) == 1 and not Path(args.config[0]).exists()  # a bundled environment's name
    example = example_input(Path(cfg.base_dir) / "config.yaml") if bundled else None
    if example is None:
        raise UserError("run: --input is required (only a bundled environment's name has a default input)")
    return str(example)


def hosted_environments(
    cfg: Config, resolved: ResolvedConfig, plan: Plan
) -> tuple[dict[str, HostedEnv], dict[str, HostedEnv]]:
    """Hosted NeMo Gym servers' environments, built (or found) now: ``guests``, the servers in a guest
    (``isolation: process``, the default), whose worker runs here like any other, its guest on the environment's
    interpreter; and, by role spec, those whose worker runs in a child process on that interpreter (a server with
    ``isolation: none``, a hosted agent the rows go to)."""
    from gym_runtime.nemo_gym.hosting.env import ensure as hosted_env
    from gym_runtime.service.runner import batch_pairs

    guests = {n: hosted_env(r.nemo_gym) for n, r in cfg.resources.items() if r.hosted and r.isolation != "none"}
    hosted = {
        f"resources.{n}": hosted_env(r.nemo_gym) for n, r in cfg.resources.items() if r.hosted and n not in guests
    }
    hosted.update(
        {
            f"agents.{n}": hosted_env(cfg.agents[n].nemo_gym, kind="responses_api_agents")
            for role, n in batch_pairs(resolved, plan)  # the agents the rows go to, no other
            if role == "agents" and cfg.agents[n].hosted
        }
    )
    return guests, hosted


def main(args: argparse.Namespace) -> int:
    from gym_runtime.config import resolve_config
    from gym_runtime.data.validation import plan_publish
    from gym_runtime.harbor.hosting import ensure_config_images
    from gym_runtime.ops.nats_server import free_port
    from gym_runtime.service.loop import run_async
    from gym_runtime.service.runner import RunHooks, run_batch

    cfg = cli.load(args)
    args.batch = args.batch or uuid.uuid4().hex[:12]  # named now: an interrupted run says which batch to resume
    note = None if progress.options_from(args).quiet else cli.say  # what a slow step waits for (not with --quiet)
    with progress.Heartbeat(note, "loading the config's agents, environments and model adapters"):
        resolved = resolve_config(cfg)  # the plugins' option checks, before anything starts
    embedded = (args.nats or cfg.nats) == "embedded"
    if args.store_dir and not embedded:
        raise UserError("--store-dir is the embedded server's store: with --nats (or the config's `nats` URL) that "
                        "server keeps its own; drop --store-dir")  # fmt: skip
    args.input = input_or_example(args, cfg)
    cli.check_output(args.output, source=args.input)
    if not cfg.agents:
        raise UserError("the config names no agents")
    # the rows routed and checked against their environments (what `validate` checks), before anything starts
    with progress.Heartbeat(note, f"checking {args.input}'s rows against their environments"):
        plan = plan_publish(cfg, args.input, agent=args.agent, limit=args.limit, any_tools=args.any_tools)
    budget = cli.budgeted(args.budget, cfg, repeats=args.repeats)
    # Harbor tasks' images: built now where the pools' engines lack them (progress on stderr), before anything starts
    run_async(lambda: ensure_config_images(cfg, note=cli.say))
    guests, hosted = hosted_environments(cfg, resolved, plan)
    # with a hosted server the other workers run in this process, as before: a hosted server's start (its guest's)
    # may take minutes under load, past a worker child's ready timeout
    groups = None if hosted or guests else worker_groups(args, cfg, plan.count * args.repeats)
    # the run's metrics on the one port the user gave, whatever the process mode: children's merged in
    child_ports = [free_port() for _ in groups or []] if args.metrics_port is not None else []
    tel = cli.telemetry(args, "run", children=[f"http://127.0.0.1:{p}/metrics" for p in child_ports])
    freeze_startup()  # everything imported and checked, nothing of the batch made yet (children fork after)
    try:
        with cli.server_url(args, cfg) as url:
            auth = cli.client_auth(args)
            # an open embedded server was started and found ready just now: only another one (or credentials)
            # can be dead or refuse us
            ours = args.nats is None and cfg.nats == "embedded" and auth is None
            if (groups or hosted) and not ours:
                run_async(lambda: server_answers(url, cfg, auth))
            with (
                worker_processes(args, cfg, url, auth, groups, child_ports) if groups else contextlib.nullcontext(),
                hosted_processes(args, cfg, url, auth, hosted) if hosted else contextlib.nullcontext(),
                progress.Tracker("run", progress.options_from(args)) as tracker,
            ):
                cli.when_interrupted(lambda: run_kept(args, tracker, embedded))
                result = run_async(
                    lambda: run_batch(
                        resolved,
                        url,
                        input_path=args.input,
                        out=args.output,
                        telemetry=tel,
                        agent=args.agent,
                        repeats=args.repeats,
                        limit=args.limit,
                        batch=args.batch,
                        hooks=RunHooks(on_progress=tracker, on_result=tracker.result, note=note),
                        auth=auth,
                        start_local_workers=groups is None,
                        plan=plan,
                        elsewhere=frozenset((s.split(".", 1)[0], s.split(".", 1)[1]) for s in hosted),
                        check_workers=not ours,
                        budget=budget,
                    )
                )
    finally:
        tel.shutdown()
    cli.print_stats(result.batch, result.stats, args.output, elapsed_s=result.elapsed_s)
    if result.stopped is not None:  # every endpoint of a model out of service: one line, not a row each
        cli.err(f"{result.stopped}; the batch was stopped, its rollouts not run are cancelled rows ({args.output})")
        return cli.EXIT_FAILURES
    if result.stats.budget:
        return cli.budget_exit(
            result.stats, args.output, budget, result.batch, kept=not embedded or bool(args.store_dir)
        )
    return cli.failures_exit(result.stats, args.output)


def run_kept(args: argparse.Namespace, tracker: progress.Tracker, embedded: bool) -> str:
    """What an interrupted ``run`` has kept: -o is written whole when the batch ends, so the rollouts done are
    on the bus, or nowhere when this run's own embedded server kept no store."""
    done = f"{tracker.done} of {tracker.total} rollouts were done" if tracker.total else "no rollout was done yet"
    if embedded and not args.store_dir:
        return (
            f"{done}; {args.output} is written whole when a batch ends, and this run's embedded server kept nothing "
            f"of it: run again (with --store-dir DIR, an interrupted batch resumes with the same --batch)"
        )
    where = f"in the store {args.store_dir}" if args.store_dir else "on the bus"
    return (
        f"{done}; what the batch holds is kept {where} as batch {args.batch} ({args.output} is written whole "
        f"when a batch ends): run the same command with --batch {args.batch} to finish it"
    )
