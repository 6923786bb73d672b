"""``gym-runtime start``'s process pool: one child process per worker replica.

Each child runs one worker (``start --in-process --only ROLE.NAME``), so a crash
or a SIGKILL takes out one replica, never the pool: the supervisor restarts a
child that dies on its own (with backoff) and forwards SIGTERM/SIGINT to all
children, which drain (finish or hand back in-flight work) before exiting.
Children get ``PR_SET_PDEATHSIG`` (SIGTERM): if the supervisor itself is
SIGKILLed, its workers drain and exit too instead of running on unsupervised.
A worker that cannot start makes ``start`` exit 1 (reason logged once).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import anyio

from gym_runtime.errors import ClientError
from gym_runtime.observability import logs
from gym_runtime.service.ready import read_ready, say_ready

log = logs.get("gym.supervisor")

EXIT_NOT_STARTED = 1
EXIT_INTERRUPTED = 130


def term_with_parent() -> None:
    """SIGTERM this process when the thread that started it ends (runs in the child between fork and exec)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def cpu_seconds(pid: int) -> float | None:
    """A child's CPU time so far (Linux's ``/proc``; None elsewhere or once it is gone). Why: how long a child
    took to get ready moves with the machine's load; the CPU it spent doing so does not (a fork starts at 0)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 3)


class Forked:
    """A worker child forked from this process (the subset of ``Popen`` the pool uses).

    Why: a fresh interpreter spends most of a second importing the stack before it
    takes work; a fork of a parent that already imported it is ready in a fraction
    of that. Only forked while this process has one thread and no event loop
    running (``can_fork``), so the child inherits no lock held by another thread
    and no live connection.
    """

    def __init__(self, pid: int, stdout: IO[str]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    @classmethod
    def start(cls, entry: Callable[[list[str]], int], args: list[str]) -> Forked:
        sys.stdout.flush()
        sys.stderr.flush()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(r)
                os.dup2(w, 1)
                os.close(w)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.close(devnull)
                for s in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(s, signal.SIG_DFL)
                if sys.platform.startswith("linux"):
                    term_with_parent()
                code = entry(args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        os.close(w)
        return cls(pid, os.fdopen(r, "r"))

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def can_fork() -> bool:
    """Forking is safe here: POSIX, one thread, no event loop running in it."""
    if not hasattr(os, "fork") or threading.active_count() != 1:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


@dataclass
class Child:
    """One worker child: ``argv`` is its command line (``python -m gym_runtime.cli ...``); with ``entry`` (that
    CLI's ``main``) it is forked from this process and runs ``entry(argv[3:])`` when that is safe
    (``can_fork``), else started as a fresh interpreter (a restart during a batch, a threaded parent)."""

    spec: str  # ROLE.NAME
    argv: list[str]
    proc: subprocess.Popen[str] | Forked | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    ready: bool = False  # its first line said ready (see watch_ready)
    env: dict[str, str] | None = None  # added to the inherited environment (a hosted worker's layer)
    entry: Callable[[list[str]], int] | None = None

    def start(self) -> None:
        if self.entry is not None and self.env is None and self.argv[0] == sys.executable and can_fork():
            self.proc = Forked.start(self.entry, self.argv[3:])
            self.started_at = time.monotonic()
            return
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            env=None if self.env is None else {**os.environ, **self.env},
            preexec_fn=term_with_parent if sys.platform.startswith("linux") else None,
        )
        self.started_at = time.monotonic()

    def watch_ready(self, changed: threading.Event | None = None) -> threading.Event:
        """An event set once the child's first line is in (``self.ready`` says whether it was ``ready``) or
        its stdout closed (it exited before); ``changed`` is set then too (one event for several children)."""
        assert self.proc and self.proc.stdout
        done = threading.Event()
        self.ready = False  # until this start's first line says so

        proc = self.proc

        def read() -> None:
            self.ready = read_ready(proc.stdout) if proc.stdout else False
            if self.ready:
                took = round(time.monotonic() - self.started_at, 3)
                forked = isinstance(proc, Forked)
                log.info("worker.ready", worker=self.spec, forked=forked, ready_s=took, cpu_s=cpu_seconds(proc.pid))
            done.set()
            if changed is not None:
                changed.set()

        threading.Thread(target=read, daemon=True).start()
        return done


def child_argv(
    config: str | list[str], url: str | None, spec: str, passthrough: list[str], python: str | None = None
) -> list[str]:
    """A worker child's command line: no secrets here (``ps`` shows it); ``url=None``: the config's.

    ``python``: the interpreter (a hosted NeMo Gym server's built environment; default this one)."""
    configs = [config] if isinstance(config, str) else list(config)
    nats = ["--nats", url] if url else []
    return [
        python or sys.executable,
        "-m",
        "gym_runtime.cli",
        "start",
        *configs,
        *nats,
        "--only",
        spec,
        "--replicas",
        "1",
        "--in-process",
        *passthrough,
    ]


def _exit_code(c: Child, *, wait_s: float) -> int | None:
    if c.proc is None:
        return None
    try:
        return c.proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        return None


class NotStarted(Exception):
    """A worker process could not start; ``code`` is 2 when it found a user mistake (said in one line)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Stopped(Exception):
    """The supervisor was told to stop (SIGTERM/SIGINT) before its children were all ready: no error."""


def start_ready(children: list[Child], ready_timeout: float, stopping: threading.Event | None = None) -> None:
    """Start every child and wait until each says it is ready; raise ``NotStarted`` for the first that exits
    without (whichever it is: a resource with a mistyped module must not wait on a model that waits for its
    server), or that is not ready in time; ``Stopped`` when ``stopping`` is set meanwhile."""
    for c in children:
        c.start()
    # set when a child's first line is in: the wait ends then, not at the next poll (forked children are
    # ready in ~40 ms, and a 50 ms poll added 10-50 ms to every `run` on several processes)
    changed = threading.Event()
    pending = {id(c): (c, c.watch_ready(changed)) for c in children}
    deadline = time.monotonic() + ready_timeout
    while pending:
        if stopping is not None and stopping.is_set():
            raise Stopped
        changed.clear()  # before the checks: a line that comes in after them wakes the wait below
        for key, (c, done) in list(pending.items()):
            if not done.is_set():
                continue
            del pending[key]
            if not c.ready:
                exited = _exit_code(c, wait_s=5.0)
                # a child that found a user mistake (exit 2) has said so in one line: pass its code on
                raise NotStarted(
                    f"worker {c.spec} exited with code {exited} (its error is above)",
                    2 if exited == 2 else EXIT_NOT_STARTED,
                )
        if pending and time.monotonic() >= deadline:
            c = next(iter(pending.values()))[0]
            raise NotStarted(f"worker {c.spec} not ready within {ready_timeout:g}s", EXIT_NOT_STARTED)
        if pending:
            changed.wait(0.05)  # the timeout: to see ``stopping`` and the deadline


def restart_dead(children: list[Child], stopping: threading.Event) -> None:
    """Start again every child that died on its own (backoff when it keeps dying young)."""
    for c in children:
        if c.proc is not None and c.proc.poll() is not None and not stopping.is_set():
            backoff = min(30.0, 2.0 ** min(c.restarts, 5)) if time.monotonic() - c.started_at < 10 else 0.5
            log.warning("worker.died", worker=c.spec, code=c.proc.returncode, restart_in_s=backoff)
            stopping.wait(backoff)
            if not stopping.is_set():
                c.restarts += 1
                c.start()


def stop_all(children: list[Child], drain_timeout: float) -> None:
    """SIGTERM every child (they drain), then wait; kill what is still running at the deadline."""
    for c in children:
        if c.proc is not None and c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + drain_timeout
    for c in children:
        if c.proc is None:
            continue
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def run_pool(children: list[Child], *, ready_timeout: float = 60.0, drain_timeout: float = 90.0) -> int:
    stopping = threading.Event()
    code = 0

    signals: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        signals.append(signum)
        stopping.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            start_ready(children, ready_timeout, stopping)
            say_ready(sys.stdout, f" ({len(children)} processes)")
        except Stopped:
            log.info("workers.stopped", before="ready")
        except NotStarted as e:
            log.warning("worker.not_started", reason=str(e))
            code = e.code
            stopping.set()
        while not stopping.is_set():
            restart_dead(children, stopping)
            stopping.wait(0.2)
    finally:
        stop_all(children, drain_timeout)
        for s, h in old.items():
            signal.signal(s, h)
    if code == 0 and signal.SIGINT in signals:
        return EXIT_INTERRUPTED  # Ctrl-C, as every command says it; SIGTERM is a scheduler's normal stop
    return code


def role_argv(configs: list[str], url: str | None, roles: list[str], passthrough: list[str]) -> list[str]:
    """A child running every worker of ``roles`` (every role when empty) in one process
    (``start --in-process [--only ROLE ...]``)."""
    nats = ["--nats", url] if url else []
    only = [x for r in roles for x in ("--only", r)]
    return [sys.executable, "-m", "gym_runtime.cli", "start", *configs, *nats, *only, "--in-process", *passthrough]


class RoleProcesses:
    """A one-shot command's workers in child processes (``run`` on several cores): one per role, or N
    that each serve every role.

    Entering starts them and returns once every one is ready (``NotStarted`` if
    one is not); while the batch runs, a child that dies is started again (its
    work is redelivered); leaving drains and stops them.
    """

    def __init__(self, children: list[Child], *, ready_timeout: float = 120.0, drain_timeout: float = 30.0) -> None:
        self.children = children
        self.ready_timeout = ready_timeout
        self.drain_timeout = drain_timeout
        self._stopping = threading.Event()
        self._watch = threading.Thread(target=self._run, daemon=True, name="gym-role-processes")

    def _run(self) -> None:
        while not self._stopping.is_set():
            restart_dead(self.children, self._stopping)
            self._stopping.wait(0.2)

    def __enter__(self) -> RoleProcesses:
        try:
            start_ready(self.children, self.ready_timeout)
        except BaseException:
            stop_all(self.children, self.drain_timeout)
            raise
        self._watch.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._stopping.set()
        if self._watch.is_alive():
            self._watch.join()
        # after the batch nothing is in flight; interrupted, nothing is worth waiting for
        stop_all(self.children, self.drain_timeout if exc_type is None else 2.0)


class StartProcess:
    """``gym-runtime start CONFIG`` as one child process (one process per worker replica inside it),
    kept warm until ``close``: what ``Client(workers="processes")`` runs."""

    def __init__(self, proc: subprocess.Popen[bytes], config_path: str) -> None:
        self.proc = proc
        self.config_path = config_path

    @classmethod
    async def open(
        cls, config_path: str, url: str | list[str], *, auth_dir: str | Path | None, replicas: int | None
    ) -> StartProcess:
        """Start it and return once it printed the ready line (``ready.say_ready``) (a ``ClientError`` after 120 s)."""
        argv = [sys.executable, "-m", "gym_runtime.cli", "start", config_path, "--nats"]
        argv.append(url if isinstance(url, str) else ",".join(url))
        if auth_dir is not None:
            argv += ["--auth-dir", str(auth_dir)]
        if replicas:
            argv += ["--replicas", str(replicas)]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        started = cls(proc, config_path)
        assert proc.stdout is not None
        with anyio.move_on_after(120):
            if await anyio.to_thread.run_sync(read_ready, proc.stdout):
                return started
        await started.close()
        raise ClientError(
            f"the worker processes did not start (exit code {proc.poll()}); run "
            f"`gym-runtime start {config_path} --nats URL` to see why"
        )

    async def close(self) -> None:
        """SIGTERM (it drains: rollouts in flight finish), SIGKILL after 30 s."""
        proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(30):
            while proc.poll() is None:
                await anyio.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
