"""The parent side of the sandbox: starts ``child.py`` for each run, watches it from outside, reads it with caps.

How a run is isolated is described in ``child.py`` (the child isolates itself before it reads any
untrusted input). What the parent adds, none of which the program can switch off:

- the wall clock (the whole process tree is killed at the deadline);
- the CPU limit of the sandbox *as a whole* (``_CpuWatch``: the cgroup's CPU usage, or without a
  cgroup the summed CPU time of the sandbox's processes, read from ``/proc``; over ``cpu_s`` the tree
  is killed);
- caps on what it reads: every header line (``Limits.message_bytes``) and every body (``max_body`` of
  :meth:`JailSession.recv`) in bytes, as they arrive, before anything is decoded.

Each run's CPU seconds (the same count as the limit's) are read at its end and handed to ``CPU_SINK``'s
value when the run started under one: a resource worker sets it to its session's cost around seed, tool and
verify calls, so the CPU a verify's programs used reaches the rollout's row (``cost.sandbox_cpu_ms``).

``python -m gym_runtime.jail.runner`` prints what this machine offers.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any

import anyio
from anyio import DelimiterNotFound, IncompleteRead
from anyio.streams.buffered import BufferedByteReceiveStream

from gym_runtime.jail import cgroups
from gym_runtime.jail.child import _SYSCALLS, Layers, landlock_abi

CHILD_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")

__all__ = [
    "CHILD_PY",
    "CPU_SINK",
    "Layers",
    "Limits",
    "JailBodyTooLarge",
    "JailError",
    "JailExited",
    "JailRunner",
    "JailSession",
    "JailTimeout",
    "clean_env",
    "landlock_abi",
    "probe",
]


# Told the CPU seconds of each run started while it is set, once, at the run's end (whichever task ends it).
# Task-local: a resource worker sets it around one session's calls, so concurrent sessions never mix.
CPU_SINK: ContextVar[Callable[[float], None] | None] = ContextVar("gym_sandbox_cpu_sink", default=None)


class JailError(RuntimeError):
    """The sandbox could not be set up (a required isolation layer is missing) or broke down."""


# ----------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run: the kernel's (cgroup, rlimits) plus the parent's (clock, CPU, caps)."""

    wall_s: float = 60.0  # the parent kills the whole process tree after this long
    cpu_s: float = 60.0  # CPU seconds of the sandbox as a whole (parent + cgroup); RLIMIT_CPU per process too
    memory_bytes: int = 4 << 30  # the sandbox as a whole (cgroup), and RLIMIT_AS per process
    file_bytes: int = 64 << 20  # RLIMIT_FSIZE, and the size of the tmpfs working directory
    message_bytes: int = 1 << 20  # the longest header line the parent accepts (bodies: recv's max_body)
    nproc: int = 64  # RLIMIT_NPROC (processes + threads)
    nofile: int = 256  # RLIMIT_NOFILE
    cgroup: bool = True  # a cgroup where writable; False: always the single-process fallback
    exec_workdir: bool = False  # may files of the working directory be executed (a shell's scripts)?


def probe() -> dict[str, Any]:
    """What this machine offers, without starting a sandbox (cheap; for logs and tests)."""
    return {
        "platform": sys.platform,
        "machine": platform.machine(),
        "root": hasattr(os, "geteuid") and os.geteuid() == 0,
        "landlock_abi": landlock_abi(),
        "seccomp_arch": platform.machine() in _SYSCALLS,
    }


# ----------------------------------------------------------------------------- parent side


def clean_env(workdir: str) -> dict[str, str]:
    """The complete environment of a sandboxed program: nothing of the worker's."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


class JailTimeout(Exception):
    """The run passed its wall-clock limit; the process tree was killed."""


class JailExited(Exception):
    """The child ended (or broke the protocol, or was killed at its CPU limit) before sending what was expected."""

    def __init__(self, message: str, returncode: int | None, stderr: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr


class JailBodyTooLarge(JailExited):
    """A message announced a body over the reader's cap; nothing of it was read (the run cannot go on)."""

    def __init__(self, header: Any, size: int, stderr: str) -> None:
        super().__init__(f"body of {size} bytes over the limit", None, stderr)
        self.header = header
        self.size = size


