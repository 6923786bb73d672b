"""swe: software-engineering tasks (SWE-Gym / SWE-bench rows) graded by the task's tests.

The counterpart of NeMo Gym's ``mini_swe_agent`` (driven by ``agents.swe``). A
session owns one environment holding the
repository at the task's base commit, started on first use: a sandbox of the
entry's pool (``fleet.py``; the default when ``resources.NAME.sandbox`` names one),
the project's process sandbox (``local``; the default without a pool), or an
Apptainer instance; ``docker``/``podman`` drive the engine's command directly
(kept for the ``grade`` command outside a cluster; the fleet supersedes them). The one tool,
``bash(command)``, runs a command there (``command_timeout_s`` each; the output
is shown mini-swe-agent style: ``<returncode>`` and ``<output>``, long outputs
keep their head and tail).

``verify`` takes the model's patch (``git add -A && git diff --cached`` in the
session's environment, or the row's ``model_patch`` when it has one: re-verify,
or grading the gold ``patch`` with ``python -m gym_runtime.resources.swe.grade``),
closes the session's environment, and grades the patch in a *fresh* one
(``grading.py``): reward 1.0 iff all ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` tests pass.
Extra fields: ``instance_id``, ``model_patch``, ``resolved``, ``patch_applied``,
``tests_status`` (SWE-bench's report shape) and ``eval_timed_out``.

Rows: SWE-Gym/SWE-bench fields (``instance_id``, ``FAIL_TO_PASS``,
``PASS_TO_PASS``, ``test_patch``, ``patch``, ``problem_statement``, optional
``image_name``); the ``local`` backend also needs ``repo_files`` ({path: text}).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import msgspec

from gym_runtime.messages import Response
from gym_runtime.resource import Resource, ToolArgumentsError, Verdict, tool
from gym_runtime.resource import parse_options as _parse_options

from .containers import ContainerCommands, Engine
from .environments import Backend, CommandResult, ContainerBackend, Environment, EnvironmentError_, LocalBackend
from .fleet import FleetBackend
from .grading import Report, grade

__all__ = ["SWE", "SWEOptions", "format_observation", "make_backend", "parse_options"]


class SWEOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # auto: the fleet when the entry names a sandbox pool (resources.NAME.sandbox), else local
    backend: Literal["auto", "fleet", "local", "docker", "podman", "apptainer", "singularity"] = "auto"
    command_timeout_s: float = 60.0  # one bash command (NeMo Gym's step_timeout is 600)
    eval_timeout_s: float = 1800.0  # applying patches and running the tests (NeMo Gym: 1800)
    max_output_chars: int = 10_000  # longer outputs keep their first and last half
    test_command: str = "python -m pytest -rA -p no:cacheprovider {tests}"
    log_parser: Literal["pytest", "unittest"] = "pytest"  # how test_command's output names each test's status
    repo_dir: str = "/testbed"  # fleet: where the image holds the repository (copied into /work/repo)
    # local backend (the project's sandbox)
    max_parallel: int = 4
    memory_bytes: int = 4 << 30
    disk_bytes: int = 256 << 20
    lifetime_s: float = 7200.0  # a session's environment lives at most this long
    # container backends
    engine_binary: str = ""  # default: the engine's name on PATH
    flavour: Literal["swe-gym", "swe-bench"] = "swe-gym"
    network: str = "none"
    memory: str = "8g"
    cpus: str = "2"
    sif_template: str | None = None
    shell_setup: str = "source /opt/miniconda3/bin/activate testbed 2>/dev/null || true"
    start_timeout_s: float = 600.0  # pulling an image can take a while

    def __post_init__(self) -> None:
        if min(self.command_timeout_s, self.eval_timeout_s, self.lifetime_s, self.start_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.max_output_chars < 100 or self.max_parallel < 1:
            raise ValueError("max_output_chars must be >= 100 and max_parallel >= 1")


def make_backend(opts: SWEOptions) -> Backend:
    """The backend shared by a worker's sessions (the fleet's is per session: ``SWE.session_backend``)."""
    if opts.backend in ("local", "auto", "fleet"):
        return LocalBackend(
            max_parallel=opts.max_parallel,
            wall_s=opts.lifetime_s,
            memory_bytes=opts.memory_bytes,
            disk_bytes=opts.disk_bytes,
            max_output=4 * opts.max_output_chars,
        )
    cmds = ContainerCommands(
        engine=cast(Engine, opts.backend),  # the rest: docker, podman, apptainer, singularity
        binary=opts.engine_binary,
        flavour=opts.flavour,
        network=opts.network,
        memory=opts.memory,
        cpus=opts.cpus,
        shell_setup=opts.shell_setup,
        sif_template=opts.sif_template,
    )
    return ContainerBackend(
        cmds, lifetime_s=opts.lifetime_s, start_timeout_s=opts.start_timeout_s, max_output=4 * opts.max_output_chars
    )


def format_observation(res: CommandResult, max_chars: int, timeout_s: float) -> str:
    """What the model reads after a command (mini-swe-agent's layout, our wording)."""
    out = res.output
    if len(out) > max_chars or res.truncated:
        half = max_chars // 2
        elided = max(0, len(out) - 2 * half)
        out = (
            f"<warning>The output was too long; {elided if not res.truncated else 'many'} characters in the middle "
            f"were left out. Use commands with shorter output (head, tail, grep).</warning>\n"
            f"<output_head>\n{out[:half]}\n</output_head>\n<output_tail>\n{out[-half:]}\n</output_tail>"
        )
        return f"<returncode>{res.returncode}</returncode>\n{out}"
    if res.timed_out:
        return (
            f"<returncode>-9</returncode>\n<warning>The command was killed after {timeout_s:g} s. Avoid commands "
            f"that wait for input or run forever.</warning>\n<output>\n{out}</output>"
        )
    return f"<returncode>{res.returncode}</returncode>\n<output>\n{out}</output>"


def parse_options(raw: dict[str, Any]) -> SWEOptions:
    return _parse_options(raw, SWEOptions, "swe")


async def grade_with(opts: SWEOptions, backend: Backend, task: dict[str, Any], patch: str) -> Report:
    """``grading.grade`` under the options' evaluation timeout, test command and log parser."""
    return await grade(
        backend, task, patch, timeout_s=opts.eval_timeout_s, test_command=opts.test_command, log_parser=opts.log_parser
    )


class SWETask(msgspec.Struct, kw_only=True):
    """The task fields the environment and the grader read (SWE-bench's instance fields)."""

    instance_id: str
    FAIL_TO_PASS: list[str] | str
    PASS_TO_PASS: list[str] | str = msgspec.field(default_factory=list)
    test_patch: str | None = None
    model_patch: str | None = None


class SWE(Resource):
    """One environment per session, started lazily; grading always in a fresh one."""

    task_fields = SWETask
    tool_arguments = "nemo_gym"
    _opts: SWEOptions = SWEOptions()
    _backend: Backend | None = None

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        opts = parse_options(options)
        await super().setup(options)
        cls._opts, cls._backend = opts, make_backend(opts)
        if isinstance(cls._backend, ContainerBackend):
            await cls._backend.reap_orphans()  # containers left by killed workers on this host

    @classmethod
    def backend(cls) -> Backend:
        if cls._backend is None:
            cls._backend = make_backend(cls._opts)
        return cls._backend

    def __init__(self) -> None:
        self.task: dict[str, Any] = {}
        self.env: Environment | None = None

    def session_backend(self) -> Backend:
        """The fleet (this session's sandboxes of the entry's pool) when the config names one, else the
        worker's shared backend."""
        fleet = self._opts.backend == "fleet" or (self._opts.backend == "auto" and self.sandboxes.pool)
        if not fleet:
            return self.backend()
        o = self._opts
        return FleetBackend(
            self.sandbox,
            flavour=o.flavour,
            repo_dir=o.repo_dir,
            shell_setup=o.shell_setup,
            start_timeout_s=o.start_timeout_s,
        )

    async def seed(self, task: dict[str, Any]) -> None:
        self.task = task

    async def _environment(self) -> Environment:
        if self.env is None:
            self.env = await self.session_backend().start(self.task)
        return self.env

    @tool(
        description="Run a bash command in the repository (the working directory). Each command runs in a new "
        "shell. To finish, run `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`."
    )
    async def bash(self, command: Annotated[str, msgspec.Meta(description="The bash command to run")]) -> str:
        if not command.strip():
            raise ToolArgumentsError("the command is empty")
        try:
            env = await self._environment()
            res = await env.run(command, self._opts.command_timeout_s)
        except (EnvironmentError_, ValueError) as e:
            return f"<returncode>-1</returncode>\n<error>{e}</error>"
        return format_observation(res, self._opts.max_output_chars, self._opts.command_timeout_s)

    async def model_patch(self) -> str:
        """The diff of the session's repository against the base commit ('' when never started)."""
        if self.env is None:
            return ""
        res = await self.env.run(self.env.diff_command, self._opts.command_timeout_s)
        return res.output if res.returncode == 0 else ""

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        given = task.get("model_patch")
        try:
            patch = given if isinstance(given, str) else await self.model_patch()
        except EnvironmentError_:
            patch = ""
        await self.close()  # free the slot before grading in a fresh environment
        report = await grade_with(self._opts, self.session_backend(), task, patch)
        fields = {"instance_id": task.get("instance_id"), "model_patch": patch, **report.fields()}
        return Verdict(reward=1.0 if report.resolved else 0.0, fields=fields)

    async def close(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            await env.close()
