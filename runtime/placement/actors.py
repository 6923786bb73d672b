"""A Ray actor holding one worker process: ``start --in-process --only ROLE.NAME``, as ``start`` runs a replica.

Why a process and not the worker in the actor's own loop: the worker then is exactly what ``start``, Compose,
Kubernetes and Slurm run (its bus, its drain on SIGTERM, its metrics port, its one-line errors), and Ray's
worker process keeps none of its state. The actor only holds Ray's resources for it and ties their lives:

- the worker process dies on its own after it was ready: the actor exits too (``os._exit``), so Ray restarts
  it (``max_restarts``) and the new actor starts a new worker; the dead one's unacknowledged tasks are
  redelivered as with ``start`` (restarts are Ray's: nothing else restarts the worker);
- the actor's process dies (its node lost, ``ray.kill``): the worker gets SIGTERM (``PR_SET_PDEATHSIG``, tied
  to the thread that started it, which lives as long as the worker) and drains;
- ``stop``: SIGTERM, the worker drains (finishes or hands back its in-flight work), SIGKILL past the deadline.

A worker that exits before it is ready (a user mistake: exit 2, one line) is not restarted: ``ready`` says
why, with the last line it wrote, and the pool removes the actor.

On a secured bus the actor is handed its entry's files alone (the CA and its role's or pool's credential, never
``admin.creds`` nor another role's), writes them into a directory of its own (0700) and points its worker there:
no ``--auth-dir`` of the operator's, no ``$GYM_AUTH_DIR``, reaches the worker. The directory goes when the worker
does.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import threading

from gym_runtime.ops.credentials import private_auth_dir
from gym_runtime.ops.security import AUTH_DIR_ENV
from gym_runtime.service.ready import read_ready
from gym_runtime.service.supervisor import term_with_parent

__all__ = ["NotReady", "WorkerProcess"]


class NotReady(Exception):
    """The worker exited before it said it was ready: ``code`` its exit code (2: a user mistake), the message
    its last line."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple[type[NotReady], tuple[str, int]]:  # raised in the actor, read by the driver
        return NotReady, (str(self), self.code)


class WorkerProcess:
    """Made a Ray actor by ``pools`` (``ray.remote(**options)(WorkerProcess)``, threaded: ``stop`` can come while
    ``ready`` waits)."""

    def __init__(self, argv: list[str], cwd: str, env: dict[str, str], creds: dict[str, bytes] | None = None) -> None:
        os.chdir(cwd)  # the actor's own process: the config's relative paths as the driver sees them
        self._auth_dir = str(private_auth_dir(creds)) if creds else None
        self._argv = argv + (["--auth-dir", self._auth_dir] if self._auth_dir else [])
        self._env = {
            k: v for k, v in {**os.environ, **env}.items() if k != AUTH_DIR_ENV
        }  # (a node's would name every role's)
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._answered = threading.Event()  # the first line is in, or the worker exited before it
        self._last: collections.deque[str] = collections.deque(maxlen=3)
        self._proc: subprocess.Popen[str] | None = None
        started = threading.Event()
        threading.Thread(target=self._keep, args=(started,), daemon=True, name="gym-worker-keeper").start()
        started.wait()

    def _keep(self, started: threading.Event) -> None:
        """Start the worker and wait on it, in one thread for its whole life (its parent-death signal's)."""
        try:
            self._proc = proc = subprocess.Popen(
                self._argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=self._env,
                preexec_fn=term_with_parent if sys.platform.startswith("linux") else None,
            )
        finally:
            started.set()
        threading.Thread(target=self._read_ready, args=(proc,), daemon=True).start()
        threading.Thread(target=self._relay_stderr, args=(proc,), daemon=True).start()
        code = proc.wait()
        self._answered.set()
        self._forget_creds()
        if self._ready.is_set() and not self._stopping.is_set():
            print(f"gym-runtime: worker exited with code {code}; the actor exits for Ray to restart it", flush=True)
            os._exit(1)  # died on its own: the actor goes with it, and Ray restarts both

    def _forget_creds(self) -> None:
        """The worker is gone: so is the directory that held its credential."""
        if self._auth_dir is not None:
            shutil.rmtree(self._auth_dir, ignore_errors=True)

    def _read_ready(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        if read_ready(proc.stdout):
            self._ready.set()
        self._answered.set()
        for _ in proc.stdout:  # keep its pipe drained
            pass

    def _relay_stderr(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:  # into the actor's log (Ray's worker-*.err); the last lines kept for ``ready``
            sys.stderr.write(line)
            if line.strip():
                self._last.append(line.strip())

    def ready(self, timeout_s: float) -> int:
        """The worker's pid once it said it is ready; ``NotReady`` if it exited first or took longer."""
        self._answered.wait(timeout_s)
        assert self._proc is not None
        if self._ready.is_set():
            return self._proc.pid
        try:  # its output ended first: it is exiting (its code is read once it has)
            code = self._proc.wait(10 if self._answered.is_set() else 0.01)
        except subprocess.TimeoutExpired:
            raise NotReady(f"not ready within {timeout_s:g} s", 1) from None
        raise NotReady(self._last[-1] if self._last else f"exited with code {code}", code)

    def node(self) -> str:
        """The Ray node this actor runs on (its id)."""
        import ray  # only ever called inside a Ray actor

        return str(ray.get_runtime_context().get_node_id())

    def stop(self, drain_timeout_s: float) -> int | None:
        """SIGTERM (the worker drains), SIGKILL after ``drain_timeout_s``; its exit code."""
        self._stopping.set()
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(drain_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
        finally:
            self._forget_creds()  # (before the actor is killed: its keeper thread may not get to it)
