"""One cgroup per sandbox: a memory and process limit for the sandbox as a whole.

Per-process rlimits do not add up: six children under a 1 GiB ``RLIMIT_AS`` hold
6 GiB. A cgroup charges every process of the sandbox together. Tried in order:

- **cgroup v2**, a child of the worker's own cgroup, when that cgroup already
  offers ``memory`` and ``pids`` to its children (a delegated subtree); sets
  ``memory.max``, ``memory.swap.max`` = 0 and ``pids.max``;
- **cgroup v1**, a child of the worker's ``memory`` (and, if writable, ``pids``
  and ``cpuacct``) cgroup: ``memory.limit_in_bytes`` (+ ``memory.memsw.limit_in_bytes``),
  ``pids.max``, and ``cpuacct.usage`` to count CPU.

CPU is counted, not limited, here: the parent (``runner._CpuWatch``) reads :meth:`JailCgroup.cpu_s`
(v2 ``cpu.stat``, v1 ``cpuacct.usage``: every process of the sandbox, also those already gone)
and kills the sandbox when it passes its CPU limit.

Neither writable (an unprivileged worker on most machines): :func:`create`
returns None and the sandbox falls back to one process (no ``fork``; threads
stay allowed), so process count x ``RLIMIT_AS`` stays within the budget.

The sandboxed child joins the cgroup itself, first thing, before it forks or reads
anything untrusted (``child._child_main``); the parent kills what is left and removes the
directory after the run. A worker killed mid-run never does: its cgroups (named for its PID) stay
until another worker beside it sweeps them (:func:`sweep`).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
from dataclasses import dataclass

# what one sandbox leaves under its worker's name: this cgroup, and its working directory (runner._start)
_LEFTOVER = re.compile(r"gym-sandbox-(\d+)-[0-9a-z_]+")
REMOVE_WITHIN_S = 2.5  # how long a cgroup whose processes were killed may take to empty


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root, mount point, fs type, super options) of every cgroup mount."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                    out.append((fields[3], fields[4], rfields[0], rfields[2]))
    except OSError:
        pass
    return out


def _own_paths() -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                for c in ctrls.split(",") if ctrls else [""]:
                    out[c] = path
    except (OSError, ValueError):
        pass
    return out


def _join(mount: str, root: str, path: str) -> str:
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return os.path.join(mount, path.lstrip("/"))


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@dataclass
class JailCgroup:
    """The directories of one sandbox's cgroup (one for v2, one per controller for v1)."""

    version: int
    dirs: list[str]
    cpu_file: str | None = None  # v2 cpu.stat, v1 cpuacct.usage; None: not counted here

    def cpu_s(self) -> float | None:
        """CPU seconds used by the sandbox so far (every process, also those already gone); None if unknown."""
        if self.cpu_file is None:
            return None
        with open(self.cpu_file, "rb") as f:
            data = f.read()
        if self.version == 2:
            for line in data.splitlines():
                if line.startswith(b"usage_usec "):
                    return int(line.split()[1]) / 1e6
            return None
        return int(data) / 1e9

    def kill(self) -> None:
        """SIGKILL every process inside (v2: ``cgroup.kill``)."""
        for d in self.dirs:
            try:
                if self.version == 2 and os.path.exists(os.path.join(d, "cgroup.kill")):
                    _write(os.path.join(d, "cgroup.kill"), "1")
                    continue
                with open(os.path.join(d, "cgroup.procs")) as f:
                    for pid in f.read().split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except (ProcessLookupError, PermissionError, ValueError):
                            pass
            except OSError:
                pass

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def remove(self, within: float = 0.0) -> bool:
        """Kill every process still inside, then remove the directories; True when all are gone. ``within``:
        seconds to keep trying while killed processes leave (a PID namespace's last ones die asynchronously)."""
        deadline = time.monotonic() + within
        while True:
            self.kill()
            left = []
            for d in self.dirs:
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(d)
            self.dirs = left
            if self.cpu_file is not None and os.path.dirname(self.cpu_file) not in left:
                self.cpu_file = None
            if not left or time.monotonic() >= deadline:
                return not left
            time.sleep(0.05)


