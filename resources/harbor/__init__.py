"""Harbor tasks, unchanged, on the sandbox fleet: each session is one task's container, a sandbox of its image.

``options.tasks`` names a Harbor task directory or a dataset of them (``gym_runtime.harbor``); a row names its task
(``harbor_task``; ``gym-runtime prepare CONFIG -i AGENT=env`` writes one per task, the instruction as the prompt).
The session's sandbox is the task's image (``harbor/hosting.py`` builds it, at ``gym-runtime run`` or ``start``
where the pool's engine lacks it; the pool: ``rootfs: writable``, since Harbor's tasks write ``/app``, ``/logs`` and
``/tests``). The model gets one tool, ``bash``, run in the container as the task's ``[agent] user`` (else the
image's user) in its working directory. ``verify`` does what Harbor's verifier does, from a state the policy
cannot touch: the container restarted first (no process of the model's turns left, its files kept), then
``/logs/verifier`` made anew and ``tests/`` copied to ``/tests``; it runs ``/tests/test.sh`` as ``[verifier] user``
with ``[verifier] env`` for at most ``[verifier] timeout_sec``, and reads ``/logs/verifier/reward.json`` or
``reward.txt`` by Harbor's rules. The
session's ``harbor.oracle`` operation (``agents.harbor_oracle``, never a model's call) is Harbor's oracle agent: it
copies ``solution/`` to ``/solution`` and runs ``solve.sh``.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, ClassVar

import msgspec

from gym_runtime.errors import Failure
from gym_runtime.harbor import (
    INFO,
    REWARD_JSON,
    REWARD_TXT,
    SOLUTION_DIR,
    TESTS_DIR,
    VERIFIER_DIR,
    ImageOptions,
    RewardError,
    Task,
    fetches,
    files_of,
    find_tasks,
    image_ref,
    parse_rewards,
    row_reward,
    tar,
    task_row,
)
from gym_runtime.messages import Response
from gym_runtime.resource import Resource, Verdict, parse_options, tool

ORACLE = "harbor.oracle"
TIMED_OUT = 124  # what a shell says of a command killed by its time limit
LOG_TAIL = 2000  # characters of test.sh's output kept in the row
_STAGED = "/.gym-harbor.tar"  # a tree on its way into the container (in /: only root writes there)
# run a command as a user (by name or id) in a directory, as ``docker exec -u USER -w DIR ... bash -c CMD``
# does: the container runs as root and drops to the user with setpriv (util-linux), HOME set from passwd
_AS = r"""u=$1 wd=$2; shift 2
cd "$wd" 2>/dev/null || cd /
case "$u" in ""|root|0) exec bash -c "$1";; esac
uid=$(id -u "$u") && gid=$(id -g "$u") || exit 125
home=$(getent passwd "$uid" | cut -d: -f6)
exec setpriv --reuid="$uid" --regid="$gid" --init-groups env HOME="${home:-/}" USER="$u" bash -c "$1"
"""


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tasks: str  # a Harbor task directory or a directory of them (absolute, or relative to the worker's cwd)
    base_images: dict[str, str] = {}  # FROM images mapped to local ones when building ("base": the fleet's base)
    bake: list[str] = []  # commands baked into each task's image (what test.sh would fetch at verify time)
    build_args: dict[str, str] = {}  # docker build --build-arg's (they resolve FROM ${NAME} too)
    command_timeout_s: float = 600.0  # the longest one bash call of the model may run (the pool's limit caps it)


class HarborRow(msgspec.Struct, kw_only=True):
    harbor_task: str


def _tree(task: Task, sub: str) -> bytes:
    return tar(files_of(task.dir / sub))


class HarborResource(Resource):
    task_fields = HarborRow
    opts: ClassVar[Options]
    tasks: ClassVar[dict[str, Task]] = {}
    images: ClassVar[dict[str, str]] = {}

    @classmethod
    async def setup(cls, options: dict[str, Any]) -> None:
        await super().setup(options)
        cls.opts = parse_options(options, Options, "harbor")
        image_opts = ImageOptions(base_images=cls.opts.base_images, bake=cls.opts.bake, build_args=cls.opts.build_args)
        cls.tasks = {t.name: t for t in find_tasks(cls.opts.tasks)}
        cls.images = {name: image_ref(t, image_opts) for name, t in cls.tasks.items()}

    async def seed(self, task: dict[str, Any]) -> None:
        name = task.get("harbor_task")
        if name not in self.tasks:
            raise Failure("invalid_task", f"harbor_task {name!r} is not a task of {self.opts.tasks}")
        self.task = self.tasks[name]
        self.box = await self.sandbox(image=self.images[name], restartable=True)  # (``verify``)
        info = json.loads(await self.box.read(INFO))
        self.image_user, self.workdir = str(info["user"]), self.task.config.environment.workdir or info["workdir"]

    async def _run(
        self, command: str, *, user: str | int | None, timeout_s: float, env: dict[str, str] | None = None
    ) -> Any:
        who = self.image_user if user is None else str(user)
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items() if k.isidentifier())
        argv = ["sh", "-c", _AS, "harbor", who, self.workdir, exports + command]
        return await self.box.exec(argv, timeout_s=timeout_s)

    @tool
    async def bash(self, command: str) -> str:
        """Run a bash command in the task's container (a new shell each call; files persist). Returns its output
        (stdout and stderr together) and exit code."""
        r = await self._run(
            "exec 2>&1\n" + command, user=self.task.config.agent.user, timeout_s=self.opts.command_timeout_s
        )
        out = r.stdout.decode("utf-8", "replace")
        if r.timed_out:
            return f"{out}\n[killed: the command ran past {self.opts.command_timeout_s:g} s]"
        return f"{out}\n[exit code {r.exit_code}]" + (" [output truncated]" if r.truncated else "")

    async def call_operation(self, op: str, arguments: str | bytes) -> str:
        if op != ORACLE:
            return await super().call_operation(op, arguments)
        if not (self.task.dir / "solution" / "solve.sh").is_file():
            raise Failure("invalid_task", f"harbor task {self.task.name} has no solution/solve.sh (no oracle to run)")
        await self._unpack(_tree(self.task, "solution"), SOLUTION_DIR)
        cfg = self.task.config
        r = await self._run(
            f"chmod +x {SOLUTION_DIR}/solve.sh\n({SOLUTION_DIR}/solve.sh) > /logs/agent/oracle.txt 2>&1",
            user=cfg.agent.user,
            timeout_s=cfg.agent.timeout_sec or self.opts.command_timeout_s,
            env={"DEBIAN_FRONTEND": "noninteractive", **cfg.solution.env},
        )
        return json.dumps({"exit_code": r.exit_code, "timed_out": r.timed_out})

    async def _unpack(self, data: bytes, into: str) -> None:
        """A tree copied into the container as root, through a file in ``/`` (root's alone: an unprivileged
        agent cannot have put a link where it is written)."""
        await self.box.write(_STAGED, data)
        r = await self._run(
            f"mkdir -p {into} && tar -xf {_STAGED} -C {into} && rm -f {_STAGED}", user="root", timeout_s=120
        )
        if r.exit_code != 0:
            raise Failure("tool_error", f"copying into {into} failed: {r.stderr.decode(errors='replace').strip()}")

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        cfg = self.task.config.verifier
        # no process of the policy's turns is left to touch what follows (a setsid'd loop rewriting reward.txt,
        # one reading /tests/test.sh for its answer), whatever its user: the container restarted, its files kept
        await self.box.restart()
        # then the verifier's directory made anew (owned by test.sh's user, writable by it alone) and /tests
        who = shlex.quote(self.image_user if cfg.user is None else str(cfg.user))
        fresh = await self._run(
            f"u=$(id -u {who}) && g=$(id -g {who}) && rm -rf -- {VERIFIER_DIR} {TESTS_DIR} {_STAGED}"
            f' && mkdir -p {VERIFIER_DIR} && chown "$u:$g" {VERIFIER_DIR} && chmod 0755 {VERIFIER_DIR}',
            user="root",
            timeout_s=60,
        )
        if fresh.exit_code != 0:  # Harbor refuses to verify over a reward it cannot remove
            how = f"exit {fresh.exit_code}" + (", timed out" if fresh.timed_out else "")
            raise Failure(
                "verify_error",
                f"making {VERIFIER_DIR} anew (stale reward files removed) failed ({how}):"
                f" {fresh.stdout.decode(errors='replace')}{fresh.stderr.decode(errors='replace')}",
            )
        await self._unpack(_tree(self.task, "tests"), TESTS_DIR)
        await self._run(f"chmod +x {TESTS_DIR}/test.sh", user="root", timeout_s=60)
        r = await self._run(
            f"({TESTS_DIR}/test.sh) > {VERIFIER_DIR}/test-stdout.txt 2>&1",
            user=cfg.user,
            timeout_s=cfg.timeout_sec,
            env=cfg.env,
        )
        if r.timed_out:  # its own limit, not the runtime's clock: the environment's (docs/trainer.md)
            raise Failure(
                "verify_error",
                f"harbor task {self.task.name}: tests/test.sh ran past its [verifier] timeout_sec={cfg.timeout_sec:g}"
                " (Harbor's VerifierTimeoutError)",
            )
        found = await self._run(
            f'for f in {REWARD_JSON} {REWARD_TXT}; do [ -f "$f" ] && echo "$f"; done; true', user="root", timeout_s=60
        )
        present = set(found.stdout.decode().split())
        try:
            log = (await self.box.read(f"{VERIFIER_DIR}/test-stdout.txt")).decode("utf-8", "replace")[-LOG_TAIL:]
        except Failure:  # test.sh removed it: the reward decides
            log = ""
        try:
            rewards = parse_rewards(
                await self.box.read(REWARD_JSON) if REWARD_JSON in present else None,
                await self.box.read(REWARD_TXT) if REWARD_TXT in present else None,
            )
            reward = row_reward(rewards)
        except RewardError as e:
            needs = fetches(self.task)
            hint = (
                f"; it fetches at verify time ({', '.join(needs)}), which --network none forbids: bake it in"
                if needs
                else ""
            )
            raise Failure(
                "verify_error", f"harbor task {self.task.name}: {e} (test.sh exited {r.exit_code}{hint})"
            ) from None
        fields = {"harbor_rewards": rewards, "verifier_exit_code": r.exit_code, "verifier_log": log}
        return Verdict(reward=reward, fields=fields)


def dataset_rows(options: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """One row per task of ``options.tasks`` (``gym-runtime prepare CONFIG -i AGENT=env``)."""
    tools = HarborResource.tool_definitions()
    return [task_row(t, tools) for t in find_tasks(parse_options(options, Options, "harbor").tasks)]


resource = HarborResource
