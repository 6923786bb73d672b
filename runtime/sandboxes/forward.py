"""An exec's output to its caller as it is produced (``box.exec(..., on_output=...)``), over the bus.

Parts are coalesced: a message leaves when ``CHUNK`` bytes of a stream are waiting or ``FLUSH_S`` after the
first byte waited, so a command writing a byte at a time costs a few messages a second, not one a byte. What
is forwarded is what the capture kept (the pool's ``max_output`` of each stream): a command that prints
forever sends at most that much, then nothing until its end.
"""

from __future__ import annotations

import anyio

from gym_runtime.transport.bus import Bus

CHUNK = 32 << 10  # the most bytes of one stream in one message
FLUSH_S = 0.05  # the longest a byte waits for others to share its message


class Forward:
    """The output of the exec handled in this context, sent to its caller (``Bus.send_output``). Run ``run``
    beside the exec, give ``add`` each part, then ``flush`` before the reply."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.waiting: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        self._pending = anyio.Event()
        self._lock = anyio.Lock()  # parts leave in the order they came

    async def add(self, stream: int, data: bytes) -> None:
        self.waiting[stream] += data
        if len(self.waiting[stream]) >= CHUNK:
            await self.flush()
        else:
            self._pending.set()

    async def run(self) -> None:
        while True:
            await self._pending.wait()
            await anyio.sleep(FLUSH_S)
            self._pending = anyio.Event()
            await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            for stream, buf in self.waiting.items():
                while buf:
                    part = bytes(buf[:CHUNK])
                    del buf[:CHUNK]
                    await self.bus.send_output(stream, part)
