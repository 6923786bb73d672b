"""A Docker Engine API client over the engine's unix socket (Docker, and Podman's compatible service).

Why the API and not a ``docker`` command: the CLI first on ``PATH`` may be newer than the engine (on
these machines ``/usr/local/bin/docker`` is, beside Debian's 20.10 engine), a command per call costs a
process, and its output has no byte cap. Why aiohttp and not the ``docker`` SDK: aiohttp is already a
dependency and is async (the SDK blocks a thread per call), and the one call it cannot make, an exec
with its stdin and a capped output, needs the raw hijacked connection, written here in a few lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote, urlencode

import aiohttp
import anyio
import anyio.abc
import msgspec

from gym_runtime.errors import ConfigError
from gym_runtime.sandboxes.spec import OnOutput

API = "/v1.41"  # Docker 20.10's; Podman's compat service accepts it
# a call that has waited STALL_S has the engine pinged (again every STALL_S); no answer within PING_S: the engine
# is frozen or stopped, and the call fails now instead of at its own timeout (120 s; a create, an exec's stream).
# A slow call on a live engine (a long exec, an import) is never cut off: the engine answers its pings.
STALL_S = 10.0
PING_S = 5.0
REMOVE_TRIES = 3  # a forced removal Podman failed with one of REMOVE_AGAIN is tried again (``Engine.remove``)
REMOVE_AGAIN = ("could not be stopped", "device or resource busy")
REMOVE_PAUSE_S = 1.0


class EngineError(RuntimeError):
    """The engine refused a call (its status and message) or cannot be reached."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class EngineUnavailable(EngineError):
    """The engine cannot be reached, or does not answer a ping while a call waits on it (a stopped or frozen
    ``dockerd``): the pool's sandboxes are unavailable (``sandbox_unavailable``), no sandbox is at fault."""


class ExecOutput(msgspec.Struct, kw_only=True):
    """One command's outcome: exit code (None: killed at the wall clock), capped output."""

    exit_code: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    truncated: bool = False  # more output came than the cap kept
    timed_out: bool = False
    duration_s: float = 0.0


class Capture:
    """A command's output as it is read, capped: at most ``max_output`` bytes of each stream are kept (the rest
    is read and dropped, never held)."""

    def __init__(self, max_output: int) -> None:
        self.max_output = max_output
        self.kept: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        self.truncated = False

    def add(self, stream: int, chunk: bytes) -> bytes:
        """Keep what fits of ``chunk``; the part kept (b"" past the cap)."""
        buf = self.kept.get(stream)
        if buf is None:
            return b""
        room = max(0, self.max_output - len(buf))
        part = chunk[:room]
        buf += part
        if len(chunk) > room:
            self.truncated = True
        return part


def socket_of(host: str) -> str:
    """The socket path of a ``DOCKER_HOST``-style address (``unix:///path`` or a bare path)."""
    if host.startswith("unix://"):
        return host[len("unix://") :]
    if "://" in host:
        raise EngineError(f"only unix sockets are supported, not {host!r} (the engine stays on this machine)")
    return host


CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_cpu_s(pid: int, cid: str, root: str = CGROUP_ROOT) -> float | None:
    """The CPU seconds of container ``cid`` from its cgroup, found through process ``pid`` (its main process as
    the engine sees it): cgroup v1's ``cpuacct.usage`` or v2's ``cpu.stat`` ``usage_usec``, what the engine's
    stats report as ``total_usage``. Only a cgroup whose own name holds the container's full id is read, so a
    pid of another PID namespace (a worker in a container of its own), or one reused since, is never counted
    for it; None where this host does not show that cgroup under ``root`` (a remote or rootless engine, a
    nested cgroup mount): the caller asks the engine. The sandbox cannot change the count (its
    ``/sys/fs/cgroup`` is an empty read-only mount, its capabilities dropped)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    v2 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3 or len(cid) < 64 or cid not in parts[2].rsplit("/", 1)[-1]:
            continue
        _, controllers, path = parts
        if not controllers:
            v2 = path
        elif "cpuacct" in controllers.split(","):
            try:
                return int(Path(f"{root}/{controllers}{path}/cpuacct.usage").read_text()) / 1e9
            except (OSError, ValueError):
                pass
    if v2 is not None:
        try:
            for row in Path(f"{root}{v2}/cpu.stat").read_text().splitlines():
                key, _, value = row.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
        except (OSError, ValueError):
            pass
    return None


PODMAN_SOCKET = "/run/podman/podman.sock"


def engine_socket(backend: str, engine: str, where: str) -> str:
    """A pool's engine socket: ``engine`` as given, else ``$DOCKER_HOST`` (docker), ``$CONTAINER_HOST`` or
    podman's default socket (podman); the sandbox worker and the Harbor image builder open the same one."""
    if engine:
        return socket_of(engine)
    if backend == "docker":
        host = os.environ.get("DOCKER_HOST", "")
        if not host:
            raise ConfigError(f"{where}.engine: not set and DOCKER_HOST is empty: {engine_fix(backend, where)}")
        return socket_of(host)
    return socket_of(os.environ.get("CONTAINER_HOST", "") or PODMAN_SOCKET)


def engine_fix(backend: str, where: str = "") -> str:
    """What to do when a pool's engine is not named or does not answer: the one sentence every such message
    ends with (the sandbox worker, the Harbor image builder, ``parity --harbor``)."""
    if backend == "podman":
        return "start podman's API service (podman system service), or point CONTAINER_HOST at its socket"
    key = f" (or {where}.engine)" if where else ""
    return (
        'start an engine (in a clone: eval "$(bash .ci/docker.sh start)") or point DOCKER_HOST at a running '
        f"one's socket, e.g. DOCKER_HOST=unix:///var/run/docker.sock{key}"
    )