# ----------------------------------------------------------------------------- CPU, from outside


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s process tree from /proc: each process's own time plus its reaped children's."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    todo, seen = [pid], set[int]()
    while todo and len(seen) < 4096:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rindex(b")") + 2 :].split()
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children", "rb") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total / tick


class _Watched:
    """One live sandbox as the CPU watch sees it."""

    __slots__ = ("pid", "cgroup", "cpu_s", "alive", "exceeded")

    def __init__(self, pid: int, cgroup: cgroups.JailCgroup | None, cpu_s: float) -> None:
        self.pid, self.cgroup, self.cpu_s = pid, cgroup, cpu_s
        self.alive = True
        self.exceeded = False

    def usage(self) -> float:
        if self.cgroup is not None:
            used = self.cgroup.cpu_s()
            if used is not None:
                return used
        return _proc_cpu_s(self.pid)


class _CpuWatch:
    """A thread that kills any sandbox of its runner whose CPU time passes the limit.

    Why a thread: the CPU must be counted while nobody awaits the sandbox (a swe session idles for
    minutes between commands; a code_gen run is busy comparing), and sessions are entered and left
    from different tasks, so no task group can own a watcher. It only reads counters and sends SIGKILL.
    """

    INTERVAL_S = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._live: set[_Watched] = set()
        self._thread: threading.Thread | None = None

    def add(self, w: _Watched) -> None:
        with self._lock:
            self._live.add(w)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gym-sandbox-cpu", daemon=True)
                self._thread.start()
            self._wake.notify()

    def remove(self, w: _Watched) -> None:
        with self._lock:  # after this no kill can reach the (soon reaped, then reusable) pid
            w.alive = False
            self._live.discard(w)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._live:
                    if not self._wake.wait(timeout=30):
                        self._thread = None
                        return
                live = list(self._live)
            for w in live:
                try:
                    over = w.usage() > w.cpu_s
                except Exception:  # noqa: BLE001 - a counter that vanished: the sandbox is ending
                    continue
                if over:
                    with self._lock:
                        if w.alive and not w.exceeded:
                            w.exceeded = True
                            _killpg(w.pid)
                            if w.cgroup is not None:
                                w.cgroup.kill()
            time.sleep(self.INTERVAL_S)


