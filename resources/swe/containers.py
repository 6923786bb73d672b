"""Command lines for Docker, Podman and Apptainer/Singularity (pure functions: testable without a daemon).

Images are named per task as SWE-Gym and SWE-bench name them (a row's own
``image_name`` wins):

* SWE-Gym: ``docker.io/xingyaoww/sweb.eval.x86_64.<instance_id, "__" → "_s_">:latest``
* SWE-bench: ``docker.io/swebench/sweb.eval.x86_64.<instance_id, "__" → "_1776_">:latest``

both lower-cased; the repository sits at ``/testbed`` at the task's base commit.
Apptainer runs the same images (``docker://...``) or a local SIF from
``sif_template`` (e.g. ``/cache/{instance_id}.sif``, like NeMo Gym's
``cache_dir_template``).

Every container is named ``gym-swe-<pid>-<random>`` and labelled with its owner
(``gym-runtime.owner=<host>:<pid>``); its main process is ``sleep <lifetime>``
under ``--rm``, so it ends by itself if nobody removes it. Commands run as
``timeout -s KILL <t> bash -lc <command>`` inside the container, so a runaway
command dies in the container too. The default network is ``none`` (the policy's
commands are hostile input); ``network: bridge`` opts out.
"""

from __future__ import annotations

import os
import secrets
import shlex
import socket
from dataclasses import dataclass, field
from typing import Any, Literal

Engine = Literal["docker", "podman", "apptainer", "singularity"]
OWNER_LABEL = "gym-runtime.owner"
WORKDIR = "/testbed"


def owner_label() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def swe_image(task: dict[str, Any], flavour: Literal["swe-gym", "swe-bench"] = "swe-gym") -> str:
    """The image SWE-Gym / SWE-bench publish for this task."""
    if task.get("image_name"):
        return str(task["image_name"])
    iid = str(task.get("instance_id") or "")
    if not iid:
        raise ValueError("a SWE row needs instance_id (or image_name) to name its image")
    if flavour == "swe-bench":
        return f"docker.io/swebench/sweb.eval.x86_64.{iid.replace('__', '_1776_')}:latest".lower()
    return f"docker.io/xingyaoww/sweb.eval.x86_64.{iid.replace('__', '_s_')}:latest".lower()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class ContainerCommands:
    engine: Engine = "docker"
    binary: str = ""  # the engine's executable (default: its name)
    flavour: Literal["swe-gym", "swe-bench"] = "swe-gym"
    network: str = "none"
    memory: str = "8g"
    cpus: str = "2"
    pids_limit: int = 1024
    shell_setup: str = "source /opt/miniconda3/bin/activate testbed 2>/dev/null || true"
    sif_template: str | None = None  # apptainer: local image path, formatted with the task's fields
    extra_run_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.binary:
            object.__setattr__(self, "binary", self.engine)

    @property
    def is_apptainer(self) -> bool:
        return self.engine in ("apptainer", "singularity")

    def new_name(self) -> str:
        return f"gym-swe-{os.getpid()}-{secrets.token_hex(4)}"

    def image(self, task: dict[str, Any]) -> str:
        if self.is_apptainer:
            if self.sif_template:
                return self.sif_template.format(**{k: v for k, v in task.items() if isinstance(v, str)})
            return "docker://" + swe_image(task, self.flavour)
        return swe_image(task, self.flavour)

    def start(self, name: str, task: dict[str, Any], lifetime_s: float) -> list[str]:
        """Start a detached container that removes itself after ``lifetime_s``."""
        life = str(max(1, int(lifetime_s)))
        if self.is_apptainer:
            # instances have no --rm: they are stopped by name (remove) or by reap_orphans
            argv = [
                self.binary,
                "instance",
                "start",
                "--containall",
                "--cleanenv",
                "--writable-tmpfs",
                "--pwd",
                WORKDIR,
            ]
            if self.network == "none":
                argv += ["--net", "--network", "none"]
            return [*argv, *self.extra_run_args, self.image(task), name]
        argv = [
            self.binary,
            "run",
            "-d",
            "--rm",
            "--name",
            name,
            "--label",
            f"{OWNER_LABEL}={owner_label()}",
            "--network",
            self.network,
            "--memory",
            self.memory,
            "--cpus",
            self.cpus,
            "--pids-limit",
            str(self.pids_limit),
            "-w",
            WORKDIR,
            *self.extra_run_args,
            "--entrypoint",
            "sleep",
            self.image(task),
            life,
        ]
        return argv

    def _shell(self, command: str, timeout_s: float) -> list[str]:
        script = f"{self.shell_setup}\ncd {WORKDIR}\n{command}" if self.shell_setup else command
        return ["timeout", "-s", "KILL", str(max(1, int(timeout_s))), "bash", "-lc", script]

    def exec(self, name: str, command: str, timeout_s: float) -> list[str]:
        if self.is_apptainer:
            return [self.binary, "exec", "--pwd", WORKDIR, f"instance://{name}", *self._shell(command, timeout_s)]
        return [self.binary, "exec", "-w", WORKDIR, name, *self._shell(command, timeout_s)]

    def write(self, name: str, path: str) -> list[str]:
        """Write stdin to ``path`` (relative to the repository) inside the container."""
        target = shlex.quote(path if path.startswith("/") else f"{WORKDIR}/{path}")
        script = f'mkdir -p "$(dirname {target})" && cat > {target}'
        if self.is_apptainer:
            return [self.binary, "exec", f"instance://{name}", "sh", "-c", script]
        return [self.binary, "exec", "-i", name, "sh", "-c", script]

    def remove(self, name: str) -> list[str]:
        if self.is_apptainer:
            return [self.binary, "instance", "stop", name]
        return [self.binary, "rm", "-f", name]

    def list_owned(self) -> list[str]:
        if self.is_apptainer:
            return [self.binary, "instance", "list"]
        return [
            self.binary,
            "ps",
            "-a",
            "--filter",
            f"label={OWNER_LABEL}",
            "--format",
            '{{.Names}} {{.Label "' + OWNER_LABEL + '"}}',
        ]

    def orphans(self, listing: str, host: str | None = None) -> list[str]:
        """Names in a ``list_owned`` listing whose owner process on this host is gone."""
        host = host or socket.gethostname()
        dead = []
        for line in listing.splitlines():
            parts = line.split()
            if not parts or not parts[0].startswith("gym-swe-"):
                continue
            name = parts[0]
            if self.is_apptainer:
                owner_host, pid_text = host, name.split("-")[2]
            else:
                if len(parts) < 2 or ":" not in parts[1]:
                    continue
                owner_host, pid_text = parts[1].rsplit(":", 1)
            if owner_host == host and pid_text.isdigit() and not _pid_alive(int(pid_text)):
                dead.append(name)
        return dead
