"""The messages between a worker and its guest process (``isolation: process``), and their framing.

One socket pair, msgpack frames with a 4-byte length in front. The worker sends ``Start`` once, then calls
(``Seed``, ``Tool``, ``Verify``, ``Close`` for a resource's sessions; ``Rollout`` for an agent's rollouts, which
``Close`` with its session cancels) each with an id; the guest answers each id with ``Done`` or
``Raised``. The guest asks the worker for model calls (``Generate``, answered by ``Generated``) and a hosted
server's calls to other resources (``CallResource``, answered by ``Called``), since the bus stays in the
worker. Typed both ways, so a guest cannot send the worker anything else.
"""

from __future__ import annotations

import asyncio
import mmap
import socket
import struct
from typing import Any, Literal

import msgspec

from gym_runtime.agent import Outcome
from gym_runtime.messages import CreateParams, ErrorInfo, Response, RolloutTask, SandboxCall, SandboxReply
from gym_runtime.resource import Verdict

__all__ = [
    "CallResource",
    "Called",
    "Close",
    "Done",
    "Frames",
    "Page",
    "Generate",
    "Generated",
    "Raised",
    "Ready",
    "Rollout",
    "SandboxDone",
    "SandboxOp",
    "Seed",
    "Start",
    "Tool",
    "Verify",
]

_LEN = struct.Struct(">I")
_ONE = struct.Struct("<q")
_PAIR = struct.Struct("<qq")


class Page:
    """A page both processes map, which the worker reads while the guest is stuck and can answer nothing: the
    call whose code the guest's event loop runs right now, and for each thread running environment code
    (``resource.run_blocking``) its id and its call's (a slot per thread id modulo ``SLOTS``); 0 is none."""

    SLOTS = 256
    SIZE = _ONE.size + SLOTS * _PAIR.size

    def __init__(self, mapped: mmap.mmap) -> None:
        self._m = mapped

    def set_loop(self, call_id: int) -> None:
        _ONE.pack_into(self._m, 0, call_id)

    def loop(self) -> int:
        return int(_ONE.unpack_from(self._m, 0)[0])

    def _at(self, tid: int) -> int:
        return _ONE.size + (tid % self.SLOTS) * _PAIR.size

    def set_thread(self, tid: int, call_id: int) -> None:
        _PAIR.pack_into(self._m, self._at(tid), tid, call_id)

    def clear_thread(self, tid: int, call_id: int) -> None:
        if _PAIR.unpack_from(self._m, self._at(tid)) == (tid, call_id):
            _PAIR.pack_into(self._m, self._at(tid), 0, 0)

    def calls(self) -> set[int]:
        """Every call the page names as running (its loop's and its threads'): read once the guest has died, the
        call it died running (one), or none it can tell."""
        running = {self.loop()}
        for slot in range(self.SLOTS):
            running.add(int(_PAIR.unpack_from(self._m, _ONE.size + slot * _PAIR.size)[1]))
        running.discard(0)
        return running

    def thread(self, tid: int) -> int:
        """The call thread ``tid`` runs (0: none, or its slot was taken by another thread's)."""
        held, call_id = _PAIR.unpack_from(self._m, self._at(tid))
        return int(call_id) if held == tid else 0


GUEST_LOG_LEVEL = "GYM_GUEST_LOG_LEVEL"  # the environment variable: the worker's log level, which its guest logs at


class Start(msgspec.Struct, tag=True):
    """What the guest serves: the resource module, its config entry, its options (``setup``). A hosted NeMo Gym
    server instead (``nemo_gym``, the guest running on its built environment's Python), with the config's
    models and resources its code calls by name (each call made over the worker's bus)."""

    server: str
    entry: str
    options: dict[str, Any]
    nemo_gym: str = ""
    model_names: list[str] = msgspec.field(default_factory=list)
    resource_names: list[str] = msgspec.field(default_factory=list)
    # an agent module instead (``server`` its module path, ``options`` its whole ``AgentConfig``): the guest runs
    # that agent's rollouts (``Rollout``), its model calls made over the worker's bus
    agent: bool = False


class Seed(msgspec.Struct, tag=True):
    id: int
    session: str
    row: dict[str, Any]


class Tool(msgspec.Struct, tag=True):
    id: int
    session: str
    name: str
    arguments: str
    protocol: bool = False  # one of the runtime's own operations (``Resource.call_operation``)


class Verify(msgspec.Struct, tag=True):
    id: int
    session: str
    row: dict[str, Any]
    response: Response
    close: bool = False  # close the session once verified (the worker has dropped it: one message, not two)


class Close(msgspec.Struct, tag=True):
    id: int
    session: str