class JailSession:
    """One running child: send requests, receive messages, all under one wall-clock deadline.

    A message from the child is a JSON header line, then, when the header says ``"body": n``, ``n``
    raw bytes. The header is read with ``Limits.message_bytes`` as its cap; a body's size is checked
    against the reader's ``max_body`` before a byte of it is read.
    """

    def __init__(self, proc: Any, limits: Limits, deadline: float, stderr_file: Any, watched: _Watched) -> None:
        self.proc = proc
        self.limits = limits
        self.deadline = deadline
        self._stdout = BufferedByteReceiveStream(proc.stdout)
        self._stderr = stderr_file
        self._watched = watched
        self.layers: dict[str, Any] = {}

    @property
    def stderr(self) -> str:
        """The first 64 KiB the child wrote to its stderr (a file, capped by RLIMIT_FSIZE)."""
        try:
            return os.pread(self._stderr.fileno(), 64 << 10, 0).decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    def cpu_s(self) -> float:
        """The CPU seconds the sandbox has used so far (the count its CPU limit is judged by)."""
        return self._watched.usage()

    @property
    def cpu_exceeded(self) -> bool:
        """The CPU watch killed this sandbox at its CPU limit."""
        return self._watched.exceeded

    def _remaining(self) -> float:
        return max(0.0, self.deadline - anyio.current_time())

    def _ended(self, what: str) -> JailExited:
        if self._watched.exceeded:
            return JailExited(f"CPU limit of {self.limits.cpu_s:g} s", self.proc.returncode, self.stderr)
        return JailExited(what, self.proc.returncode, self.stderr)

    async def send(self, obj: Any) -> None:
        data = (json.dumps(obj) + "\n").encode("ascii")
        try:
            with anyio.fail_after(self._remaining()):
                await self.proc.stdin.send(data)
        except TimeoutError:
            raise JailTimeout(f"wall-clock limit of {self.limits.wall_s:g} s") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            raise self._ended("child stopped reading") from None

    async def recv(self, *, max_body: int = 0) -> tuple[Any, bytes | None]:
        """The next message: its header (parsed JSON) and its body (None when it has none)."""
        try:
            with anyio.fail_after(self._remaining()):
                line = await self._stdout.receive_until(b"\n", self.limits.message_bytes)
                header = _parse_header(line)
                size = header.get("body") if isinstance(header, dict) else None
                if size is None:
                    return header, None
                if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                    raise JailExited("malformed body size", None, self.stderr)
                if size > max_body:
                    raise JailBodyTooLarge(header, size, self.stderr)
                body = await self._stdout.receive_exactly(size) if size else b""
                return header, body
        except TimeoutError:
            raise JailTimeout(f"wall-clock limit of {self.limits.wall_s:g} s") from None
        except DelimiterNotFound:
            raise JailExited(
                f"message over the limit of {self.limits.message_bytes} bytes", None, self.stderr
            ) from None
        except (IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise self._ended("child ended") from None


def _parse_header(line: bytes) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # (nesting deeper than the parser goes)
        raise JailExited("child sent a malformed message", None, "") from None


# a leftover working directory is removed once untouched this long: a /tmp shared with workers in another PID
# namespace (containers that mount one /tmp) holds live sandboxes whose PIDs this namespace does not see
LEFTOVER_AGE_S = 3600.0


def sweep_leftovers() -> None:
    """Remove the cgroups and working directories of sandboxes whose worker was killed mid-run (a SIGKILL
    runs no cleanup; each is named for its worker's PID, ``cgroups.owner_gone``). Without this, every such
    kill leaves a memory cgroup and a directory behind, for the life of the machine."""
    cgroups.sweep()  # siblings of this worker's own cgroup: their workers shared its PID namespace
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        try:
            stale = cgroups.owner_gone(name) and time.time() - os.stat(path).st_mtime > LEFTOVER_AGE_S
        except OSError:
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)


class JailRunner:
    """Starts sandboxed children; at most ``max_parallel`` at once (the rest wait their turn).

    Usage::

        runner = JailRunner(max_parallel=4)
        async with runner.session("payload.py", Limits(wall_s=10)) as s:
            await s.send({...}); header, body = await s.recv(max_body=1 << 20)

    On leaving the block the child's whole process tree is killed and its working
    directory removed, whatever happened inside.
    """

    def __init__(self, max_parallel: int = 1, *, python: str | None = None) -> None:
        self.max_parallel = max(1, int(max_parallel))
        self.python = python or sys.executable
        self._sem = anyio.Semaphore(self.max_parallel)
        self._cpu = _CpuWatch()
        self.running = 0  # children alive right now (tests and stats)
        self.swept = False  # what dead workers left is removed before this runner's first sandbox

    def session(self, payload: str, limits: Limits, *, entry: str = "main") -> Any:
        return _SessionContext(self, payload, limits, entry)