class Engine:
    """One engine, one connection pool. Use ``async with Engine(socket) as e``."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Engine:
        conn = aiohttp.UnixConnector(path=self.socket_path, limit=64)
        self._session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
        data: Any = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 120.0,
        raw: bool = False,
    ) -> Any:
        if self._session is None:
            raise EngineError("the engine client is not open")
        url = f"http://engine{API}{path}" + (f"?{urlencode(params)}" if params else "")
        if body is not None:
            data, headers = json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
        try:
            async with self.watched(f"{method} {path}"):
                async with self._session.request(
                    method, url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
                ) as r:
                    got = await r.read()
                    if r.status >= 400:
                        try:
                            msg = json.loads(got).get("message", got.decode(errors="replace"))
                        except ValueError:
                            msg = got.decode(errors="replace")
                        raise EngineError(f"{method} {path}: {r.status} {msg}", r.status)
                    if not raw and r.content_type == "application/json" and got:
                        return json.loads(got)
                    return got
        except aiohttp.ClientError as e:
            self._unreachable(e)

    def _unreachable(self, e: BaseException) -> NoReturn:
        raise EngineUnavailable(f"the engine at {self.socket_path} cannot be reached: {e}") from e

    async def _answers(self) -> bool:
        """Whether the engine answers ``GET /_ping`` within ``PING_S`` (on a connection of its own)."""
        assert self._session is not None
        try:
            with anyio.fail_after(PING_S):
                async with self._session.get(f"http://engine{API}/_ping") as r:
                    await r.read()
                    return r.status < 500
        except (aiohttp.ClientError, TimeoutError):
            return False

    @contextlib.asynccontextmanager
    async def watched(self, what: str) -> AsyncIterator[None]:
        """Run the body while the engine is pinged every ``STALL_S``; one it does not answer ends the body with
        ``EngineUnavailable`` naming the call and the engine's socket."""
        silent: list[float] = []

        async def watch() -> None:
            started = time.monotonic()
            while True:
                await anyio.sleep(STALL_S)
                if not await self._answers():
                    silent.append(time.monotonic() - started)
                    tg.cancel_scope.cancel()
                    return

        failed: list[Exception] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            try:
                yield
            except Exception as e:  # the body's own failure, raised below as itself (not in an ExceptionGroup)
                failed.append(e)
            finally:
                tg.cancel_scope.cancel()
        if silent:
            raise EngineUnavailable(
                f"the engine at {self.socket_path} does not answer: {what} waited {silent[0]:.0f} s and a ping got "
                f"no answer within {PING_S:g} s (the engine is stopped or frozen)"
            )
        if failed:
            raise failed[0]

    # ---------------------------------------------------------------- engine and images

    async def ping(self) -> None:
        await self._call("GET", "/_ping", timeout_s=5)

    async def version(self) -> dict[str, Any]:
        out: dict[str, Any] = await self._call("GET", "/version", timeout_s=5)
        return out

    async def image_exists(self, ref: str) -> bool:
        try:
            await self._call("GET", f"/images/{quote(ref, safe='')}/json")
        except EngineError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def image_config(self, ref: str) -> dict[str, Any]:
        """An image's ``Config`` (its ``User``, ``WorkingDir``, ``Env``, ...)."""
        out = await self._call("GET", f"/images/{quote(ref, safe='')}/json")
        return dict(out.get("Config") or {})

    async def import_image(self, chunks: AsyncIterator[bytes], repo: str, tag: str) -> None:
        """``docker import``: a root file system's tar stream becomes image ``repo:tag``."""
        raw = await self._call(
            "POST",
            "/images/create",
            # the tag in ``repo`` (the API allows it): Podman's compatible service ignores a ``tag`` parameter
            params={"fromSrc": "-", "repo": f"{repo}:{tag}"},
            data=chunks,
            headers={"Content-Type": "application/x-tar"},
            timeout_s=600,
            raw=True,
        )
        for line in raw.splitlines():  # a progress stream; an error is a line of its own
            if line.strip() and b'"error"' in line:
                raise EngineError(f"importing {repo}:{tag}: {json.loads(line).get('error')}")

    async def build(
        self,
        context: bytes,
        tag: str,
        *,
        network: str = "none",
        timeout_s: float = 600.0,
        build_args: dict[str, str] | None = None,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        """``docker build``: ``context`` is a tar holding a ``Dockerfile``; the image is tagged ``tag``. Its
        ``RUN`` steps get ``network`` (``none`` unless the build must fetch; never a bridge here);
        ``build_args``: ``--build-arg``'s; ``on_step``: told each step (``Step 2/5 : RUN ...``) as the engine
        starts it, so a slow build is not silent."""
        params = {"t": tag, "networkmode": network, "rm": "1", "forcerm": "1"}
        if build_args:
            params["buildargs"] = json.dumps(build_args)
        if self._session is None:
            raise EngineError("the engine client is not open")
        url = f"http://engine{API}/build?{urlencode(params)}"
        headers = {"Content-Type": "application/x-tar"}
        try:
            async with self._session.post(
                url, data=context, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                if r.status >= 400:
                    got = await r.read()
                    raise EngineError(f"POST /build: {r.status} {got.decode(errors='replace').strip()}", r.status)
                rest = b""
                async for chunk in r.content.iter_any():  # a progress stream, a JSON object a line, as it comes
                    *lines, rest = (rest + chunk).split(b"\n")
                    for line in lines:
                        _build_line(tag, line, on_step)
                _build_line(tag, rest, on_step)
        except aiohttp.ClientError as e:
            self._unreachable(e)

    async def commit(self, cid: str, labels: dict[str, str]) -> str:
        """``docker commit``: a container's file system (not its tmpfs mounts) as a new untagged image; its id. The
        labels go as ``LABEL`` changes too: Podman's compatible service ignores the body's (4.3)."""
        query = [("container", cid), ("pause", "true"), *(("changes", f"LABEL {k}={v}") for k, v in labels.items())]
        out = await self._call("POST", f"/commit?{urlencode(query)}", body={"Labels": labels}, timeout_s=600)
        image = str(out["Id"])
        return image if ":" in image else f"sha256:{image}"  # Podman's bare id, which its DELETE refuses

    async def images(self, labels: dict[str, str]) -> list[dict[str, Any]]:
        """The images carrying these labels. Podman (4.3 here) fails a listing that meets an image being removed
        ("image not known", 500): listed again, up to ``REMOVE_TRIES`` times in all."""
        want = [f"{k}={v}" for k, v in labels.items()]
        for tries_left in range(REMOVE_TRIES - 1, -1, -1):
            try:
                out: list[dict[str, Any]] = await self._call(
                    "GET", "/images/json", params={"filters": json.dumps({"label": want})}
                )
                return out
            except EngineError as e:
                if not (tries_left and e.status == 500 and "image not known" in str(e)):
                    raise
        return []  # (not reached: the last try returns or raises)

    async def remove_image(self, ref: str) -> bool:
        """Remove an image; False: a container still uses it (the engine refuses), or it is gone already."""
        try:
            await self._call("DELETE", f"/images/{quote(ref, safe='')}", params={"noprune": "false"})
        except EngineError as e:
            if e.status in (404, 409):
                return False
            raise
        return True

    # ---------------------------------------------------------------- volumes

    async def create_volume(self, name: str, labels: dict[str, str], options: dict[str, str] | None = None) -> str:
        """A named volume of the engine's ``local`` driver (``options``: its mount's, e.g. a tmpfs, mounted while a
        running container uses it); its name."""
        body: dict[str, Any] = {"Name": name, "Labels": labels}
        if options:
            body["DriverOpts"] = options
        out = await self._call("POST", "/volumes/create", body=body)
        return str(out["Name"])

    async def volumes(self, labels: dict[str, str]) -> list[dict[str, Any]]:
        """The volumes carrying these labels (``Name``, ``CreatedAt``, ``Labels``)."""
        want = [f"{k}={v}" for k, v in labels.items()]
        out = await self._call("GET", "/volumes", params={"filters": json.dumps({"label": want})})
        return list(out.get("Volumes") or [])

    async def remove_volume(self, name: str) -> bool:
        """Remove a volume; False: a container still uses it (the engine refuses), or it is gone already."""
        try:
            await self._call("DELETE", f"/volumes/{quote(name, safe='')}")
        except EngineError as e:
            if e.status in (404, 409):
                return False
            raise
        return True

    async def put_archive(self, cid: str, path: str, data: AsyncIterable[bytes]) -> None:
        """Unpack a tar stream (sent as it comes) at ``path`` of a container (``docker cp``: the engine unpacks it,
        chrooted into the container's file system); a container with a read-only root takes it into a volume."""
        await self._call(
            "PUT",
            f"/containers/{cid}/archive",
            params={"path": path},
            data=data,
            headers={"Content-Type": "application/x-tar"},
            timeout_s=600,
        )

    # ---------------------------------------------------------------- containers

    async def create(self, body: dict[str, Any], name: str | None = None) -> str:
        out = await self._call("POST", "/containers/create", params={"name": name} if name else None, body=body)
        return str(out["Id"])

    async def start(self, cid: str) -> None:
        await self._call("POST", f"/containers/{cid}/start")

    async def remove(self, cid: str) -> bool:
        """Kill and remove a container with its anonymous volumes; False: it was not there. Podman's (4.3 here)
        forced removal of a running container fails now and then ("could not be stopped: timed out waiting for file
        .../exits/ID", or its ``shm`` "device or resource busy") with the container stopped meanwhile: tried again,
        up to ``REMOVE_TRIES`` times in all."""
        for tries_left in range(REMOVE_TRIES - 1, -1, -1):
            try:
                await self._call("DELETE", f"/containers/{cid}", params={"force": "true", "v": "true"})
            except EngineError as e:
                # 409 "removal ... already in progress": it ended by itself and the engine is removing it (AutoRemove)
                if e.status == 404 or (e.status == 409 and "in progress" in str(e)):
                    return False
                if tries_left and e.status == 500 and any(w in str(e) for w in REMOVE_AGAIN):
                    await anyio.sleep(REMOVE_PAUSE_S)
                    continue
                raise
            return True
        return True  # (not reached: the last try returns or raises)

    async def signal(self, cid: str, name: str) -> bool:
        """Send signal ``name`` (``WINCH``) to a container's main process; False: it is gone or not running."""
        try:
            await self._call("POST", f"/containers/{cid}/kill", params={"signal": name}, timeout_s=30)
        except EngineError as e:
            # Podman answers 500 "container state improper" for one that ended (409 on Docker)
            if e.status in (404, 409) or "state improper" in str(e):
                return False
            raise
        return True

    async def restart(self, cid: str, *, timeout_s: float = 120.0) -> None:
        """Stop a container at once (its init killed: the kernel then kills every process of its PID namespace,
        whatever their session, group or user) and start it again, its file system as it was."""
        await self._call("POST", f"/containers/{cid}/restart", params={"t": "0"}, timeout_s=timeout_s)

    async def pids(self, cid: str, *, podman: bool = False) -> set[str]:
        """The host's ids of a running container's processes, read by the engine, not by anything in the
        container (``docker top``: the host's ps; Podman's: its own reader, asked for host ids, ``hpid``)."""
        params, title = ({"ps_args": "hpid"}, "HPID") if podman else (None, "PID")
        raw = await self._call("GET", f"/containers/{cid}/top", params=params, raw=True)
        out = json.loads(raw)  # (Podman sends it without a JSON content type)
        col = list(out["Titles"]).index(title)
        return {str(p[col]).strip() for p in out.get("Processes") or []}

    async def cpu_s(self, cid: str) -> float | None:
        """The CPU seconds a container's processes have used (its cgroup's count, every process, also those
        gone); None when neither the kernel nor the engine says (a container gone or ended, or an engine
        without the field). Read from the container's cgroup where this host sees it (``cgroup_cpu_s``: the
        count the engine's stats report, as the kernel has it now), else from one non-streamed stats read
        (``one-shot``): Docker 20.10 answers that one at its stats collector's next tick, up to a second later
        (0.3-0.5 s per close on average, waiting: most of what the fleet added to a cold create, issue 58)."""
        try:
            info = await self.inspect(cid)
        except EngineError as e:
            if e.status == 404:
                return None
            raise
        state = info.get("State") or {}
        pid = state.get("Pid")
        if state.get("Running") and isinstance(pid, int) and pid > 0:
            here = cgroup_cpu_s(pid, str(info.get("Id") or cid))
            if here is not None:
                return here
        return await self._stats_cpu_s(cid)

    async def _stats_cpu_s(self, cid: str) -> float | None:
        """``cpu_s`` from the engine's stats (``cpu_stats.cpu_usage.total_usage``)."""
        try:
            got = await self._call(
                "GET", f"/containers/{cid}/stats", params={"stream": "false", "one-shot": "true"}, raw=True
            )
        except EngineError as e:
            if e.status == 404:
                return None
            raise
        try:
            stats = json.loads(got)  # (Podman sends it without a JSON content type)
        except ValueError:
            return None
        cpu = stats.get("cpu_stats") if isinstance(stats, dict) else None
        usage = cpu.get("cpu_usage") if isinstance(cpu, dict) else None
        total = usage.get("total_usage") if isinstance(usage, dict) else None
        return total / 1e9 if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None

    async def containers(self, labels: dict[str, str | None]) -> list[dict[str, Any]]:
        """Every container (running or not) carrying these labels (a None value: the label, any value)."""
        want = [k if v is None else f"{k}={v}" for k, v in labels.items()]
        out: list[dict[str, Any]] = await self._call(
            "GET", "/containers/json", params={"all": "true", "filters": json.dumps({"label": want})}
        )
        return out

    async def using(self, volume: str) -> list[str]:
        """The ids of the containers (running or not, or being removed) that mount volume ``volume``."""
        out = await self._call(
            "GET", "/containers/json", params={"all": "true", "filters": json.dumps({"volume": [volume]})}
        )
        return [c["Id"] for c in out]

    async def gone(self, cid: str, *, within: float = 60.0) -> bool:
        """Remove a container and wait until it is gone, its removal under way elsewhere too (Docker's AutoRemove at
        its end, or a removal whose caller was cancelled mid-call: ``remove`` answers at once then); whether it went
        within ``within`` seconds."""
        await self.remove(cid)
        with anyio.move_on_after(within):
            try:
                await self._call("POST", f"/containers/{cid}/wait", params={"condition": "removed"}, timeout_s=within)
            except EngineError as e:
                if e.status != 404:  # 404: gone already
                    raise
            return True
        return False

    async def inspect(self, cid: str) -> dict[str, Any]:
        out: dict[str, Any] = await self._call("GET", f"/containers/{cid}/json")
        return out

    # ---------------------------------------------------------------- exec

    async def exec(
        self,
        cid: str,
        argv: list[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float,
        max_output: int,
        env: list[str] | None = None,
        workdir: str | None = None,
        on_output: OnOutput | None = None,
        feed: AsyncIterable[bytes] | None = None,
    ) -> ExecOutput:
        """Run ``argv`` in the container; keep at most ``max_output`` bytes of each stream (the rest is
        read and dropped, never held); past ``timeout_s`` the command is killed (exit_code None).
        ``on_output``: given each part kept, as it is read (nothing past the cap). ``feed``: its input as it
        comes, instead of ``stdin`` (for a command that writes little before its input ends, as ``tar -x``)."""
        started = time.monotonic()
        takes = stdin is not None or feed is not None
        eid = await self.exec_create(cid, argv, stdin=takes, env=env, workdir=workdir)
        out = Capture(max_output)
        with anyio.move_on_after(timeout_s) as scope:
            async with self.watched(f"exec {argv[0]!r}"):
                async for stream, chunk in self.exec_stream(eid, stdin, feed=feed):
                    part = out.add(stream, chunk)
                    if part and on_output is not None:
                        await on_output(stream, part)
        timed_out = scope.cancelled_caught
        if timed_out:
            await self.kill_exec(eid)
            code: int | None = None
        else:
            info = await self._call("GET", f"/exec/{eid}/json")
            code = info.get("ExitCode")
        return ExecOutput(
            exit_code=code,
            stdout=bytes(out.kept[1]),
            stderr=bytes(out.kept[2]),
            truncated=out.truncated,
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
        )

    async def exec_create(
        self,
        cid: str,
        argv: list[str],
        *,
        stdin: bool = False,
        env: list[str] | None = None,
        workdir: str | None = None,
    ) -> str:
        """An exec instance of ``argv`` in the container (not started yet: ``exec_stream`` starts it)."""
        body: dict[str, Any] = {
            "Cmd": argv,
            "AttachStdin": stdin,
            "AttachStdout": True,
            "AttachStderr": True,
            "Tty": False,
        }
        if env:
            body["Env"] = env
        if workdir:
            body["WorkingDir"] = workdir
        return str((await self._call("POST", f"/containers/{cid}/exec", body=body))["Id"])

    async def exec_info(self, eid: str) -> dict[str, Any]:
        """An exec's state: ``Running``, ``ExitCode``, ``Pid`` (the host's)."""
        out: dict[str, Any] = await self._call("GET", f"/exec/{eid}/json")
        return out

    async def kill_exec(self, eid: str, *, group: bool = False) -> None:
        """The Engine API cannot stop an exec: kill its process (``group``: its process group, which it
        leads) from the host (a local engine; for a timed-out exec the in-container ``timeout`` wrapper of
        ``EngineBackend`` has usually done it already)."""
        try:
            pid = (await self.exec_info(eid)).get("Pid") or 0
            if pid > 0:
                (os.killpg if group else os.kill)(pid, signal.SIGKILL)
        except (EngineError, ProcessLookupError, PermissionError):
            pass

    async def exec_stream(
        self,
        eid: str,
        stdin: bytes | None,
        started: Callable[[], None] | None = None,
        *,
        feed: AsyncIterable[bytes] | None = None,
    ) -> AsyncGenerator[tuple[int, bytes]]:
        """Start an exec on a hijacked connection: send ``stdin`` (or each part of ``feed`` as it comes) and close
        our side, then yield the multiplexed frames (stream 1 stdout, 2 stderr) until the command ends.
        ``started``: called once the engine has started it."""
        payload = json.dumps({"Detach": False, "Tty": False}).encode()
        async with await anyio.connect_unix(self.socket_path) as sock:
            rest = await self._upgrade(sock, f"/exec/{eid}/start", payload, "exec start")
            if started is not None:
                started()
            if feed is not None:
                async for part in feed:
                    await sock.send(part)
                await sock.send_eof()
            elif stdin is not None:
                if stdin:
                    await sock.send(stdin)
                await sock.send_eof()
            async for frame in _frames(sock, rest):
                yield frame

    @contextlib.asynccontextmanager
    async def attached(self, cid: str) -> AsyncIterator[AsyncIterator[tuple[int, bytes]]]:
        """A container's output from now on (its stdout and stderr, attached: before its start, all of it), as the
        multiplexed frames (stream 1 stdout, 2 stderr) until it ends or the block is left (which detaches)."""
        async with await anyio.connect_unix(self.socket_path) as sock:
            rest = await self._upgrade(sock, f"/containers/{cid}/attach?stream=1&stdout=1&stderr=1", b"", "attach")
            async with contextlib.aclosing(_frames(sock, rest)) as frames:
                yield frames

    async def _upgrade(self, sock: anyio.abc.ByteStream, path: str, payload: bytes, what: str) -> bytes:
        """POST ``path`` on ``sock`` asking for the connection (hijacked, as ``docker exec`` and ``attach`` do); what
        came after the answer's head (the first frames)."""
        request = (
            f"POST {API}{path} HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
            f"Connection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        await sock.send(request)
        buf = bytearray()
        while b"\r\n\r\n" not in buf:
            chunk = await sock.receive()
            buf += chunk
        head, _, rest = bytes(buf).partition(b"\r\n\r\n")
        status = head.split(b" ", 2)[1:2]
        if status not in ([b"101"], [b"200"]):
            raise EngineError(f"{what}: {head.decode(errors='replace').splitlines()[0]}")
        return rest


async def _frames(sock: anyio.abc.ByteStream, rest: bytes) -> AsyncGenerator[tuple[int, bytes]]:
    """The multiplexed frames of a hijacked connection (``rest``: what came with the answer's head) until it ends."""
    buf = bytearray(rest)
    while True:
        while len(buf) >= 8:
            stream, size = buf[0], struct.unpack(">I", buf[4:8])[0]
            if len(buf) < 8 + size:
                break
            yield stream, bytes(buf[8 : 8 + size])
            del buf[: 8 + size]
        try:
            chunk = await sock.receive(1 << 16)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return
        buf += chunk


def _build_line(tag: str, line: bytes, on_step: Callable[[str], None] | None) -> None:
    """One line of the build's progress stream: a failed step (an error line of its own) raises; a step begun is
    told to ``on_step``; anything else (a step's output, a line that is not JSON) is passed over."""
    if not line.strip():
        return
    try:
        item = json.loads(line)
    except ValueError:
        return
    if not isinstance(item, dict):
        return
    if "error" in item:
        raise EngineError(f"building {tag}: {str(item.get('error', '')).strip()}")
    said = str(item.get("stream") or "").strip()
    if on_step is not None and said.lower().startswith("step "):  # Docker's "Step 2/5 :", Podman's "STEP 2/5:"
        on_step(said)