class Rollout(msgspec.Struct, tag=True):
    """One task of an agent run in the guest (``run``; ``run_group`` with ``size`` > 0). ``session`` names it for a
    ``Close`` that cancels it (the worker gave up on it); ``remaining_s``: its time left (``ctx.remaining()``)."""

    id: int
    session: str
    task: RolloutTask
    remaining_s: float
    size: int = 0


class Generate(msgspec.Struct, tag=True):
    """Guest to worker: a model call of environment code (an LLM judge), made over the worker's bus;
    ``call``: the worker's call whose code made it (0: unknown), under whose span the worker traces it."""

    id: int
    model: str
    params: CreateParams
    call: int = 0
    repeat: int | None = None  # the group task's repeat whose call it is (``agent.in_repeat`` in the guest)


class CallResource(msgspec.Struct, tag=True):
    """Guest to worker: a hosted server's call to another resources server by name (``server_client.post``),
    made over the worker's bus as a session of the worker's; ``token`` names that session (its cookie)."""

    id: int
    server_name: str
    path: str
    body: Any
    token: str = ""


class Called(msgspec.Struct, tag=True):
    """The answer to ``CallResource``: an HTTP status and body as the server's client reads them, and the
    token naming the session the call used (sent back as its cookie)."""

    id: int
    status: int
    body: bytes
    token: str = ""


class SandboxOp(msgspec.Struct, tag=True):
    """Guest to worker: a hosted server's sandbox operation (NeMo Gym's ``sandbox_provider: gym_runtime``), made
    by the worker on the fleet under the lease of ``session``, the guest session whose request made it."""

    id: int
    session: str
    call: SandboxCall


class SandboxDone(msgspec.Struct, tag=True):
    """The answer to ``SandboxOp``: the fleet's reply, or the failure (its class and one line)."""

    id: int
    reply: SandboxReply | None = None
    error: ErrorInfo | None = None


class Ready(msgspec.Struct, tag=True):
    """Guest to worker, once ``setup`` ran: what the worker reads of the class it cannot import itself (a hosted
    server's, whose code needs its built environment)."""

    reverify: Literal["stateless", "replay"] = "stateless"
    answer_field: str | None = None
    row_tools: Literal["resource", "any"] = "resource"


class Done(msgspec.Struct, tag=True):
    id: int
    output: str = ""  # a tool's output
    verdict: Verdict | None = None  # verify's
    episode_done: bool = False  # after a tool: the session's ``Resource.episode_done``
    outcomes: list[Outcome] | None = None  # a rollout's (one per repeat of a group)


class Raised(msgspec.Struct, tag=True):
    """Environment code raised: ``failure`` (a ``Failure``, its info), ``arguments`` (``ToolArgumentsError``,
    shown to the model) or ``error`` (anything else, its type's name kept for the messages rows show)."""

    id: int
    kind: Literal["failure", "arguments", "error"]
    type_name: str
    message: str
    info: ErrorInfo | None = None


class Generated(msgspec.Struct, tag=True):
    id: int
    response: Response | None = None
    error: ErrorInfo | None = None


ToGuest = Start | Seed | Tool | Verify | Close | Rollout | Generated | Called | SandboxDone
FromGuest = Done | Raised | Generate | CallResource | Ready | SandboxOp


class Frames:
    """Length-prefixed msgpack over one socket. ``send`` only buffers (no await, so no lock between the tasks
    that send), and what the tasks of one turn of the event loop send goes out in one write (a system call per
    message was most of a call's cost); asyncio's own streams, as the hot path of every call: an anyio stream
    and lock cost more than the call's own work on a cheap environment."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, receives: Any) -> None:
        self._reader = reader
        self._writer = writer
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(receives)
        self._out: list[bytes] = []

    @classmethod
    async def open(cls, sock: socket.socket, receives: Any) -> Frames:
        reader, writer = await asyncio.open_connection(sock=sock)
        return cls(reader, writer, receives)

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    def send(self, msg: Any) -> None:
        """Queue ``msg``; ``ConnectionError`` when the other side is gone."""
        if self._writer.is_closing():
            raise ConnectionResetError("the other side of the guest's socket is gone")
        body = self._enc.encode(msg)
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out += (_LEN.pack(len(body)), body)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if not self._writer.is_closing():
            self._writer.write(b"".join(out))

    async def receive(self) -> Any:
        """The next message; ``EOFError`` when the other side is gone."""
        try:
            (size,) = _LEN.unpack(await self._reader.readexactly(_LEN.size))
            return self._dec.decode(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise EOFError("the guest's socket closed") from e

    def close(self) -> None:
        self._writer.close()

    async def aclose(self) -> None:
        """Close once what was sent is written."""
        self._flush()
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass
