"""The crashy server's app with NeMo Gym's own middleware and with gym-runtime's (``hosting.middleware``):
the same requests to both, each answer printed as JSON, for tests/e2e/test_hosted_nemo_gym_servers.py.

Run by the crashy server's built interpreter (nemo-gym importable), from the server's directory.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from gym_runtime.nemo_gym.hosting.asgi import Jar, request
from gym_runtime.nemo_gym.hosting.host import ServerHost, hosted_class

CASES = [
    ("/boom", b'{"n": 3}'),
    ("/boom", b'{"n": "three"}'),
    ("/inner", b"{}"),
    ("/cancelled", b"{}"),
    ("/nope", b"{}"),
    ("/started", b"{}"),
]


async def answers(app: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, body in CASES:
        status, cookies, reply = await request(app, path, body, None)
        out[f"{path} {body.decode()}"] = [status, reply.decode(), bool(cookies)]
    jar = Jar()  # one client's session: its id is kept across calls, its cookie re-sent every time
    ids = []
    for _ in range(3):
        status, cookies, reply = await request(app, "/session", b"{}", jar.header())
        jar.update(cookies)
        ids.append(json.loads(reply)["session_id"])
        out.setdefault("session cookie sent", []).append(bool(cookies))
    out["session ids"] = [len(set(ids)), all(isinstance(i, str) and len(i) == 36 for i in ids)]
    return out


async def main(where: str) -> None:
    cls = hosted_class(ServerHost(where, "env", {}, []))
    await cls.setup({})
    host = cls.host  # type: ignore[attr-defined]
    ours = await host.loop.run(answers(host.app))
    theirs_app = host.instance.setup_webserver()  # a second app of the same server, built as run_webserver does
    host.instance.setup_exception_middleware(theirs_app)
    theirs = await host.loop.run(answers(theirs_app))
    layers = [getattr(m.cls, "__name__", "") for m in host.app.user_middleware]
    await cls.teardown()
    print(json.dumps({"ours": ours, "nemo_gym": theirs, "layers": layers}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