class _SessionContext:
    def __init__(self, runner: JailRunner, payload: str, limits: Limits, entry: str) -> None:
        self.runner, self.payload, self.limits, self.entry = runner, os.path.abspath(payload), limits, entry
        self._proc: Any = None
        self._cgroup: cgroups.JailCgroup | None = None
        self._watched: _Watched | None = None
        self._workdir: str | None = None
        self._stderr: Any = None
        self._acquired = False
        self._sink = CPU_SINK.get()  # who is told this run's CPU seconds (the caller's, at the start)

    async def __aenter__(self) -> JailSession:
        await self.runner._sem.acquire()
        self._acquired = True
        try:
            return await self._start()
        except BaseException:
            await self._cleanup()
            raise

    async def _start(self) -> JailSession:
        lim = self.limits
        if not self.runner.swept:
            self.runner.swept = True
            await anyio.to_thread.run_sync(sweep_leftovers)
        # named for the worker process, as its cgroups are: what a process left behind is told apart
        self._workdir = tempfile.mkdtemp(prefix=f"gym-sandbox-{os.getpid()}-")
        if lim.cgroup:
            # + 4: the sandbox's own helper processes (outer child, PID-namespace init)
            self._cgroup = await anyio.to_thread.run_sync(cgroups.create, lim.memory_bytes, lim.nproc + 4)
        spec = {
            **asdict(lim),
            "workdir": self._workdir,
            "payload": self.payload,
            "entry": self.entry,
            "parent_pid": os.getpid(),
            "ruid": 0x10000 + secrets.randbelow(0x3FFF0000),
            "cgroup_procs": self._cgroup.procs_files if self._cgroup else [],
            "cgroup_version": self._cgroup.version if self._cgroup else 0,
        }
        # stderr goes to a file outside the working directory: nothing to drain, and
        # RLIMIT_FSIZE caps it.
        self._stderr = tempfile.TemporaryFile(prefix="gym-sandbox-stderr-")
        self._proc = await anyio.open_process(
            [self.runner.python, "-I", CHILD_PY, "--child", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=self._workdir,
            env=clean_env(self._workdir),
            start_new_session=True,
        )
        self.runner.running += 1
        self._watched = _Watched(self._proc.pid, self._cgroup, lim.cpu_s)
        self.runner._cpu.add(self._watched)
        session = JailSession(self._proc, lim, anyio.current_time() + lim.wall_s, self._stderr, self._watched)
        try:
            hello, _ = await session.recv()
        except (JailExited, JailTimeout) as e:
            # before any untrusted input: a broken machine, not a broken program
            raise JailError(f"sandbox did not start ({e}): {session.stderr[-2000:]}") from None
        if not (isinstance(hello, dict) and hello.get("kind") == "sandbox"):
            raise JailError(f"sandbox did not report its layers: {session.stderr[-2000:]}")
        session.layers = hello.get("layers") or {}
        if not hello.get("ok"):
            raise JailError("sandbox unavailable: missing " + "; ".join(session.layers.get("missing") or ["?"]))
        return session

    async def __aexit__(self, *exc: Any) -> None:
        await self._cleanup()

    def _count_cpu(self, watched: _Watched) -> None:
        """Tell the sink the run's CPU seconds: read before the kill (the /proc fallback needs the processes)."""
        try:
            used = watched.usage()
        except Exception:  # noqa: BLE001 - a counter that vanished: nothing to tell
            return
        assert self._sink is not None
        self._sink(used)

    async def _cleanup(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._watched is not None:
                self.runner._cpu.remove(self._watched)
                if self._sink is not None:
                    self._count_cpu(self._watched)
                self._watched = None
            proc = self._proc
            if proc is not None:
                _killpg(proc.pid)
                with anyio.move_on_after(10):
                    try:
                        await proc.aclose()  # closes the pipes, reaps the child
                    except Exception:
                        pass
                self.runner.running -= 1
                self._proc = None
            if self._cgroup is not None:
                await anyio.to_thread.run_sync(self._cgroup.remove, cgroups.REMOVE_WITHIN_S)
                self._cgroup = None
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None
            if self._workdir is not None:
                await anyio.to_thread.run_sync(shutil.rmtree, self._workdir, True)
                self._workdir = None
            if self._acquired:
                self._acquired = False
                self.runner._sem.release()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    print(json.dumps(probe(), indent=2))
