"""Bytes per stored weather result: each message of the agent's results stream after a 5-row batch.

Prints each message's data size, their mean, and the stream's own byte count per message (headers and
subject included). Run from the repository root: ``python tests/bench/result_bytes.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gym_runtime import Client  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from tests.helpers import ROWS, weather  # noqa: E402


async def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        srv = EmbeddedServer(store_dir=d + "/js", sync="interval")
        srv.start()
        try:
            async with Client(weather(), nats=srv.url) as client:
                rows = await (await client.submit(ROWS)).gather()
                stream = client.bus.subjects.results_stream("weather_agent")
                info = await client.bus.js.stream_info(stream)
                sizes = [
                    len((await client.bus.js.get_msg(stream, seq)).data)
                    for seq in range(info.state.first_seq, info.state.last_seq + 1)
                ]
        finally:
            srv.stop()
    print(f"{len(rows)} rows; stored result data: {sizes} B, mean {sum(sizes) / len(sizes):.1f} B")
    print(f"stream bytes per message (headers and subject included): {info.state.bytes / info.state.messages:.1f} B")


if __name__ == "__main__":
    anyio.run(main)