def create(memory_bytes: int, max_tasks: int) -> JailCgroup | None:
    """A fresh cgroup limited to ``memory_bytes`` and ``max_tasks``, or None where none is writable."""
    name = f"gym-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
    mounts = _mounts()
    own = _own_paths()
    for make in (_create_v2, _create_v1):
        cg = make(mounts, own, name, memory_bytes, max_tasks)
        if cg is not None:
            return cg
    return None


def _create_v2(mounts, own, name, memory_bytes, max_tasks) -> JailCgroup | None:
    if "" not in own:
        return None
    for root, mount, fstype, _ in mounts:
        if fstype != "cgroup2":
            continue
        parent = _join(mount, root, own[""])
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
        except OSError:
            continue
        if "memory" not in enabled or "pids" not in enabled:
            continue
        d = os.path.join(parent, name)
        cg = JailCgroup(2, [d])
        try:
            os.mkdir(d, 0o755)
        except OSError:
            continue
        try:
            _write(os.path.join(d, "memory.max"), str(memory_bytes))
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "pids.max"), str(max_tasks))
            if os.path.exists(os.path.join(d, "cpu.stat")):  # (a core file of every v2 cgroup)
                cg.cpu_file = os.path.join(d, "cpu.stat")
            return cg
        except OSError:
            cg.remove()
    return None


def _create_v1(mounts, own, name, memory_bytes, max_tasks) -> JailCgroup | None:
    made: list[str] = []
    cg = JailCgroup(1, made)
    for controller in ("memory", "pids", "cpuacct"):
        if controller not in own:
            continue
        for root, mount, fstype, opts in mounts:
            if fstype != "cgroup" or controller not in opts.split(","):
                continue
            d = os.path.join(_join(mount, root, own[controller]), name)
            try:
                os.mkdir(d, 0o755)
            except OSError:
                break
            made.append(d)
            try:
                if controller == "memory":
                    _write(os.path.join(d, "memory.limit_in_bytes"), str(memory_bytes))
                    if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                        _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                elif controller == "pids":
                    _write(os.path.join(d, "pids.max"), str(max_tasks))
                elif os.path.exists(os.path.join(d, "cpuacct.usage")):
                    cg.cpu_file = os.path.join(d, "cpuacct.usage")
            except OSError:
                if controller == "memory":
                    cg.remove()
                    return None
                made.remove(d)  # no pids limit: RLIMIT_NPROC still caps processes
                os.rmdir(d)
            break
        if controller == "memory" and not made:
            return None  # memory is what this is for
    return cg if made else None


def owner_gone(name: str) -> bool:
    """True for ``gym-sandbox-PID-...`` when no process PID exists: a worker that died before its cleanup ran.
    A live PID (even one reused by another process) keeps its leftovers: the safe side."""
    m = _LEFTOVER.fullmatch(name)
    if m is None or int(m.group(1)) == os.getpid():
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        pass
    return False


def sweep() -> int:
    """Remove the sandbox cgroups beside this process's own that dead workers left (each killed mid-run):
    kill what is still inside (a runaway whose worker is gone), then remove the directory. How many went."""
    own = _own_paths()
    parents: dict[str, int] = {}
    for root, mount, fstype, opts in _mounts():
        if fstype == "cgroup2" and "" in own:
            parents[_join(mount, root, own[""])] = 2
        elif fstype == "cgroup":
            for controller in ("memory", "pids", "cpuacct"):
                if controller in opts.split(",") and controller in own:
                    parents[_join(mount, root, own[controller])] = 1
    removed = 0
    for parent, version in parents.items():
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if owner_gone(name):
                removed += JailCgroup(version, [os.path.join(parent, name)]).remove(within=REMOVE_WITHIN_S)
    return removed
