"""A byte relay between a TCP port on loopback and a unix socket, to reach a nats-server from another network
namespace without any network between them (no veth, no addresses: the namespaces share only the file
system). Used by ``tests/bench/sandboxes.py --placement``:

    python tests/bench/relay.py unix-to-tcp /path/nats.sock 127.0.0.1:4222   # in the server's namespace
    ip netns exec NS python tests/bench/relay.py tcp-to-unix 127.0.0.1:4222 /path/nats.sock
"""

from __future__ import annotations

import sys

import anyio
from anyio.abc import ByteStream


async def pipe(src: ByteStream, dst: ByteStream) -> None:
    try:
        async for chunk in src:
            await dst.send(chunk)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass
    finally:
        await dst.aclose()


async def serve(mode: str, listen: str, to: str) -> None:
    async def connect() -> ByteStream:
        if mode == "unix-to-tcp":
            host, port = to.rsplit(":", 1)
            return await anyio.connect_tcp(host, int(port))
        return await anyio.connect_unix(to)

    async def handle(client: ByteStream) -> None:
        async with client, await connect() as upstream, anyio.create_task_group() as tg:
            tg.start_soon(pipe, client, upstream)
            tg.start_soon(pipe, upstream, client)

    if mode == "unix-to-tcp":
        listener = await anyio.create_unix_listener(listen)
    else:
        host, port = listen.rsplit(":", 1)
        listener = await anyio.create_tcp_listener(local_host=host, local_port=int(port))
    print("relay ready", flush=True)
    await listener.serve(handle)  # type: ignore[arg-type]


if __name__ == "__main__":
    anyio.run(serve, *sys.argv[1:4])
