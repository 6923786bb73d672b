"""A real Slurm cluster on this machine for the deploy tests: munged, slurmctld and four slurmd, stopped by PID.

Four emulated nodes ``n1``..``n4`` on loopback addresses 127.0.0.11-14 (``NodeAddr`` and /etc/hosts
entries, restored afterwards), each slurmd on a port of its own; the daemons' state, logs and the munge
socket live in one directory. One cluster at a time on a machine (a file lock): the node names and
/etc/hosts are machine-wide. Needs root and Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs
them); without them the tests skip with one line, or fail with ``GYM_REQUIRE_SLURM=1``; ``GYM_SLURM_TESTS=0``
skips them (CI's second, fresh-clone pass).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO, node_ports

NODES = {f"n{i}": f"127.0.0.{10 + i}" for i in range(1, 5)}
HOSTS = Path("/etc/hosts")
LOCK = Path("/tmp/gym-runtime-slurm.lock")
REQUIRE_ENV = "GYM_REQUIRE_SLURM"


def missing() -> str | None:
    """Why a local Slurm cannot run here, or None."""
    if os.environ.get("GYM_SLURM_TESTS") == "0":
        return "GYM_SLURM_TESTS=0 (CI's fresh-clone pass: its first pass ran them on the real daemons)"
    if os.geteuid() != 0:
        return "a local Slurm needs root (its daemons and /etc/hosts)"
    for tool in ("slurmctld", "slurmd", "sbatch", "munged"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install slurm-wlm munge)"
    if not Path("/etc/munge/munge.key").is_file():
        return "no munge key at /etc/munge/munge.key (Debian's munge package writes one)"
    return None


@dataclass
class Cluster:
    root: Path
    conf: Path

    @property
    def env(self) -> dict[str, str]:
        """What every Slurm client command needs: the config (and through it the munge socket)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(
        self, *argv: str, env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (``env``: more variables, e.g. a job's), from the repository's root."""
        return subprocess.run(
            argv,
            env={**self.env, **(env or {})},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def _config(root: Path, ctld_port: int, node_ports: dict[str, int]) -> str:
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={n} NodeAddr={addr} Port={node_ports[n]} CPUs=2 RealMemory=4000"
        for n, addr in NODES.items()
    )
    return f"""ClusterName=gymtest
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=30
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def _stop(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def local_slurm(root: Path) -> Iterator[Cluster]:
    """Start the cluster under ``root``; yield it once every node is idle; stop every daemon by PID."""
    for d in ("state", "spool", "log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    LOCK.touch(exist_ok=True)
    with LOCK.open("r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        hosts = HOSTS.read_text()
        procs: list[subprocess.Popen[bytes]] = []
        munged: int | None = None
        try:
            HOSTS.write_text(hosts.rstrip("\n") + "\n" + "".join(f"{addr} {n}\n" for n, addr in NODES.items()))
            key = root / "munge.key"
            shutil.copy("/etc/munge/munge.key", key)
            key.chmod(0o600)
            files = {"socket": "munge.socket", "log-file": "log/munged.log", "pid-file": "munged.pid"}
            argv = ["munged", "-f", f"--key-file={key}", f"--seed-file={root}/munged.seed"]
            subprocess.run(argv + [f"--{k}={root}/{v}" for k, v in files.items()], check=True, timeout=30)
            munged = int((root / "munged.pid").read_text())
            conf = root / "slurm.conf"
            ctld, *daemons = node_ports(1 + len(NODES))  # started one by one: no client takes one meanwhile
            conf.write_text(_config(root, ctld, dict(zip(NODES, daemons, strict=True))))
            out = (root / "log" / "daemons.out").open("ab")
            procs.append(subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], stdout=out, stderr=out))
            procs += [
                subprocess.Popen(["slurmd", "-D", "-N", n, "-f", str(conf)], stdout=out, stderr=out) for n in NODES
            ]
            cluster = Cluster(root, conf)
            deadline = time.monotonic() + 60
            while True:  # every node registered and idle
                states = cluster.run("sinfo", "--noheader", "--Node", "--format=%N %t").stdout.split()
                if states[1::2] and all(s == "idle" for s in states[1::2]) and len(states) == 2 * len(NODES):
                    break
                for p in procs:
                    if p.poll() is not None:
                        raise RuntimeError(f"a Slurm daemon exited ({p.args}): see {root}/log")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the local Slurm's nodes are not idle after 60 s ({states}): see {root}/log")
                time.sleep(0.5)
            yield cluster
        finally:
            for p in procs:
                _stop(p.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
            if munged is not None:
                _stop(munged)
            HOSTS.write_text(hosts)
